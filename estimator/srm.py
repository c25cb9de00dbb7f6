"""SM-scaling roofline model (Bullet §3.2.2, Eq. 1) for one kernel on N_p of the N units:

    T' = max(flops / C_p * wave_factor, bytes / D_p) + kernel overhead
    C_p = C_peak * N_p / N,   D_p = D_peak * min(1, N_p / N_d)

Eq. 1 writes the roofline as flops * min(AI * D_p, C_p)^-1, which is the same max(). The wave factor
(§2.2.1) stretches the compute time only: the tail wave idles units but not memory bandwidth,
which the busy units can still saturate. The fixed overhead is the hardware's per-kernel cost
(launch, ramp-up), which dominates tiny kernels and which the roofline alone would put at zero."""

from __future__ import annotations

from estimator.hardware import HardwareSpec
from estimator.ops import Op
from estimator.waves import wave_factor


def compute_time(op: Op, units: int, hw: HardwareSpec, dtype: str = "bf16") -> float:
    seconds = op.flops / hw.compute_rate(units, dtype)
    if hw.wave_quantization and op.grid:
        seconds *= wave_factor(op.grid, units, hw.blocks_per_unit)
    return seconds


def memory_time(op: Op, units: int, hw: HardwareSpec, bandwidth_scale: float = 1.0) -> float:
    """`bandwidth_scale` < 1 models bandwidth lost to a kernel running beside this one (§3.2.3)."""
    return op.bytes / (hw.bandwidth(units) * bandwidth_scale)


def srm_time(op: Op, units: int, hw: HardwareSpec, dtype: str = "bf16", bandwidth_scale: float = 1.0) -> float:
    """Roofline latency in seconds of the `op.count` launches of `op` on `units` of `hw`'s units."""
    if not 0 < units <= hw.units:
        raise ValueError(f"units must be in 1..{hw.units}, got {units}")
    work = max(compute_time(op, units, hw, dtype), memory_time(op, units, hw, bandwidth_scale))
    return op.count * (hw.kernel_overhead_s + work)


def is_compute_bound(op: Op, units: int, hw: HardwareSpec, dtype: str = "bf16") -> bool:
    return compute_time(op, units, hw, dtype) >= memory_time(op, units, hw)
