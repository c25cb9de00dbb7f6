"""Attention read straight from the KV pool's pages — the GPU path — behind one interface.

The gather path (`engines.model.attention`) copies each step's context slots into dense tensors: on
a CPU, next to float32 matmuls, that copy is cheap, and the float models keep it. On a GPU it dominates a decode step (every layer
copies every sequence's whole context, padded to the longest), so the GPU path hands kernels the
step's *page tables* instead and they read K/V where they lie:

* `PagedTables`: per step, per sequence, the pool pages it owns, its context length after the step
  and where its new tokens start in the packed batch. Fixed-width integer tensors on the device —
  a CUDA graph owns one set per batch bucket and rewrites them before each replay.
* `decode(q, ...)`: one new token per sequence (GQA, ragged contexts).
* `extend(q, ...)`: `q_len` new tokens per sequence after a cached prefix, causal (a plain prefill
  is the case of an empty prefix).

Both expect the step's new K/V already written to the pool (`attention.write_kv`), so every key a
query sees comes from the pages. Three implementations: `torch` (this module: a loop per sequence,
exact and slow — the reference), `triton` (`engines.model.triton_attention`, on CUDA tensors,
or on CPU tensors under `TRITON_INTERPRET=1` in the tests) and `cpu` (`engines.model.cpu_attention`:
a C kernel, the int8 model's on a CPU). `kernels_for(device, ...)` picks one;
`BULLET_ATTENTION_KERNELS=torch|triton|cpu` overrides it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from engines import kernel_fallbacks

KERNELS_ENV = "BULLET_ATTENTION_KERNELS"
log = logging.getLogger("engines.attention")


@dataclass
class PagedTables:
    page_table: torch.Tensor  # [B, max_pages] int32: the pool pages of each sequence, in order (unused: any page)
    seq_lens: torch.Tensor  # [B] int32: tokens in the sequence's context after this step (cached + new)
    q_starts: torch.Tensor  # [B + 1] int32: sequence b's new tokens are rows q_starts[b] .. q_starts[b+1] of q
    page_size: int
    max_q_len: int  # the most new tokens of any sequence (1 for a decode step): sizes the extend grid

    @property
    def batch(self) -> int:
        return int(self.seq_lens.shape[0])


def build_tables(page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], q_lens: Sequence[int],
                 page_size: int, device: torch.device | str, width: int | None = None) -> PagedTables:
    """The tables of one step from host lists. `width`: pages per row (default: the longest
    context's); rows are padded with page 0, which no kernel reads past `seq_lens`."""
    need = [-(-n // page_size) for n in ctx_lens]
    width = max(need) if width is None else width
    if max(need, default=0) > width:
        raise ValueError(f"a context needs {max(need)} pages, the table holds {width}")
    table = np.zeros((len(ctx_lens), max(width, 1)), dtype=np.int32)
    for i, (pages, n) in enumerate(zip(page_tables, need)):
        if len(pages) < n:
            raise ValueError(f"sequence {i}: {len(pages)} pages cover fewer than its {ctx_lens[i]} tokens")
        table[i, :n] = pages[:n]
    starts = np.zeros(len(q_lens) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=starts[1:])
    dev = torch.device(device)
    return PagedTables(torch.from_numpy(table).to(dev), torch.tensor(list(ctx_lens), dtype=torch.int32, device=dev),
                       torch.from_numpy(starts).to(dev), page_size, max(q_lens, default=0))


@dataclass
class PagedPart:
    """The sequences of a mixed step that one kernel serves: their q rows (a slice where they lie
    together in the packed batch, else an index tensor) and their own tables."""

    rows: slice | torch.Tensor
    tables: PagedTables
    decode: bool  # one new token each: the decode kernel; else the extend kernel


def split_mixed(page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int], q_lens: Sequence[int],
                page_size: int, device: torch.device | str) -> list[PagedPart] | None:
    """A step that mixes one-token sequences (decode rows) with longer chunks, as two parts: the
    decode kernel for the former, extend for the rest. Extend over everything would give each
    decode row a whole query block (64-128 rows, one of them real) and read its K/V once per query
    head, not once per KV head: served on an H200, a mixed step of ~1,000 new tokens took 35 ms plus
    0.37 ms per decode row beside them (five times what a decode step paid for the same context).
    None unless both kinds are present."""
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if not decode or len(decode) == len(q_lens):
        return None
    starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    parts = []
    for seqs, is_decode in ((decode, True), ([i for i, n in enumerate(q_lens) if n != 1], False)):
        if seqs[-1] - seqs[0] + 1 == len(seqs):  # consecutive sequences: their rows are one slice
            rows: slice | torch.Tensor = slice(int(starts[seqs[0]]), int(starts[seqs[-1] + 1]))
        else:
            rows = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in seqs])).to(device)
        tables = build_tables([page_tables[i] for i in seqs], [ctx_lens[i] for i in seqs], [q_lens[i] for i in seqs],
                              page_size, device)
        parts.append(PagedPart(rows, tables, is_decode))
    return parts


class PagedKernels(Protocol):
    """q: [T, H, D]; k_cache/v_cache: [KV heads, slots, D] (one layer); returns [T, H, D] in q's dtype.
    `attends_prompts`: whether a step of fresh prompts goes to `extend` too (else SDPA over its new K/V)."""

    attends_prompts: bool

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: PagedTables,
               scale: float, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: PagedTables,
               scale: float, out: torch.Tensor | None = None) -> torch.Tensor: ...


class TorchPagedKernels:
    """The reference: per sequence, gather its slots and attend in float32. Exact, slow, any device."""

    name = "torch"
    attends_prompts = False

    def decode(self, q, k_cache, v_cache, tables, scale, out=None):
        return self.extend(q, k_cache, v_cache, tables, scale, out)  # a decode row is a 1-token extend

    def extend(self, q, k_cache, v_cache, tables, scale, out=None):
        out = torch.empty_like(q) if out is None else out
        kvh, group = k_cache.shape[0], q.shape[1] // k_cache.shape[0]
        ps = tables.page_size
        starts, lens = tables.q_starts.tolist(), tables.seq_lens.tolist()
        for b, n_ctx in enumerate(lens):
            q0, q1 = starts[b], starts[b + 1]
            if q1 == q0:
                continue
            pages = tables.page_table[b, : -(-n_ctx // ps)].long()
            slots = (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)[:n_ctx]
            k = k_cache.index_select(1, slots).float()  # [KVH, n_ctx, D]
            v = v_cache.index_select(1, slots).float()
            qb = q[q0:q1].float().view(q1 - q0, kvh, group, -1)  # [n_q, KVH, G, D]
            scores = torch.einsum("qhgd,hkd->hgqk", qb, k) * scale
            # new token j (0-based) sits at position n_ctx - n_q + j and sees keys up to it
            pos = torch.arange(n_ctx - (q1 - q0), n_ctx, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(n_ctx, device=q.device)[None, :] > pos, float("-inf"))
            o = torch.einsum("hgqk,hkd->qhgd", torch.softmax(scores, dim=-1), v)
            out[q0:q1] = o.reshape(q1 - q0, -1, o.shape[-1]).to(out.dtype)
        return out


def kernels_for(device: torch.device | str, q_dtype: torch.dtype | None = None,
                kv_dtype: torch.dtype | None = None) -> PagedKernels:
    """Triton kernels on a CUDA device (when triton imports); on a CPU, the in-place C kernel
    (`engines.model.cpu_attention`) where it serves `q_dtype` queries over a `kv_dtype` pool (float32
    queries) and is built; the torch reference otherwise (and where the dtypes are not given). `BULLET_ATTENTION_KERNELS`
    forces one (`triton` on CPU tensors needs `TRITON_INTERPRET=1`)."""
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"{KERNELS_ENV} must be auto, torch, triton or cpu, got {choice!r}")
    on_cpu = torch.device(device).type == "cpu"
    if choice == "cpu" or (choice == "auto" and on_cpu):
        from engines.model import cpu_attention  # deferred: it imports this module's tables

        if choice == "cpu" and not on_cpu:
            raise ValueError(f"{KERNELS_ENV}=cpu serves CPU tensors, not {device}")
        if q_dtype is not None and kv_dtype is not None and cpu_attention.available(q_dtype, kv_dtype):
            return cpu_attention.CpuPagedKernels()
        if choice == "cpu":
            raise RuntimeError(f"{KERNELS_ENV}=cpu but the CPU kernel does not serve {q_dtype} queries over a "
                               f"{kv_dtype} pool here (or engines._cpu_attention is not built)")
        return TorchPagedKernels()
    if choice == "torch":
        return TorchPagedKernels()
    try:
        from engines.model.triton_attention import TritonPagedKernels  # deferred: triton is optional
    except ImportError as e:
        if choice == "triton":
            raise RuntimeError(f"{KERNELS_ENV}=triton but triton does not import: {e}") from e
        # the reference still computes the right thing, but slowly and with a host sync per layer
        log.warning("triton does not import (%s): paged attention on %s runs the slow torch reference", e, device)
        kernel_fallbacks.record("triton paged attention", "the torch reference (a host sync per layer)", e)
        return TorchPagedKernels()
    return TritonPagedKernels()
