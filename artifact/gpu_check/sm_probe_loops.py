"""The isolation probe's workloads on one share: each `run(seconds)` keeps its share busy for that
long and says how much it got done.

On a GPU (kernels from `csrc/sm_probe.cu`, launched on the share's stream):
* `SpinLoop`: blocks that each hold one SM for `SPIN_NS` of wall time, `WAVES` blocks per unit of
  the share per launch; `effective_units` = blocks per second x spin time = the SMs the stream got.
  `graph=True` replays the launches from a CUDA graph captured on the stream instead.
* `FmaLoop`: register-only FMAs (the SM clock: power and thermal limits).
* `CopyLoop`: a streaming copy (HBM bandwidth).
* the GEMM: `bullet.doctor.isolation_child.GemmLoop`, the doctor's isolation probe.

On a CPU, cores are the units: `CpuSpinLoop` runs one thread per core of the share, each pinned to
its core, each doing "blocks" of `CPU_SPIN_S` of its own CPU time (a thread sharing its core with
another gets half the CPU time per wall second — the CPU's counterpart of a block that holds its SM);
`TorchCopyLoop` copies tensors. The same orchestration and verdict then run in a test."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from artifact.gpu_check.sm_probe_kernels import FMA_CHAINS

SPIN_NS = 200_000  # one block's spin: long beside the µs a block takes to start
WAVES = 4  # blocks per unit of the share per launch: the launch runs WAVES spins back to back
BURST_S = 0.01  # launches queued between two synchronisations: about this long
CPU_SPIN_S = 0.002  # one CPU "block": this much of a thread's own CPU time
_HASH_CHUNK = bytes(16384)  # hashlib releases the GIL on buffers this large: the threads really run in parallel


def _result(count: float, seconds: float, unit: str, **extra) -> dict:
    return {"count": count, "seconds": seconds, "rate": count / seconds if seconds > 0 else 0.0, "unit": unit, **extra}


def _repeat_for(seconds: float, once, per_call: int = 1) -> tuple[int, float]:
    """Call `once` until `seconds` have passed (at least once): (units of work done, seconds taken)."""
    n, t0 = 0, time.perf_counter()
    while True:
        once()
        n += per_call
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return n, elapsed


class SpinLoop:
    def __init__(self, kernels, torch, stream_handle, units: int, graph: bool = False):
        self.k, self.torch, self.units, self.graph = kernels, torch, units, graph
        self.handle = stream_handle  # a callable: the share's current stream
        self.blocks = max(1, units) * WAVES
        self.smids = torch.full((self.blocks,), -1, dtype=torch.int32, device="cuda")
        self.starts = torch.zeros((self.blocks,), dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()  # the fill ran on torch's stream; the spins run on another one
        self.per_launch_s = WAVES * SPIN_NS / 1e9
        self.launches = max(1, round(BURST_S / self.per_launch_s))
        self._exec = None
        if graph:
            self._exec = kernels.graph_capture(self.handle(), self.blocks, SPIN_NS, self.smids.data_ptr(),
                                               self.starts.data_ptr(), self.launches)
        self._burst()  # warm-up: module load, first launch

    def _burst(self) -> None:
        stream = self.handle()
        if self._exec is not None:
            self.k.graph_launch(self._exec, stream)
        else:
            for _ in range(self.launches):
                self.k.spin(stream, self.blocks, SPIN_NS, self.smids.data_ptr(), self.starts.data_ptr())
        self.k.sync(stream)

    def run(self, seconds: float) -> dict:
        n, elapsed = _repeat_for(seconds, self._burst, self.launches)
        blocks = n * self.blocks
        smids, starts = self.smids.cpu().tolist(), self.starts.cpu().tolist()
        return _result(blocks, elapsed, "blocks", effective_units=blocks / elapsed * SPIN_NS / 1e9,
                       smids_seen=len({s for s in smids if s >= 0}), graph=self.graph,
                       shared_sm_blocks=overlapping_blocks(smids, starts, SPIN_NS))

    def close(self) -> None:
        if self._exec is not None:
            self.k.graph_destroy(self._exec)
            self._exec = None


def overlapping_blocks(smids: list[int], starts: list[int], spin_ns: int, slack: float = 0.9) -> int:
    """Blocks of one launch that started on an SM while another block still held it: 0 when the
    shared-memory request kept every SM to one block (the probe's premise; %smid ids as the
    process sees them, which under MPS are its own numbering, consistent within the process)."""
    by_sm: dict[int, list[int]] = {}
    for sm, t in zip(smids, starts):
        if sm >= 0 and t > 0:
            by_sm.setdefault(sm, []).append(t)
    return sum(1 for ts in by_sm.values() for a, b in zip(sorted(ts), sorted(ts)[1:]) if b - a < slack * spin_ns)


class FmaLoop:
    THREADS = 256

    def __init__(self, kernels, torch, stream_handle, units: int, iters: int = 4096):
        self.k, self.handle, self.iters = kernels, stream_handle, iters
        self.blocks = max(1, units) * 8
        self.sink = torch.zeros(1, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        self.flop = 2 * FMA_CHAINS * iters * self.THREADS * self.blocks
        self.launches = 1
        self._burst()  # warm-up: the first launch loads the module
        t0 = time.perf_counter()
        self._burst()
        self.launches = max(1, int(BURST_S / max(time.perf_counter() - t0, 1e-6)))

    def _burst(self) -> None:
        stream = self.handle()
        for _ in range(self.launches):
            self.k.fma(stream, self.blocks, self.THREADS, self.iters, self.sink.data_ptr())
        self.k.sync(stream)

    def run(self, seconds: float) -> dict:
        n, elapsed = _repeat_for(seconds, self._burst, self.launches)
        return _result(n * self.flop / 1e12, elapsed, "Tflop")


class CopyLoop:
    def __init__(self, kernels, torch, stream_handle, units: int, mib: int = 512):
        self.k, self.handle = kernels, stream_handle
        self.nbytes = mib << 20
        self.src = torch.ones(self.nbytes // 4, dtype=torch.float32, device="cuda")
        self.dst = torch.empty_like(self.src)
        torch.cuda.synchronize()
        self.blocks = max(1, units) * 8
        self._copy()

    def _copy(self) -> None:
        stream = self.handle()
        self.k.copy(stream, self.blocks, self.src.data_ptr(), self.dst.data_ptr(), self.nbytes)
        self.k.sync(stream)

    def run(self, seconds: float) -> dict:
        n, elapsed = _repeat_for(seconds, self._copy)
        return _result(n * 2 * self.nbytes / 1e9, elapsed, "GB")  # read + write


class CpuSpinLoop:
    """One thread per core of the share (`cores`), each pinned to its core for the phase."""

    def __init__(self, cores):
        self.cores = sorted(cores)

    @staticmethod
    def _spin(core: int, deadline: float, counts: list[int], slot: int) -> None:
        try:
            os.sched_setaffinity(0, {core})  # 0: the calling thread (Linux)
        except OSError:
            pass
        blocks = 0
        while time.perf_counter() < deadline:
            start = time.thread_time()
            while time.thread_time() - start < CPU_SPIN_S:
                hashlib.sha256(_HASH_CHUNK).digest()
            blocks += 1
        counts[slot] = blocks

    def run(self, seconds: float) -> dict:
        counts = [0] * len(self.cores)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._spin, args=(c, t0 + seconds, counts, i), daemon=True)
                   for i, c in enumerate(self.cores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        blocks = sum(counts)
        return _result(blocks, elapsed, "blocks", effective_units=blocks / elapsed * CPU_SPIN_S,
                       smids_seen=len(self.cores), graph=False)

    def close(self) -> None:
        pass


class TorchCopyLoop:
    """The CPU's streaming copy (memory bandwidth), on the share's torch threads."""

    def __init__(self, torch, mib: int = 32):
        self.src = torch.ones((mib << 20) // 4, dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.nbytes = mib << 20

    def run(self, seconds: float) -> dict:
        n, elapsed = _repeat_for(seconds, lambda: self.dst.copy_(self.src))
        return _result(n * 2 * self.nbytes / 1e9, elapsed, "GB")
