"""Timing on a GPU: CUDA events for kernels, the host clock for whole steps.

* `kernels(run)`: events recorded on the current stream (the share's) around `run`, after warm-up;
  the median over repeats. With `graphs=True` the run is first captured as a CUDA graph and the
  replays are timed: the kernels' own time, without the gaps Python leaves between launches — what
  a decode step replayed as a graph sees.
* `step(run)`: wall time from the call to the end of its kernels (the stream synchronized), the
  way a worker's executor times a step and the policy observes it.

A GPU is not shared with other jobs the way the development CPUs are, so there is no disturbance
filtering here; the median guards against the odd slow run (clock ramp-up, a page fault).

Nothing here runs without CUDA; the profiler's logic is tested with a fake `GpuTimer`."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Protocol


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
