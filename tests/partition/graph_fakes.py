"""Stand-ins for what decode CUDA graphs need from a GPU, so their bookkeeping runs on the CPU:

* `RerunGraphs`: a `GraphApi` whose replay re-runs the captured body on whatever the inputs hold —
  what a CUDA graph does, minus the GPU;
* `StrictGraphs`: the same, but the capture runs under `HostReadGuard`, which fails on anything a
  real capture forbids: reading a tensor's values on the host (`.item()`, `.tolist()`, `int(t)`,
  `if t:`, `.numpy()`, `.cpu()`) or an operator whose output shape depends on values (`nonzero`, a
  boolean-mask index);
* `GatherPagedKernels`: paged decode attention with no host read — every row gathers its full
  fixed-width page table and masks past its context length — so a strict capture can run on the
  CPU (the torch reference kernels read the lengths with `.tolist()`; on CUDA the Triton kernels
  take this place)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from engines.model.paged_attention import TorchPagedKernels


class RerunGraphs:
    """Captures by remembering the body; counts captures (`bodies`) and releases."""

    def __init__(self):
        self.bodies, self.released = [], 0

    def _run_capture(self, body):
        return body()

    def capture(self, body):
        api = self
        body()  # the warm-up run, as TorchCudaGraphs does
        self._run_capture(body)
        api.bodies.append(body)

        class Graph:
            def replay(self):
                return body()

            def release(self):
                api.released += 1

        return Graph()


class HostRead(AssertionError):
    pass


_HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__", "numpy", "cpu",
               "nonzero", "argwhere", "masked_select", "unique", "__repr__", "__format__"}


class HostReadGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            raise HostRead(f"a CUDA graph capture cannot run {name}: it reads device values on the host")
        if name == "__getitem__" and len(args) > 1 and _has_bool_index(args[1]):
            raise HostRead("a boolean-mask index has a value-dependent shape: a capture cannot run it")
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class StrictGraphs(RerunGraphs):
    def _run_capture(self, body):
        with HostReadGuard():
            return body()


class GatherPagedKernels:
    """Decode over every row's whole page table, masked by its length: no value leaves the device.
    Extend (prefill) runs the torch reference: it only serves eager steps here."""

    name = "gather"

    def decode(self, q, k_cache, v_cache, tables, scale, out=None):
        rows, width = tables.page_table.shape
        ps, kvh, d = tables.page_size, k_cache.shape[0], k_cache.shape[2]
        group = q.shape[1] // kvh
        slots = (tables.page_table.long()[:, :, None] * ps + torch.arange(ps)).reshape(rows, width * ps)
        k, v = k_cache[:, slots].float(), v_cache[:, slots].float()  # [KVH, rows, S, D]
        scores = torch.einsum("bhgd,hbsd->bhgs", q.float().view(rows, kvh, group, d), k) * scale
        beyond = torch.arange(width * ps)[None, :] >= tables.seq_lens.long()[:, None]
        scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
        o = torch.einsum("bhgs,hbsd->bhgd", torch.softmax(scores, dim=-1), v).reshape(q.shape)
        if out is None:
            return o.to(q.dtype)
        out.copy_(o)
        return out

    def extend(self, q, k_cache, v_cache, tables, scale, out=None):
        return TorchPagedKernels().extend(q, k_cache, v_cache, tables, scale, out)
