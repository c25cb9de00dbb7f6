"""Timing on a GPU: CUDA events for kernels, the host clock for whole steps.

* `kernels(run)`: events recorded on the current stream (the share's) around `run`, after warm-up;
  the median over repeats. With `graphs=True` the run is first captured as a CUDA graph and the
  replays are timed: the kernels' own time, without the gaps Python leaves between launches — what
  a decode step replayed as a graph sees.
* `step(run)`: wall time from the call to the end of its kernels (the stream synchronized), the
  way a worker's executor times a step and the policy observes it.

A GPU is not shared with other jobs the way the development CPUs are, so there is no disturbance
filtering here; the median guards against the odd slow run (clock ramp-up, a page fault).

`CudaTimer` is the GPU's `session.Timer` around a `GpuTimer`: `CudaEventTimer`, or in the tests a
fake (nothing here runs without CUDA; the profiler's logic is tested with the fake)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Protocol

from estimator.profiler.cuda_ops import op_times
from estimator.profiler.timing import Timing
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase


class GpuTimer(Protocol):
    def kernels(self, run: Callable[[], object]) -> float:
        """Seconds the kernels `run` launches take on the current stream."""

    def step(self, run: Callable[[], object]) -> float:
        """Seconds from calling `run` to the end of its kernels."""


class CudaEventTimer:
    def __init__(self, repeats: int = 5, warmup: int = 2, graphs: bool = False):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA timing needs a CUDA device")
        self._torch = torch
        self.repeats, self.warmup, self.graphs = repeats, warmup, graphs

    def kernels(self, run: Callable[[], object]) -> float:
        torch = self._torch
        stream = torch.cuda.current_stream()
        for _ in range(self.warmup):
            run()
        launch = run
        if self.graphs:
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                run()
            launch = graph.replay
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)  # elapsed_time is in milliseconds
        if self.graphs:
            graph.reset()
        return statistics.median(times)

    def step(self, run: Callable[[], object]) -> float:
        stream = self._torch.cuda.current_stream()
        for _ in range(self.warmup):
            run()
        stream.synchronize()
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            run()
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


class CudaTimer:
    """The GPU's `session.Timer`: steps and each kernel class (`cuda_ops.op_times`) timed by a
    `GpuTimer`, which sets its own repeats. Nothing to wait for and no run to leave out: every
    timing counts as usable. The log keeps the lines `from_log` reads back."""

    unit_name = "SMs"

    def __init__(self, timer: GpuTimer):
        self.timer = timer

    def settle(self, own_pids: tuple[int, ...]) -> None:
        pass  # a GPU is not shared with other jobs (see above)

    def step(self, run: Callable[[], object], repeats: int, own_pids: tuple[int, ...]) -> Timing:
        return Timing(self.timer.step(run), runs=(), usable=1)

    def kernels(self, bench: ModelBench, case: PrefillCase | DecodeCase, units: int,
                repeats: int) -> tuple[dict[str, float], Timing]:
        times = op_times(bench, case, self.timer.kernels)
        return times, Timing(sum(times.values()), runs=(), usable=1)

    def describe(self, timing: Timing, kernel_times: dict[str, float] | None = None) -> str:
        return f"{timing.seconds * 1e3:.2f} ms" + (" per layer-set" if kernel_times is not None else "")
