"""Describe the local CPU by measurement, for the SRM: units = cores.

For k = 1..N cores (the calling thread pinned to the first k allowed cores, torch using k threads)
we time a square GEMM (compute, fp32 and bf16), a large matrix-vector product (bandwidth-bound:
it reads the matrix once, like a decode step reads the weights) and a copy. N_d is where bandwidth
stops growing: D_peak / D(1 core), clamped to [1, N]. The per-core-count rates are kept in the spec
and used as they are, since a CPU's cores share caches and clocks.

`measure_contention` then measures Bullet's D_{p,sl} on the CPU: the matrix-vector bandwidth on p
cores while a GEMM of sl rows runs on the other cores (in a child process pinned there), and the
GEMM's slowdown meanwhile. Both feed `ContentionModel`.

    python -m estimator.profiler.cpu_probe [--quick] [--out hw.json]"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm

from estimator.contention import ContentionModel
from estimator.hardware import HardwareSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ProbeSizes:
    gemm_n: int = 1024  # square GEMM side
    matrix_mb: int = 256  # matrix-vector and copy working set, well beyond the last-level cache
    min_seconds: float = 0.25  # per measurement

    @classmethod
    def quick(cls) -> "ProbeSizes":
        return cls(gemm_n=256, matrix_mb=64, min_seconds=0.03)


def allowed_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@contextmanager
def pinned(cores: list[int]):
    """Run the calling thread on `cores` with as many torch threads; restore both afterwards."""
    old_cores, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, old_cores)
        torch.set_num_threads(old_threads)


def _rate(work: float, fn, min_seconds: float) -> float:
    """work units per second of `fn`, best of several short timing windows: on a shared machine the
    best window is the one least disturbed by other processes."""
    fn()  # warm up: allocation, thread pool start
    best, spent = 0.0, 0.0
    while spent < min_seconds:
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed > min_seconds / 8:
                break
        best = max(best, work * calls / elapsed)
        spent += elapsed
    return best


def gemm_flops(n: int, dtype: str, min_seconds: float) -> float:
    a = torch.randn(n, n, dtype=TORCH_DTYPES[dtype])
    b = torch.randn(n, n, dtype=TORCH_DTYPES[dtype])
    out = torch.empty(n, n, dtype=TORCH_DTYPES[dtype])
    return _rate(2.0 * n ** 3, lambda: torch.mm(a, b, out=out), min_seconds)


def matvec_bandwidth(matrix_mb: int, min_seconds: float) -> float:
    cols = 4096
    rows = matrix_mb * 2 ** 20 // (4 * cols)
    m, v, out = torch.randn(rows, cols), torch.randn(cols), torch.empty(rows)
    return _rate(float(m.numel() * 4), lambda: torch.mv(m, v, out=out), min_seconds)


def copy_bandwidth(matrix_mb: int, min_seconds: float) -> float:
    src = torch.randn(matrix_mb * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    return _rate(2.0 * src.numel() * 4, lambda: dst.copy_(src), min_seconds)


def dispatch_overhead(min_seconds: float) -> float:
    """Seconds per tiny torch op: what every kernel of a CPU forward pays beyond its work."""
    a, b, out = torch.ones(16), torch.ones(16), torch.empty(16)
    return 1.0 / _rate(1.0, lambda: torch.add(a, b, out=out), min_seconds)


def probe_cpu(cores: list[int] | None = None, sizes: ProbeSizes = ProbeSizes(), progress: bool = True,
              name: str | None = None) -> HardwareSpec:
    cores = cores or allowed_cores()
    n = len(cores)
    flops: dict[str, list[float]] = {"fp32": [], "bf16": []}
    matvec, copy = [], []
    steps = tqdm(total=4 * n + 1, desc="cpu probe", unit="step", disable=not progress, leave=False)
    for k in range(1, n + 1):
        with pinned(cores[:k]):
            for dtype in ("fp32", "bf16"):
                steps.set_postfix_str(f"{k} cores: GEMM {dtype}")
                flops[dtype].append(gemm_flops(sizes.gemm_n, dtype, sizes.min_seconds))
                steps.update()
            steps.set_postfix_str(f"{k} cores: bandwidth")
            matvec.append(matvec_bandwidth(sizes.matrix_mb, sizes.min_seconds))
            steps.update()
            copy.append(copy_bandwidth(sizes.matrix_mb, sizes.min_seconds))
            steps.update()
    with pinned(cores[:1]):
        overhead = dispatch_overhead(sizes.min_seconds)
    steps.update()
    steps.close()
    raw = {"fp32": list(flops["fp32"]), "bf16": list(flops["bf16"]), "matrix-vector": list(matvec)}
    flops = {d: _non_decreasing(v) for d, v in flops.items()}
    matvec = _non_decreasing(matvec)
    peak_bw = matvec[-1]
    return HardwareSpec(
        name=name or f"cpu-{n}c", kind="cpu", units=n, unit_name="core",
        peak_flops={d: v[-1] for d, v in flops.items()}, peak_bandwidth=peak_bw,
        bandwidth_inflection=round(max(1.0, min(float(n), peak_bw / matvec[0])), 2),
        partition_step=1, min_partition=1, blocks_per_unit=1,
        wave_quantization=False,  # CPU GEMMs split work finely and evenly over threads
        kernel_overhead_s=overhead, measured_flops=flops, measured_bandwidth=matvec,
        source=f"estimator.profiler.cpu_probe on cores {cores} (torch {torch.__version__}, "
               f"GEMM {sizes.gemm_n}^3, matrix-vector {sizes.matrix_mb} MB)",
        assumptions=(
            "rates made non-decreasing in cores: a drop with more cores is other processes "
            "interfering (OpenMP waits for a descheduled thread), not the hardware",
            f"raw measurements by cores (FLOP/s, B/s): { {k: [round(x) for x in v] for k, v in raw.items()} }",
            f"copy bandwidth by cores (B/s, read+write): {[round(c) for c in copy]}",
        ),
    )


def _non_decreasing(rates: list[float]) -> list[float]:
    out, best = [], 0.0
    for rate in rates:
        best = max(best, rate)
        out.append(best)
    return out


# ---- contention: decode-like bandwidth beside a prefill-like GEMM ----------------------------------

# Runs GEMMs on its cores until its stdin closes (or `seconds` pass), then prints each call's
# (start, end) on the parent's clock (perf_counter is system-wide on Linux).
_GEMM_CHILD = """
import os, sys, threading, time, torch
cores, rows, hidden, seconds = eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
os.sched_setaffinity(0, cores); torch.set_num_threads(len(cores))
x, w = torch.randn(rows, hidden), torch.randn(hidden, hidden)
stop = threading.Event(); threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
torch.mm(x, w); print("ready", flush=True)
end, log = time.perf_counter() + seconds, []
while not stop.is_set() and (now := time.perf_counter()) < end:
    torch.mm(x, w); log.append((now, time.perf_counter()))
print(" ".join(f"{a:.6f},{b:.6f}" for a, b in log), flush=True)
"""


def _gemm_rate(log: list[tuple[float, float]], lo: float, hi: float) -> float:
    """GEMM calls per second among the calls that ran entirely inside [lo, hi]."""
    inside = [b - a for a, b in log if a >= lo and b <= hi]
    return len(inside) / sum(inside) if inside else float("nan")


def measure_contention(decode_cores: list[int], prefill_cores: list[int], prefill_tokens=(64, 512, 2048),
                       hidden: int = 2048, sizes: ProbeSizes = ProbeSizes(), progress: bool = True) -> ContentionModel:
    """D_{p,sl}: matrix-vector bandwidth on `decode_cores` beside a GEMM of sl x hidden x hidden on
    `prefill_cores`, as a fraction of the same bandwidth alone; plus the GEMM's slowdown meanwhile
    (recorded against a decode batch of 1: the probe saturates bandwidth, the worst case)."""
    model = ContentionModel()
    with pinned(decode_cores):
        alone = matvec_bandwidth(sizes.matrix_mb, sizes.min_seconds)
    window = max(0.2, sizes.min_seconds)
    slowdowns = []
    for sl in tqdm(prefill_tokens, desc="contention", disable=not progress, leave=False):
        child = subprocess.Popen([sys.executable, "-c", _GEMM_CHILD, repr(list(prefill_cores)), str(sl), str(hidden),
                                  str(10 * window + 5.0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            child.stdout.readline()  # "ready": torch imported, first GEMM done
            solo_from = time.perf_counter()
            time.sleep(window)
            together_from = time.perf_counter()
            with pinned(decode_cores):
                beside = matvec_bandwidth(sizes.matrix_mb, window)
            together_to = time.perf_counter()
            child.stdin.close()
            log = [tuple(map(float, pair.split(","))) for pair in child.stdout.readline().split()]
        finally:
            if not child.stdin.closed:
                child.stdin.close()  # the child stops at EOF
            child.wait(timeout=60)
        model.add_bandwidth(len(decode_cores), sl, min(1.0, beside / alone))
        solo, shared = _gemm_rate(log, solo_from, together_from), _gemm_rate(log, together_from, together_to)
        if solo == solo and shared == shared:  # both windows held whole GEMM calls (not NaN)
            slowdowns.append(max(1.0, solo / shared))
    if slowdowns:
        model.add_slowdown(1, max(slowdowns))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, ~seconds (less accurate)")
    parser.add_argument("--out", help="write the HardwareSpec JSON here")
    args = parser.parse_args()
    spec = probe_cpu(sizes=ProbeSizes.quick() if args.quick else ProbeSizes())
    for k in range(spec.units):
        print(f"{k + 1} core(s): GEMM fp32 {spec.measured_flops['fp32'][k] / 1e9:6.1f} GFLOP/s, "
              f"bf16 {spec.measured_flops['bf16'][k] / 1e9:6.1f} GFLOP/s, "
              f"matrix-vector {spec.measured_bandwidth[k] / 1e9:5.1f} GB/s")
    print(f"N_d = {spec.bandwidth_inflection} cores; dispatch overhead {spec.kernel_overhead_s * 1e6:.1f} us")
    if args.out:
        spec.to_json(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
