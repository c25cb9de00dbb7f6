"""What a device moves and computes, measured: the rates a step's floor is computed from.

* copy bandwidth: one large device-to-device copy (`dst.copy_(src)`), counted as the bytes read plus
  the bytes written — on a GPU the same measure as the estimator's profiler (1 GiB, far past L2);
* GEMM rate: a square matmul in the serving dtype, 2 n^3 FLOPs.

Kernels are timed with CUDA events on a GPU (the kernels' own time) and with the host clock on a CPU;
each rate is the best of a few repeats after a warm-up (a rate is what the device *can* do).
Whole steps are timed with `wall_seconds`: the host clock from the call to the end of its kernels,
what a worker's step costs (Python and launches included)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_seconds(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds from calling `run` to the end of its kernels, per repeat (after `warmup` calls)."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def kernel_seconds(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """The fastest repeat of `run`'s kernels."""
    if device.type != "cuda":
        return min(wall_seconds(run, device, repeats, warmup))
    for _ in range(warmup):
        run()
    stream = torch.cuda.current_stream(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return min(times)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second read plus written by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = kernel_seconds(lambda: dst.copy_(src), device, repeats)
    return 2.0 * src.numel() * src.element_size() / seconds


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / kernel_seconds(lambda: a @ b, device, repeats)


def median(xs: list[float]) -> float:
    return statistics.median(xs)
