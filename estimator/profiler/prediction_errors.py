"""Prediction errors of an estimator against measured steps, grouped as the policies use them:
phase x core count x solo / co-running. Used by `bullet profile` (fit on its own samples) and by
the CPU accuracy benchmark (held-out states)."""

from __future__ import annotations

from typing import Iterable

from estimator.calibration import PHASES, Sample, shares_units
from estimator.estimator import Estimator


def predict(estimator: Estimator, sample: Sample, context_lens: list[int] | None = None) -> float:
    """What `estimator` predicts for the state `sample` measured (decode: per-request contexts if
    given, else the sample's (batch, total context) summary; on units its co-runner also held, the solo
    prediction times the measured slowdown of shared units)."""
    if shares_units(sample, estimator.hardware.units):
        solo = predict(estimator, sample.model_copy(update={"co_running": 0, "co_units": 0}), context_lens)
        return solo * (estimator.contention.shared_units_slowdown() or 1.0)
    if sample.kind == "prefill":
        return estimator.prefill_time(list(sample.prefill_lens), sample.units, sample.num_layers, sample.include_head,
                                      co_decode_batch=sample.co_running)
    if sample.kind == "decode":
        kw = dict(co_prefill_tokens=sample.co_running, include_head=sample.include_head, num_layers=sample.num_layers)
        if context_lens is not None:
            return estimator.decode_time_for(context_lens, sample.units, **kw)
        return estimator.decode_time(sample.decode_batch, sample.decode_context, sample.units, **kw)
    if sample.kind == "hybrid":
        return estimator.hybrid_step_time([(n, 0) for n in sample.prefill_lens], sample.decode_batch,
                                          sample.decode_context, sample.units)
    raise ValueError(f"not a phase sample: {sample.kind}")


def group_of(sample: Sample, total_units: int | None = None) -> str:
    side = "solo" if not sample.co_running else "shared cores" if total_units and shares_units(sample, total_units) \
        else "co-run"
    return f"{sample.kind} {sample.units}c {side}"


def percent_error(predicted: float, measured: float) -> float:
    return 100.0 * abs(predicted - measured) / measured


def summarize_errors(rows: Iterable[tuple[str, float]]) -> list[tuple[str, float, float, int]]:
    """(group, MAPE %, max %, count) per group of (group, error %) rows, plus an "all" row."""
    groups: dict[str, list[float]] = {}
    for group, error in rows:
        groups.setdefault(group, []).append(error)
        groups.setdefault("all", []).append(error)
    order = sorted(g for g in groups if g != "all") + (["all"] if groups else [])
    return [(g, sum(groups[g]) / len(groups[g]), max(groups[g]), len(groups[g])) for g in order]


def calibration_fit_rows(profile) -> list[tuple[str, float, float, int]]:
    """In-sample errors: the profile's estimator against the very steps it was calibrated on (a
    sanity check of the fit, not its accuracy: that is what held-out states measure)."""
    estimator = profile.estimator()
    samples = [s for s in profile.calibration.samples if s.kind in PHASES] + list(profile.contention.samples)
    return summarize_errors((group_of(s, estimator.hardware.units), percent_error(predict(estimator, s), s.seconds))
                            for s in samples)
