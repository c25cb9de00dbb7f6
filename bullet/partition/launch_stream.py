"""The stream a worker's steps launch on, bound to the worker's partition backend.

An SM partition restricts *a stream*: libsmctrl writes its TPC mask into one stream's private
struct, and a green context's SMs belong to the streams created in it. A worker therefore has to
own a stream that carries its partition and launch **every** kernel of every step on it — the
layers, the KV writes, sampling, the copies of the step's tables to the device. `WorkerStream.step()`
is where that holds: an executor runs each step inside it, and inside, the partitioned stream is
the current CUDA stream, which is where torch launches everything.

Per backend:
* `libsmctrl`: the worker creates its own stream *before* the backend and hands the backend that
  handle. (A fresh worker's current stream is the legacy default stream, which cannot carry a mask.)
  `apply` rewrites the mask of that one stream; steps keep running on it.
* `green-ctx`: the backend owns one stream per share; `apply` selects one and the next `step()`
  makes it current, so a repartition between two steps switches streams.
* `none` on a GPU: the worker's own stream, unrestricted. `mps-percentage`: the worker's own stream;
  the whole process is capped by MPS. `cpu`: no stream; `step()` does nothing.

`step()` ends by synchronizing its stream: the step time the executor reports is what the policy
observes (launches return before kernels finish), and the next step may run on another stream (a
green-context switch) and read what this one wrote — KV pages, a layer group's hidden state.

CUDA is reached through `CudaAccess.streams` — torch.cuda in a worker (`TorchCudaStreams`), a
recording fake in the tests, which therefore check on a machine without a GPU that the handle the
backend masks is the stream the steps run on."""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Hashable, Iterable, Iterator, Protocol

import torch

from bullet.partition import PartitionBackend, PartitionUnavailable, make_backend
from bullet.partition.backend_choice import choose_for_device
from bullet.partition.cuda_access import CudaAccess, cuda_access
from engines.device import require_device

# backends that restrict the stream they are given, rather than providing their own streams
_MASKS_GIVEN_STREAM = {"libsmctrl"}
_OWNS_STREAMS = {"green-ctx"}


class StreamApi(Protocol):
    """The few stream operations a worker needs."""

    def create(self) -> object:
        """A new stream owned by this worker (never the default stream)."""

    def wrap(self, handle: int) -> object:
        """A stream created elsewhere (a green-context stream), by its CUstream handle."""

    def handle(self, stream: object) -> int: ...

    def use(self, stream: object) -> ContextManager:
        """Make `stream` the calling thread's current stream for the block."""

    def synchronize(self, stream: object) -> None: ...

    def current_handle(self) -> int:
        """The calling thread's current stream: where the next kernel would launch."""


class TorchCudaStreams:
    """`StreamApi` over torch.cuda (a worker process on an NVIDIA GPU)."""

    def __init__(self, device: torch.device):
        self._torch = torch
        self.device = require_device(device)

    def create(self):
        # a pool stream, created non-blocking: it does not synchronize with the legacy default stream
        return self._torch.cuda.Stream(device=self.device)

    def wrap(self, handle: int):
        return self._torch.cuda.ExternalStream(handle, device=self.device)

    def handle(self, stream) -> int:
        return int(stream.cuda_stream)

    def use(self, stream):
        return self._torch.cuda.stream(stream)

    def synchronize(self, stream) -> None:
        stream.synchronize()

    def current_handle(self) -> int:
        return int(self._torch.cuda.current_stream(self.device).cuda_stream)


class WorkerStream:
    """Where a worker's steps run: the stream its partition backend restricts, looked up at every
    step (a green-context backend changes it on `apply`). `api=None` means a CPU worker."""

    def __init__(self, partition: PartitionBackend, api: StreamApi | None = None, own: object | None = None):
        self.partition, self.api, self.own = partition, api, own
        self._wrapped: dict[int, object] = {}

    @property
    def on_gpu(self) -> bool:
        return self.api is not None

    def current(self) -> object | None:
        """The stream the next step launches on (None on a CPU worker)."""
        if self.api is None:
            return None
        handle = self.partition.launch_stream()
        if handle is None or (self.own is not None and handle == self.api.handle(self.own)):
            if self.own is None:
                raise RuntimeError(f"{self.partition.name}: the backend names no stream and the worker owns none")
            return self.own
        stream = self._wrapped.get(handle)
        if stream is None:  # wrapped once per pool stream: the wrappers are cached for the worker's life
            stream = self._wrapped[handle] = self.api.wrap(handle)
        return stream

    def handle(self) -> int | None:
        stream = self.current()
        return None if stream is None else self.api.handle(stream)

    @contextmanager
    def step(self) -> Iterator[object | None]:
        """Run a step's launches on the partitioned stream; wait for them at the end."""
        stream = self.current()
        if stream is None:
            yield None
            return
        with self.api.use(stream):
            yield stream
        self.api.synchronize(stream)

    def synchronize(self) -> None:
        """Wait for the current step's kernels (call inside `step()` before reading a clock)."""
        stream = self.current()
        if stream is not None:
            self.api.synchronize(stream)

    def each_share(self, units: Iterable[int] | None = None) -> Iterator[Hashable]:
        """Each share in turn (default: every share the backend grants), applied and with its stream
        current inside `step()`; yields the share's key. The hook for whatever a share needs before
        serving — per-share CUDA graphs captured at start-up rather than in a step of the serving path
        (a capture costs a few eager steps). The share in force before is restored afterwards."""
        before = self.partition.current_units
        try:
            for count in (self.partition.feasible_units() if units is None else units):
                self.partition.apply(count)
                with self.step():
                    yield self.share_key()
        finally:
            self.partition.apply(before)

    def share_key(self) -> Hashable:
        """Names the current share: (stream handle, units). A CUDA graph that keeps the partition it
        was captured under must be captured once per share and replayed only under it."""
        return self.handle(), self.partition.current_units


def open_worker_partition(name: str, role: str, device: torch.device, options: dict | None = None,
                          cuda: CudaAccess | None = None) -> tuple[PartitionBackend, WorkerStream]:
    """Build partition backend `name` for `role` together with the stream the worker's steps will
    launch on, in the order the backend needs: libsmctrl is handed the worker's own stream to mask;
    green-ctx brings its own streams; `none` on a GPU shares every SM of `device`. `device`: the
    serving device (`engines.device.resolve_device`); `cuda` replaces torch.cuda (tests)."""
    device = require_device(device)
    options = dict(options or {})
    if name == "auto":  # what `--partition-backend auto` resolves to on this machine
        name = choose_for_device(device, cuda).backend
    if device.type != "cuda":
        backend = make_backend(name, role, **options)
        return backend, WorkerStream(backend)
    cuda = cuda_access(cuda)
    api = cuda.streams(device)
    own = None if name in _OWNS_STREAMS else api.create()
    if name in _MASKS_GIVEN_STREAM:
        options.setdefault("device", device.index)
        options["stream"] = api.handle(own)
    elif name in _OWNS_STREAMS:
        options.setdefault("device", device.index)
        if "driver" not in options:
            try:
                options["driver"] = cuda.green_ctx_driver()
            except PartitionUnavailable as exc:
                raise PartitionUnavailable(f"{name} unavailable: {exc}") from exc
    elif name == "mps-percentage":  # MPS caps the whole process; the backend reports the device's SMs
        options.setdefault("device", device.index)
        options.setdefault("total_units", cuda.sm_count(device))
    elif name == "none" and "total_units" not in options:  # the naive baseline shares every SM
        options.update(total_units=cuda.sm_count(device), unit_kind="SM")
    backend = make_backend(name, role, **options)
    return backend, WorkerStream(backend, api, own)
