"""What a share of this GPU computes and moves: a GEMM and a copy timed on each profiled share, and
the hardware description the estimator starts from (Bullet §3.2.2, C_p and D_p measured, not read
off a spec sheet).

The SRM's baseline is then this GPU as it behaves under this partition backend — spec-sheet peaks
are about 30 % off real kernels on H100 before calibration; the calibration (Eq. 2) fits what
remains per kernel class. Rates are measured at a few shares and interpolated linearly for the
others (through zero below the smallest), which is what the SRM assumes between measured points."""

from __future__ import annotations

from typing import Callable, Sequence

from estimator.hardware import BUILTIN, HardwareSpec

GEMM_N = 8192             # a square bf16 GEMM this size keeps every SM of an H100 busy for ~1 ms
COPY_BYTES = 1 << 30      # 1 GiB copied: far past any L2


def builtin_for(device_name: str) -> HardwareSpec | None:
    """The spec-sheet description of a GPU by its CUDA name ("NVIDIA H100 80GB HBM3" -> h100)."""
    words = device_name.lower().replace("-", " ").split()
    return next((BUILTIN[key] for key in BUILTIN if key in words), None)


def interpolate(points: dict[int, float], total: int) -> list[float]:
    """Values for 1..total units, linear between the measured `points` (units -> value), through
    zero below the smallest and flat above the largest."""
    if not points:
        raise ValueError("no measured points")
    xs = sorted(points)
    table = []
    for u in range(1, total + 1):
        if u in points:
            table.append(points[u])
        elif u < xs[0]:
            table.append(points[xs[0]] * u / xs[0])
        elif u > xs[-1]:
            table.append(points[xs[-1]])
        else:
            lo, hi = max(x for x in xs if x < u), min(x for x in xs if x > u)
            table.append(points[lo] + (points[hi] - points[lo]) * (u - lo) / (hi - lo))
    return table


def probe_rates(shares: Sequence[int], use: Callable[[int], object], time_kernels: Callable[[Callable], float],
                gemm: Callable[[], object], gemm_flops: float, copy: Callable[[], object],
                copy_bytes: float) -> tuple[dict[int, float], dict[int, float]]:
    """(FLOP/s, bytes/s) per share: `use(units)` enters the share (a context manager),
    `time_kernels(run)` times `run`'s kernels inside it."""
    flops, bandwidth = {}, {}
    for units in shares:
        with use(units):
            flops[units] = gemm_flops / time_kernels(gemm)
            bandwidth[units] = copy_bytes / time_kernels(copy)
    return flops, bandwidth


def bandwidth_inflection(bandwidth: dict[int, float], saturated: float = 0.9) -> float:
    """N_d: the fewest measured units reaching `saturated` of the best bandwidth."""
    best = max(bandwidth.values())
    return float(min(u for u, b in bandwidth.items() if b >= saturated * best))


def gpu_hardware(device_name: str, total_sms: int, dtype: str, flops: dict[int, float],
                 bandwidth: dict[int, float], min_partition: int, partition_step: int,
                 backend: str) -> HardwareSpec:
    """This GPU under `backend`, with measured per-share rates (the spec sheet's description where
    one matches, for the memory size and the assumptions it lists)."""
    base = builtin_for(device_name)
    flops_table = interpolate(flops, total_sms)
    bandwidth_table = interpolate(bandwidth, total_sms)
    key = "bf16" if dtype in ("bf16", "fp16") else "fp32"
    fields = dict(
        name=f"{device_name} ({backend})", kind="gpu", units=total_sms, unit_name="SM",
        peak_flops={**(base.peak_flops if base else {}), key: max(flops_table)},
        peak_bandwidth=max(bandwidth_table), bandwidth_inflection=bandwidth_inflection(bandwidth),
        partition_step=partition_step, min_partition=min_partition, blocks_per_unit=1, wave_quantization=True,
        kernel_overhead_s=base.kernel_overhead_s if base else 2e-6,
        # how Bullet's own engine runs attention on a GPU: SDPA per sequence for fresh prompts; decode in
        # the paged Triton kernel, whose programs each cut their own row's context (not the longest) —
        # the profile's padding probe measures it (`padding`) and overrides this
        prefill_attention_per_sequence=True, decode_attention_padded=False,
        memory_bytes=base.memory_bytes if base else None,
        measured_flops={key: flops_table}, measured_bandwidth=bandwidth_table,
        source=f"bullet profile on this GPU: GEMM and copy timed with CUDA events on {sorted(flops)} SMs",
        assumptions=("rates linear between the measured shares",),
    )
    return HardwareSpec(**fields)
