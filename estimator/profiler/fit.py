"""From measured samples to a calibrated estimator (Bullet Eq. 2 and §3.2.3, on the CPU).

1. Op samples (kernel sweeps) and solo phase samples go into the calibration: alpha per kernel
   class, then one alpha per phase for what the kernels miss end to end, both per core count. Within a
   kind and core count, times are first made non-decreasing in the work (`monotone`).
2. Co-running decode samples give D_{p,sl}: for each (decode cores, prefill length sl), the fraction
   of the bandwidth the decode step still gets, solved for so that the calibrated model reproduces
   the measured steps (least squares in log time). The paper measures the attainable bandwidth
   beside a prefill; solving through the model measures it as the decode step itself sees it.
3. Co-running prefill samples give the prefill slowdown beside a decode batch: measured time over
   the calibrated solo prediction, per batch.
4. Samples of a phase on every core while the other phase looped on every core too give what a shared
   core costs that phase (`ContentionModel.shared_units`): measured time over the solo prediction.
Contention never speeds a step up: fractions are capped at 1 and slowdowns floored at 1, so a noisy
co-running sample cannot make the estimator promise a faster step beside the other phase."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from engines.model_config import ModelConfig
from estimator.calibration import PHASES, Calibration, Sample, shares_units
from estimator.contention import ContentionModel, SharedUnitsPoint
from estimator.estimator import Estimator
from estimator.hardware import HardwareSpec
from estimator.ops import ALL_CLASSES, ATTENTION_CLASSES, LAYER_TOKEN_CLASSES
from estimator.profiler.prediction_errors import predict

FRACTION_RANGE = (0.05, 1.0)
# The kernel sweeps already give every size its own alpha; end to end only a residual is left (the
# Python between kernels), one factor per phase and core count. A factor varying with size would
# bend predictions wherever the phase samples are noisy, e.g. make a bigger batch predict faster.
PHASE_RESIDUAL = {"prefill": "constant", "decode": "constant", "hybrid": "constant"}
# Kernel times go through every sweep sample, linear in the SRM time between them.
KERNEL_CURVES = {kind: "piecewise" for kind in ALL_CLASSES}


def _golden_min(loss: Callable[[float], float], lo: float, hi: float, iterations: int = 50) -> float:
    """Minimum of a unimodal function on [lo, hi]."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = loss(d)
    return (a + b) / 2


def decode_bandwidth_fraction(estimator: Estimator, samples: Sequence[Sample]) -> float:
    """The D_{p,sl} / D_p that best reproduces decode `samples` (all at one units and sl)."""
    def loss(log_fraction: float) -> float:
        fraction = math.exp(log_fraction)
        return sum(math.log(estimator.decode_time_at_bandwidth(s.decode_batch, s.decode_context, s.units, fraction,
                                                               s.include_head, s.num_layers) / s.seconds) ** 2
                   for s in samples)

    lo, hi = (math.log(x) for x in FRACTION_RANGE)
    return min(FRACTION_RANGE[1], math.exp(_golden_min(loss, lo, hi)))


def prefill_slowdown(estimator: Estimator, samples: Sequence[Sample]) -> float:
    """Geometric mean of measured / solo prediction over prefill `samples` (one decode batch)."""
    logs = [math.log(s.seconds / estimator.prefill_time(list(s.prefill_lens), s.units, s.num_layers, s.include_head))
            for s in samples]
    return max(1.0, math.exp(sum(logs) / len(logs)))


def shared_units_slowdown(estimator: Estimator, samples: Sequence[Sample]) -> float:
    """Geometric mean of measured / solo prediction over `samples` of one phase that ran on units the
    co-runner also held (floored at 1, as the other tables)."""
    logs = [math.log(s.seconds / predict(estimator, s.model_copy(update={"co_running": 0, "co_units": 0})))
            for s in samples]
    return max(1.0, math.exp(sum(logs) / len(logs)))


def fit_contention(estimator: Estimator, corun: Sequence[Sample]) -> ContentionModel:
    """Contention tables from co-running phase samples, against `estimator`'s solo calibration; the
    samples that shared units with their co-runner give `shared_units` instead."""
    model = ContentionModel(samples=list(corun))
    decode: dict[tuple[int, int], list[Sample]] = {}
    prefill: dict[int, list[Sample]] = {}
    shared: dict[str, list[Sample]] = {}
    for s in corun:
        if shares_units(s, estimator.hardware.units):
            shared.setdefault(s.kind, []).append(s)
        elif s.kind == "decode":
            decode.setdefault((s.units, s.co_running), []).append(s)
        else:
            prefill.setdefault(s.co_running, []).append(s)
    for (units, tokens), group in sorted(decode.items()):
        model.add_bandwidth(units, tokens, decode_bandwidth_fraction(estimator, group))
    for batch, group in sorted(prefill.items()):
        model.add_slowdown(batch, prefill_slowdown(estimator, group))
    model.shared_units = [SharedUnitsPoint(kind=kind, factor=shared_units_slowdown(estimator, group))
                          for kind, group in sorted(shared.items()) if kind in ("prefill", "decode")]
    return model


def scale_sweep_to_step(op_samples: Sequence[Sample], step_seconds: float, num_layers: int) -> list[Sample]:
    """A kernel sweep's samples scaled so that they add up to the end-to-end step of the same
    state, timed right after it: the sweep says how a step divides among its kernels, the step how
    long it takes. Measured apart, the two can land in different moods of a shared machine (seen
    here: decode attention over a large KV cache runs in two speeds ~2x apart, for seconds at a time)."""
    def launches(s: Sample) -> int:
        if s.kind not in LAYER_TOKEN_CLASSES and s.kind not in ATTENTION_CLASSES:
            return 1  # embedding, final norm, LM head: once per step
        return num_layers * (2 if s.kind == "residual_add" else 1)

    total = sum(s.seconds * launches(s) for s in op_samples)
    if total <= 0:
        return list(op_samples)
    ratio = step_seconds / total
    return [s.model_copy(update={"seconds": s.seconds * ratio}) for s in op_samples]


def _pool_adjacent_violators(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def monotone(samples: Sequence[Sample], work: Callable[[Sample], float]) -> list[Sample]:
    """`samples` (one kind, one core count) with their times made non-decreasing in `work` (what
    the model says each one computes): a kernel or a step never gets faster with more work, so a
    measured dip is noise — left in, it would make the calibrated predictions dip too."""
    ordered = sorted(samples, key=work)
    times = _pool_adjacent_violators([s.seconds for s in ordered])
    return [s.model_copy(update={"seconds": t}) for s, t in zip(ordered, times)]


def _by_kind_and_units(samples: Sequence[Sample]) -> dict[tuple[str, int], list[Sample]]:
    groups: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.units), []).append(s)
    return groups


def build_estimator(model: ModelConfig, hardware: HardwareSpec, dtype: str, samples: Sequence[Sample],
                    curves: dict[str, str] | None = None) -> Estimator:
    """The calibrated estimator from everything a profile measured: op samples, solo phase samples
    (co_running == 0) and co-running phase samples (co_running > 0). `curves` overrides how a kind's
    alpha is interpolated (default: `KERNEL_CURVES`, `PHASE_RESIDUAL`)."""
    corun = [s for s in samples if s.kind in PHASES and s.co_running]
    ops = [s for s in samples if s.kind not in PHASES]
    raw = Estimator(model, hardware, dtype=dtype)
    ops = [s for group in _by_kind_and_units(ops).values()
           for s in monotone(group, lambda s: raw.kernels.srm(raw.kernels.sample_op(s), s.units))]
    modes = {**KERNEL_CURVES, **PHASE_RESIDUAL, **(curves or {})}
    kernel_level = Estimator(model, hardware, Calibration(samples=ops, interpolation=modes), dtype=dtype)
    solo = [s for s in samples if s.kind in PHASES and not s.co_running]
    solo = [s for group in _by_kind_and_units(solo).values()
            for s in monotone(group, lambda s: predict(kernel_level, s))]
    estimator = Estimator(model, hardware, Calibration(samples=ops + solo, interpolation=modes), dtype=dtype)
    if corun:
        estimator.contention = fit_contention(estimator, corun)
        estimator.refit()
    return estimator
