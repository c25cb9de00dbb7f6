"""Wave quantization (Bullet §2.2.1) and the reproduction of Bullet Table 2.

A kernel of g thread blocks on N units holding b blocks each needs w = ceil(g / (b N)) waves; the
last one keeps only tail = ceil(g/b - N (w - 1)) units busy, so a fraction idle = (N - tail) / (N w)
of the unit-time is wasted. Equivalently, the kernel takes w / (g / (b N)) times as long as it would
if its work were spread perfectly: that `wave_factor` multiplies the compute time in the SRM."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.model_config import ModelConfig
from estimator.ops import ExecutionState, layer_ops
from estimator.tiling import FixedTiling


def waves(grid: int, units: int, blocks_per_unit: int = 1) -> int:
    return -(-grid // (blocks_per_unit * units))


def tail_units(grid: int, units: int, blocks_per_unit: int = 1) -> int:
    w = waves(grid, units, blocks_per_unit)
    return math.ceil(grid / blocks_per_unit - units * (w - 1))


def idle_ratio(grid: int, units: int, blocks_per_unit: int = 1) -> float:
    """Fraction of unit-time left idle by the tail wave (0 for a grid that divides evenly)."""
    if grid <= 0:
        return 0.0
    w = waves(grid, units, blocks_per_unit)
    return (units - tail_units(grid, units, blocks_per_unit)) / (units * w)


def wave_factor(grid: int, units: int, blocks_per_unit: int = 1) -> float:
    """Time with quantized waves / time with the work spread evenly over the units (>= 1).
    Grids smaller than one wave leave units idle too: factor = units * b / grid."""
    if grid <= 0:
        return 1.0
    slots = blocks_per_unit * units
    return (-(-grid // slots)) * slots / grid


# ---- Bullet Table 2 ---------------------------------------------------------------------------

TABLE2_SEQ_LENS = (1024, 2048, 4096, 16384)
# (QKV, Attn, O, MLP, layer total) idle % as printed in the paper, for comparison only.
TABLE2_PAPER = {
    1024: (11.1, 21.0, 40.7, 13.0, 19.4),
    2048: (11.1, 5.2, 21.0, 7.6, 10.4),
    4096: (11.1, 5.2, 5.2, 7.6, 9.1),
    16384: (1.9, 0.2, 0.2, 0.4, 0.5),
}
TABLE2_COLUMNS = ("QKV", "Attn", "O", "MLP", "Layer")


@dataclass(frozen=True)
class IdleRow:
    seq_len: int
    qkv: float
    attn: float
    o: float
    mlp: float
    layer: float

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.qkv, self.attn, self.o, self.mlp, self.layer)


def _time_weighted_idle(ops, units: int, b: int) -> float:
    """Idle ratio of a kernel sequence normalised to its execution time, each kernel taking
    flops / (1 - idle) of unit-time (the tail wave is paid in full)."""
    busy = [(op.flops, idle_ratio(op.grid, units, b)) for op in ops]
    total = sum(f / (1 - i) for f, i in busy)
    return sum(f / (1 - i) * i for f, i in busy) / total


def prefill_idle_table(cfg: ModelConfig, units: int = 108, seq_lens=TABLE2_SEQ_LENS,
                       tiling: FixedTiling = FixedTiling(), blocks_per_unit: int = 1) -> list[IdleRow]:
    """Theoretical idle % of the compute-bound kernels of a single-sequence prefill.

    QKV, Attn and O are single kernels. MLP (gate/up + down) and the layer total (QKV, attention,
    O, gate/up, down) are the time-weighted mixes of their GEMMs; the paper does not spell out how
    it aggregated those two columns, so they are an approximation (see the benchmark report)."""
    rows = []
    for s in seq_lens:
        ops = {op.name: op for op in layer_ops(cfg, ExecutionState(prefill_lens=(s,)), tiling=tiling)}
        pct = lambda names: 100.0 * _time_weighted_idle([ops[n] for n in names], units, blocks_per_unit)
        rows.append(IdleRow(s, pct(["qkv_proj"]), pct(["attn_prefill"]), pct(["o_proj"]),
                            pct(["gate_up_proj", "down_proj"]),
                            pct(["qkv_proj", "attn_prefill", "o_proj", "gate_up_proj", "down_proj"])))
    return rows
