"""How much more a served run's co-running steps cost than the profile's co-run table says: the
`--corun-scale` that run measured (`bullet simulate --corun-scale`, `docs/sim/ledger.md` §4).

The device model prices a step beside the other worker's with the co-run table its profile measured
(a decode step beside a prefill group of that many tokens, a prefill group beside a decode batch of
that size). A served run's step timelines say what each step took. Per worker role and share (units),
the ratio observed / priced of the steps that ran beside the other worker's, over the same ratio of
the steps that ran alone on the same share (medians), is the co-run scale S: 1 where co-running costs
what the profile said, 1.3 where it costs 30 % more. Dividing by the lone steps of the same role and
share takes out whatever makes the server or that share run off its profile (a slower host, a step's
overhead, a share the profile extrapolated to) — what is left is the co-running. A share that never
ran alone (bullet's small decode shares exist only beside a prefill) says nothing, and is left out.

Left out: steps the model cannot price (`artifact.served_steps`), steps that began prompts of a length
their worker had not run (a per-shape set-up, not co-running), and roles with fewer than `MIN_STEPS`
steps on either side of a share. Medians over steps of different sizes: a share whose co-running steps
are mostly larger or smaller than its lone ones carries the profile's size-dependent error into S too.

    python -m artifact.served_corun --profile P.json DIR/timeline/bullet [DIR/timeline/static ...]

`--oversubscribed` measures instead what a CPU step costs on cores that the other worker's threads also
held (`bullet simulate --oversubscribed-slowdown`, the time-sliced device of `bullet.sim.device`): per role
and share of two or more cores, the median observed / priced-alone of the steps that spent at least
`OVERSUBSCRIBED` of their span beside a step of the other worker whose share overlapped theirs (found by
the rows' start times and observed spans, one host clock), over the same median of the steps of that role
and share that ran with no other step beside them at all (timelines such as `naive`'s record no `beside`).

    python -m artifact.served_corun --oversubscribed --profile P.json DIR/timeline/naive DIR/timeline/scheduler-only"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Iterable

from artifact.served_steps import (
    ALONE,
    OVERSUBSCRIBED,
    NewLengths,
    PrefillSpans,
    beside_spans,
    price_row,
    read_timelines,
)
from bullet.loops.timeline import recorded_beside
from estimator.estimator import Estimator
from estimator.profile import load_estimator

MIN_STEPS = 5  # on each side (alone, beside) of a role


def ratios(rows: Iterable[dict], est: Estimator) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(role, units) -> {"alone": [...], "beside": [...]} observed / priced, of one server's timelines."""
    rows = list(rows)
    spans, new = PrefillSpans(rows), NewLengths(est.model.num_hidden_layers)
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    for row in rows:
        try:
            began = new.began(row)
            priced = price_row(row, est, spans)
        except (TypeError, ValueError, KeyError):  # a row of another shape: not a step to price
            continue
        if priced is None or began or row.get("role") not in ("prefill", "decode"):
            continue
        observed, predicted = priced
        side = "beside" if recorded_beside(row) else "alone"
        key = (row["role"], int(row["units"]))
        out.setdefault(key, {"alone": [], "beside": []})[side].append(observed / predicted)
    return out


def corun_scale(est: Estimator, timeline_dirs: Iterable[str | Path]) -> dict:
    """Per role and share (pooled over the servers given): steps on each side, their median ratios and
    S where both sides have `MIN_STEPS`; per role, and over everything, S's geometric mean weighted by
    the co-running steps judged (None where nothing could be judged)."""
    pooled: dict[tuple[str, int], dict[str, list[float]]] = {}
    for d in timeline_dirs:
        for key, sides in ratios(read_timelines([d]), est).items():
            for side, values in sides.items():
                pooled.setdefault(key, {"alone": [], "beside": []})[side].extend(values)
    shares = []
    for (role, units), sides in sorted(pooled.items()):
        entry = {"role": role, "units": units, "alone_steps": len(sides["alone"]), "beside_steps": len(sides["beside"])}
        if min(entry["alone_steps"], entry["beside_steps"]) >= MIN_STEPS:
            alone, beside = statistics.median(sides["alone"]), statistics.median(sides["beside"])
            entry.update(alone_ratio=alone, beside_ratio=beside, scale=beside / alone)
        shares.append(entry)
    roles = {role: _mean_scale([s for s in shares if s["role"] == role]) for role in sorted({s["role"] for s in shares})}
    return {"scale": _mean_scale(shares), "roles": roles, "shares": shares, "min_steps": MIN_STEPS}


def oversubscribed_ratios(rows: Iterable[dict], est: Estimator) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(role, units) -> {"alone": [...], "beside": [...]} observed / priced alone on its share, of one
    server's prefill and decode steps of two or more cores; "beside": the steps oversubscribed (module
    docstring), "alone": those with no step of the other worker beside them."""
    rows = list(rows)
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    spans = beside_spans(rows, est.hardware.units)
    for row in rows:
        units = int(row.get("units") or 0)
        if id(row) not in spans or not 1 < units <= est.hardware.units:
            continue  # one thread has no barrier to wait at (module docstring)
        shared, beside = spans[id(row)]
        side = "beside" if shared >= OVERSUBSCRIBED else "alone" if beside < ALONE else None
        if side is None:
            continue
        try:
            priced = _priced_alone(row, units, est)
        except (TypeError, ValueError, KeyError):  # a row of another shape
            continue
        out.setdefault((row["role"], units), {"alone": [], "beside": []})[side].append(row["obs_ms"] / 1e3 / priced)
    return out


def _priced_alone(row: dict, units: int, est: Estimator) -> float:
    if row["role"] == "prefill":
        batch, tokens = max(1, int(row.get("batch") or 1)), int(row["tokens"])
        lens = [tokens // batch + (1 if i < tokens % batch else 0) for i in range(batch)]
        return est.prefill_time(lens, units, num_layers=int(row["layers"]), include_head=False)
    return est.decode_time(int(row["batch"]), int(row["context"]), units)


def oversubscribed_slowdown(est: Estimator, timeline_dirs: Iterable[str | Path]) -> dict:
    """`corun_scale`'s result for oversubscribed steps: per role and share the slowdown S where both sides
    have `MIN_STEPS`, and the median over every judged step of its ratio over its share's alone median."""
    pooled: dict[tuple[str, int], dict[str, list[float]]] = {}
    for d in timeline_dirs:
        for key, sides in oversubscribed_ratios(read_timelines([d]), est).items():
            for side, values in sides.items():
                pooled.setdefault(key, {"alone": [], "beside": []})[side].extend(values)
    shares, normalised = [], []
    for (role, units), sides in sorted(pooled.items()):
        entry = {"role": role, "units": units, "alone_steps": len(sides["alone"]), "beside_steps": len(sides["beside"])}
        if min(entry["alone_steps"], entry["beside_steps"]) >= MIN_STEPS:
            alone = statistics.median(sides["alone"])
            entry.update(alone_ratio=alone, beside_ratio=statistics.median(sides["beside"]),
                         scale=statistics.median(sides["beside"]) / alone)
            normalised += [r / alone for r in sides["beside"]]
        shares.append(entry)
    return {"scale": statistics.median(normalised) if normalised else None, "steps": len(normalised),
            "shares": shares, "min_steps": MIN_STEPS, "oversubscribed": OVERSUBSCRIBED}


def _mean_scale(shares: list[dict]) -> float | None:
    judged = [s for s in shares if "scale" in s]
    weight = sum(s["beside_steps"] for s in judged)
    return math.exp(sum(s["beside_steps"] * math.log(s["scale"]) for s in judged) / weight) if judged else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the estimator profile the simulator replays the run with")
    p.add_argument("timelines", nargs="+", help="a served run's timeline directories of two-worker systems")
    p.add_argument("--oversubscribed", action="store_true",
                   help="measure the slowdown of steps on cores both workers held (a CPU's time-sliced cores)")
    args = p.parse_args(argv)
    est = load_estimator(args.profile)
    if args.oversubscribed:
        result = oversubscribed_slowdown(est, args.timelines)
        missing = (f"no share of two or more cores ran >= {MIN_STEPS} priced steps both alone and on cores the "
                   "other worker held")
        found = (f"a step on cores the other worker's threads held took {{:.3g}}x its time alone ({result['steps']} "
                 "steps): bullet simulate --oversubscribed-slowdown {:.3g} replays it")
    else:
        result = corun_scale(est, args.timelines)
        missing = f"no share of a role ran >= {MIN_STEPS} priced steps both alone and beside the other worker's"
        found = "co-running cost {:.3g}x the profile's co-run table: bullet simulate --corun-scale {:.3g} replays it"
    print(json.dumps(result, indent=1))
    if result["scale"] is None:
        print(f"{missing}: nothing measured")
        return 1
    print(found.format(result["scale"], result["scale"]))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
