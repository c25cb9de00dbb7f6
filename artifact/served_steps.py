"""How fast a served run's steps actually ran, against the device model of a profile: the simulator's
`step_time_scale` and `step_overhead_s` for replaying that run.

A served comparison (`artifact.cpu_comparison`) writes every worker's decisions, with each step's
observed time, to `<out>/timeline/<system>/<role>.jsonl`. A profile is a snapshot of the device; a
shared machine's speed drifts (on this project's 2-core VM, two quick profiles 17 minutes apart
differed by up to 1.8x per step) and a served step also pays the worker's own loop and whatever else
the cores run (the HTTP front end, the load generator). So the simulator, charging the profile's
latencies, replays a served run on a faster device than the one it ran on.

This fits, over every step a timeline records whose state the device model can price,

    observed = overhead + scale x predicted

by least squares (overhead clipped at 0, then the scale refitted), `predicted` being what the
simulated device charges for that step: a prefill layer group beside the decode batch it recorded,
a decode step alone or beside the prefill layer group whose span (its row's start and observed time,
on the same host clock) holds the decode step's start, a hybrid step of the chunked baseline (its
chunks and decode rows). The timeline keeps a prefill batch's token count, not each prompt's: its
prompts are taken as equal. Decode rows keep the batch's summed context.

Steps more than `OUTLIER` times off the median ratio of observed to predicted are left out of the
fit (a server's warm-up, a stall the device model does not describe); the fit says how many.
`--by-role` fits each worker role on its own (`bullet simulate --role-step-time`): a served
prefill worker may run further off the profile than its decode worker.

    python -m artifact.served_steps --profile P.json [--by-role] DIR/timeline/bullet DIR/timeline/static"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from estimator.estimator import Estimator
from estimator.profile import load_estimator

log = logging.getLogger("artifact.served_steps")
MIN_STEPS = 10  # fewer priced steps than this fit nothing worth using
# a step this many times off the median observed/predicted ratio is left out of a fit: a warm-up
# (the H200 servers' first step: 200-700x) goes, a per-prompt set-up the served run really paid (its
# first prefill groups: 5-20x) stays
OUTLIER = 25.0


@dataclass(frozen=True)
class StepTimes:
    """Observed vs predicted seconds of the steps a fit used, and the fit."""

    observed: tuple[float, ...]
    predicted: tuple[float, ...]
    scale: float
    overhead_s: float
    outliers: int = 0  # steps left out (OUTLIER)

    @property
    def median_ratio(self) -> float:
        return statistics.median(o / p for o, p in zip(self.observed, self.predicted))

    def as_dict(self) -> dict:
        return {"steps": len(self.observed), "scale": self.scale, "overhead_s": self.overhead_s,
                "median_ratio": self.median_ratio, "outliers": self.outliers}


def priced_steps(rows: Iterable[dict], est: Estimator) -> list[tuple[float, float]]:
    """(observed s, the device model's s) of each step row the model can price (see the module
    docstring); other rows (decisions that ran nothing, decode beside a prefill the timeline does
    not show, unknown roles) are skipped."""
    return [pair for pairs in priced_by_role(rows, est).values() for pair in pairs]


def priced_by_role(rows: Iterable[dict], est: Estimator) -> dict[str, list[tuple[float, float]]]:
    """`priced_steps`, per worker role."""
    rows = list(rows)
    prefills = PrefillSpans(rows)
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        try:
            priced = _price(row, est, prefills)
        except (TypeError, ValueError, KeyError) as exc:  # a row of another shape: not ours to price
            log.debug("step row skipped (%s): %s", exc, row)
            continue
        if priced is not None:
            out.setdefault(row["role"], []).append(priced)
    return out


class PrefillSpans:
    """The prefill layer groups a timeline ran, by start time: which one a decode step began beside."""

    def __init__(self, rows: list[dict]):
        spans = sorted((float(r["t"]), float(r["t"]) + float(r["obs_ms"]) / 1e3, int(r["tokens"]))
                       for r in rows if r.get("role") == "prefill" and r.get("run") and r.get("obs_ms")
                       and r.get("tokens") and isinstance(r.get("t"), (int, float)))
        self.starts = [s for s, _, _ in spans]
        self.spans = spans

    def tokens_at(self, t: float) -> int | None:
        """The tokens of the prefill group running at `t`, or None when none was."""
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and self.spans[i][0] <= t < self.spans[i][1]:
            return self.spans[i][2]
        return None


def _price(row: dict, est: Estimator, prefills: PrefillSpans | None = None) -> tuple[float, float] | None:
    obs_ms, units = row.get("obs_ms"), row.get("units")
    if not row.get("run") or obs_ms is None or not units or not 0 < units <= est.hardware.units or obs_ms <= 0:
        return None
    role = row.get("role")
    if role == "prefill" and row.get("tokens") and row.get("layers"):
        batch, tokens = max(1, int(row.get("batch") or 1)), int(row["tokens"])
        lens = [tokens // batch + (1 if i < tokens % batch else 0) for i in range(batch)]
        predicted = est.prefill_time(lens, units, num_layers=int(row["layers"]), include_head=False,
                                     co_decode_batch=int(row.get("decode_batch") or 0))
    elif role == "decode" and row.get("batch"):
        beside = 0
        if row.get("prefill_units"):  # beside a prefill: the group its start fell in, if the timeline has it
            beside = prefills.tokens_at(float(row["t"])) if prefills is not None else None
            if not beside:
                return None
        predicted = est.decode_time(int(row["batch"]), int(row.get("context") or 0), units, co_prefill_tokens=beside)
    elif role == "unified" and "chunks" in row:  # a hybrid step (recorded since 2026-11-26)
        chunks = [(int(n), int(start)) for n, start in row["chunks"]]
        predicted = est.hybrid_step_time(chunks, int(row.get("decode_batch") or 0), int(row.get("context") or 0),
                                         units)
    else:
        return None
    return (obs_ms / 1e3, predicted) if predicted > 0 else None


def fit(pairs: list[tuple[float, float]]) -> StepTimes:
    """observed = overhead + scale x predicted, least squares, overhead >= 0, over the steps within
    `OUTLIER` times the median observed/predicted ratio."""
    if len(pairs) < MIN_STEPS:
        raise ValueError(f"{len(pairs)} priced steps: too few to fit (at least {MIN_STEPS})")
    median = statistics.median(o / p for o, p in pairs)
    kept = [(o, p) for o, p in pairs if median / OUTLIER <= o / p <= median * OUTLIER]
    obs = np.array([o for o, _ in kept])
    pred = np.array([p for _, p in kept])
    (overhead, scale), *_ = np.linalg.lstsq(np.vstack([np.ones_like(pred), pred]).T, obs, rcond=None)
    if overhead < 0:  # no negative overhead: the scale alone, through the origin
        overhead, scale = 0.0, float(obs @ pred / (pred @ pred))
    if scale <= 0:
        raise ValueError(f"the steps fit a scale of {scale:.3g}: the profile does not describe this device")
    return StepTimes(tuple(obs.tolist()), tuple(pred.tolist()), float(scale), float(overhead), len(pairs) - len(kept))


def fit_by_role(by_role: dict[str, list[tuple[float, float]]]) -> tuple[StepTimes, dict[str, StepTimes]]:
    """The fit of every step together, and of each role with at least MIN_STEPS priced steps (a role
    with fewer takes the pooled fit: leave it out of `role_step_times`)."""
    pooled = fit([pair for pairs in by_role.values() for pair in pairs])
    return pooled, {role: fit(pairs) for role, pairs in by_role.items() if len(pairs) >= MIN_STEPS}


def read_timelines(dirs: Iterable[str | Path]) -> list[dict]:
    """Every row of every worker's timeline file under `dirs` (`<role>.jsonl`, or gzipped as committed);
    a malformed line is skipped."""
    rows = []
    for d in dirs:
        files = [f for role in ("prefill", "decode", "unified") for f in (Path(d) / f"{role}.jsonl",
                                                                           Path(d) / f"{role}.jsonl.gz") if f.exists()]
        if not files:
            raise FileNotFoundError(f"{d}: no prefill, decode or unified .jsonl(.gz) (a served run's --timeline-dir)")
        for f in files:
            text = gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text()
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("%s:%d: not JSON, skipped", f, n)
                    continue
                if isinstance(row, dict):
                    rows.append(row)
    return rows


def served_step_times(profile: str | Path, timeline_dirs: Iterable[str | Path]) -> StepTimes:
    return fit(priced_steps(read_timelines(timeline_dirs), load_estimator(str(profile))))


def served_step_times_by_role(profile: str | Path, timeline_dirs: Iterable[str | Path]) -> tuple[StepTimes, dict[str, StepTimes]]:
    return fit_by_role(priced_by_role(read_timelines(timeline_dirs), load_estimator(str(profile))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the estimator profile the simulator would use")
    p.add_argument("--by-role", action="store_true", help="also fit each worker role on its own")
    p.add_argument("timelines", nargs="+", help="a served run's timeline directories (<role>.jsonl files)")
    args = p.parse_args()
    if not args.by_role:
        times = served_step_times(args.profile, args.timelines)
        print(json.dumps(times.as_dict(), indent=1))
        print(f"replay with: --step-time-scale {times.scale:.4g} --step-overhead-ms {times.overhead_s * 1e3:.4g}")
        return 0
    pooled, roles = served_step_times_by_role(args.profile, args.timelines)
    print(json.dumps({"pooled": pooled.as_dict(), **{role: t.as_dict() for role, t in roles.items()}}, indent=1))
    print(f"replay with: --step-time-scale {pooled.scale:.4g} --step-overhead-ms {pooled.overhead_s * 1e3:.4g}"
          + "".join(f" --role-step-time {role}={t.scale:.4g},{t.overhead_s * 1e3:.4g}" for role, t in roles.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
