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
simulated device charges for that step: a prefill layer group or a decode step beside what its row
says it ran beside (`beside`, the size the worker learnt the step as co-running with; in timelines
before 2026-11-29, a prefill group beside the decode batch seen at its decision, a decode step beside
the prefill layer group whose span — its row's start and observed time, on the same host clock —
holds the decode step's start, `bullet.loops.timeline.recorded_beside`), a hybrid step of the chunked baseline (its
chunks and decode rows). The timeline keeps a prefill batch's token count, not each prompt's: its
prompts are taken as equal. Decode rows keep the batch's summed context.

A worker may also pay a set-up the first time its prompt attention meets a fresh sequence of a new
length (a per-shape kernel plan: on an H200 whose SDPA went to cuDNN, 50-70 ms on the first layer
group of every prompt of a new length). Each step is therefore counted with the new lengths it began
— a prefill batch's first layer group, a hybrid step of fresh prompts alone, by the lengths this
worker had not run before (`NewLengths`) — and the fit is

    observed = overhead + scale x predicted + setup x new lengths

(every coefficient >= 0: the least-squares fit over the subsets of terms that keeps them so, with the
least residual), the simulator's `attention_setup_s`. The set-up term is kept only where it removes
at least `MIN_SETUP_GAIN` of the squared error scale and overhead leave: on this project's CPU, which
builds no plan per shape, it would take up a few milliseconds of the steps' own spread.

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

from bullet.loops.timeline import recorded_beside
from estimator.estimator import Estimator
from estimator.profile import load_estimator

log = logging.getLogger("artifact.served_steps")
MIN_STEPS = 10  # fewer priced steps than this fit nothing worth using
# a step this many times off the median observed/predicted ratio is left out of a fit: a warm-up
# (the H200 servers' first step: 200-700x) goes, a per-prompt set-up the served run really paid (its
# first prefill groups: 5-20x) stays
OUTLIER = 25.0
# the set-up term is fitted only where it removes at least this share of the squared error that scale
# and overhead alone leave
MIN_SETUP_GAIN = 0.10


@dataclass(frozen=True)
class StepTimes:
    """Observed vs predicted seconds of the steps a fit used, and the fit."""

    observed: tuple[float, ...]
    predicted: tuple[float, ...]
    scale: float
    overhead_s: float
    outliers: int = 0  # steps left out (OUTLIER)
    setup_s: float = 0.0  # per new attention length a step began (0 where no step began one)
    new_lengths: int = 0  # how many the steps began

    @property
    def median_ratio(self) -> float:
        return statistics.median(o / p for o, p in zip(self.observed, self.predicted))

    def as_dict(self) -> dict:
        return {"steps": len(self.observed), "scale": self.scale, "overhead_s": self.overhead_s,
                "setup_s": self.setup_s, "new_lengths": self.new_lengths, "median_ratio": self.median_ratio,
                "outliers": self.outliers}


Priced = tuple[float, float, int]  # (observed s, the device model's s, new attention lengths the step began)


def priced_steps(rows: Iterable[dict], est: Estimator) -> list[Priced]:
    """(observed s, the device model's s, new attention lengths) of each step row the model can price
    (see the module docstring); other rows (decisions that ran nothing, decode beside a prefill the
    timeline does not show, unknown roles) are skipped."""
    return [step for steps in priced_by_role(rows, est).values() for step in steps]


def priced_by_role(rows: Iterable[dict], est: Estimator) -> dict[str, list[Priced]]:
    """`priced_steps`, per worker role (each role's rows in the order its worker logged them). On a CPU,
    steps of two or more threads that ran partly on cores the other worker's threads held are left out:
    the device model prices those cores itself (`bullet.sim.device`, time-sliced), and in the fit their
    5-10x would read as a slower machine."""
    rows = list(rows)
    prefills = PrefillSpans(rows)
    new = NewLengths(est.model.num_hidden_layers)
    shared = beside_spans(rows, est.hardware.units) if est.hardware.kind == "cpu" else {}
    out: dict[str, list[Priced]] = {}
    for row in rows:
        if shared.get(id(row), (0.0, 0.0))[0] >= ALONE and int(row.get("units") or 0) > 1:
            continue
        try:
            began = new.began(row)
            priced = price_row(row, est, prefills)
        except (TypeError, ValueError, KeyError) as exc:  # a row of another shape: not ours to price
            log.debug("step row skipped (%s): %s", exc, row)
            continue
        if priced is not None:
            out.setdefault(row["role"], []).append((*priced, began))
    return out


OVERSUBSCRIBED = 0.9  # a step counts as oversubscribed when cores both held covered this share of its span
ALONE = 0.05  # ... and as clear of the other worker's cores when they covered less than this share


def beside_spans(rows: list[dict], total_units: int) -> dict[int, tuple[float, float]]:
    """id(row) -> (the share of its span that each prefill or decode step spent beside a step of the other
    worker whose share overlapped its own (units summing above `total_units`), the share beside one at
    all), from the rows' start times and observed spans (one host clock; timelines such as `naive`'s
    record no `beside`)."""
    steps: dict[str, list[tuple[float, float, int, dict]]] = {"prefill": [], "decode": []}
    for row in rows:
        if (row.get("role") in steps and row.get("run") and row.get("obs_ms") and row.get("units")
                and isinstance(row.get("t"), (int, float))):
            start = float(row["t"])
            steps[row["role"]].append((start, start + float(row["obs_ms"]) / 1e3, int(row["units"]), row))
    for spans in steps.values():
        spans.sort(key=lambda s: s[0])
    out: dict[int, tuple[float, float]] = {}
    for role, spans in steps.items():
        others = steps["decode" if role == "prefill" else "prefill"]
        starts = [s for s, _, _, _ in others]
        for start, end, units, row in spans:
            beside = shared = 0.0
            for o_start, o_end, o_units, _ in others[max(0, bisect.bisect_left(starts, start) - 1):]:
                if o_start >= end:
                    break
                span = max(0.0, min(o_end, end) - max(o_start, start))
                beside += span
                if o_units + units > total_units:
                    shared += span
            out[id(row)] = (shared / (end - start), beside / (end - start))
    return out


class NewLengths:
    """Which step rows began fresh sequences of lengths their worker had not run before, in a step of
    fresh sequences only (the engine's SDPA path; any cached prefix or decode row in the step sends it
    to the paged kernel): a prefill batch's first layer group (a batch is its (prompts, tokens) until
    its layers add up to the model's; one preempted at a layer boundary resumes as the same batch), a
    hybrid step of prompt chunks with nothing cached before them and no decode row. A prefill row does
    not say what was cached: its prompts are taken as fresh (no prefix cache in the served runs). It
    keeps only the batch's summed tokens: a batch of several prompts is taken to begin as many new
    lengths (prompts of one length are rare)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.seen: dict[str, set[int]] = {}
        self.running: dict[tuple[int, int], int] = {}  # a prefill batch in flight -> its layers done

    def began(self, row: dict) -> int:
        if not row.get("run") or not row.get("obs_ms"):
            return 0
        role = row.get("role")
        if role == "prefill" and row.get("tokens") and row.get("layers"):
            batch, tokens = max(1, int(row.get("batch") or 1)), int(row["tokens"])
            key = (batch, tokens)
            done = self.running.get(key)
            layers = (done or 0) + int(row["layers"])
            if layers >= self.num_layers:
                self.running.pop(key, None)
            else:
                self.running[key] = layers
            if done is not None:
                return 0
            # several prompts: as many lengths, none known (the timeline keeps their sum)
            return self._new(role, [tokens]) if batch == 1 else batch
        if role == "unified" and "chunks" in row:
            chunks = [(int(n), int(start)) for n, start in row["chunks"]]
            if row.get("decode_batch") or any(start for _, start in chunks):
                return 0  # the engine's paged kernel attends for the whole step: no plan per shape
            return self._new(role, [n for n, _ in chunks])
        return 0

    def _new(self, role: str, lengths: list[int]) -> int:
        seen = self.seen.setdefault(role, set())
        fresh = set(lengths) - seen
        seen |= fresh
        return len(fresh)


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


def price_row(row: dict, est: Estimator, prefills: PrefillSpans | None = None) -> tuple[float, float] | None:
    """(observed s, the device model's s) of one timeline row, None where the model cannot price it
    (module docstring: a prefill group beside its recorded decode batch, a decode step beside the
    prefill group its start fell in, a hybrid step)."""
    obs_ms, units = row.get("obs_ms"), row.get("units")
    if not row.get("run") or obs_ms is None or not units or not 0 < units <= est.hardware.units or obs_ms <= 0:
        return None
    role = row.get("role")
    if role == "prefill" and row.get("tokens") and row.get("layers"):
        batch, tokens = max(1, int(row.get("batch") or 1)), int(row["tokens"])
        lens = [tokens // batch + (1 if i < tokens % batch else 0) for i in range(batch)]
        predicted = est.prefill_time(lens, units, num_layers=int(row["layers"]), include_head=False,
                                     co_decode_batch=recorded_beside(row))
    elif role == "decode" and row.get("batch"):
        beside = recorded_beside(row)
        if beside and "beside" not in row:  # an older timeline: the prefill group its start fell in, if known
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


def fit(steps: list[Priced] | list[tuple[float, float]], setup: bool = True) -> StepTimes:
    """observed = overhead + scale x predicted + setup x new lengths, least squares, every coefficient
    >= 0, over the steps within `OUTLIER` times the median observed/predicted ratio (steps given as
    (observed, predicted) pairs began no new length; `setup=False`: no set-up term, as before
    2026-11-27)."""
    if len(steps) < MIN_STEPS:
        raise ValueError(f"{len(steps)} priced steps: too few to fit (at least {MIN_STEPS})")
    median = statistics.median(s[0] / s[1] for s in steps)
    kept = [s for s in steps if median / OUTLIER <= s[0] / s[1] <= median * OUTLIER]
    obs = np.array([s[0] for s in kept])
    pred = np.array([s[1] for s in kept])
    began = np.array([s[2] if len(s) > 2 else 0 for s in kept], dtype=float)
    fits = {}  # with the set-up term or not -> (residual, scale, overhead, setup), the best of its subsets
    for terms in ((True, True), (False, True), (True, False), (False, False)):  # (overhead, set-up)
        if terms[1] and not (setup and began.any()):
            continue
        columns = [pred] + ([np.ones_like(pred)] if terms[0] else []) + ([began] if terms[1] else [])
        a = np.vstack(columns).T
        coef, *_ = np.linalg.lstsq(a, obs, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(((a @ coef - obs) ** 2).sum())
        coef = list(coef)
        row = (residual, coef.pop(0), coef.pop(0) if terms[0] else 0.0, coef.pop(0) if terms[1] else 0.0)
        if terms[1] not in fits or residual < fits[terms[1]][0]:
            fits[terms[1]] = row
    best = fits.get(False)
    with_setup = fits.get(True)
    # the set-up term stays only where it explains a good part of what scale and overhead leave
    # (H200 prefill workers: 32-89 %; this project's CPU: 2-6 %, a few ms it would invent)
    if with_setup is not None and (best is None or with_setup[0] <= (1.0 - MIN_SETUP_GAIN) * best[0]):
        best = with_setup
    if best is None or best[1] <= 0:  # (a set-up fit alone is never tried: the scale is always in)
        raise ValueError("the steps fit no positive scale: the profile does not describe this device")
    _, scale, overhead, setup_s = best
    return StepTimes(tuple(obs.tolist()), tuple(pred.tolist()), float(scale), float(overhead), len(steps) - len(kept),
                     float(setup_s), int(began.sum()))


def fit_by_role(by_role: dict[str, list[Priced]], setup: bool = True) -> tuple[StepTimes, dict[str, StepTimes]]:
    """The fit of every step together, and of each role with at least MIN_STEPS priced steps (a role
    with fewer takes the pooled fit: leave it out of `role_step_times`)."""
    pooled = fit([step for steps in by_role.values() for step in steps], setup)
    return pooled, {role: fit(steps, setup) for role, steps in by_role.items() if len(steps) >= MIN_STEPS}


def attention_setup(pooled: StepTimes, roles: dict[str, StepTimes]) -> float:
    """The set-up per new attention length to replay with: the fit of the role that began new lengths
    (prefill, or a unified worker; decode never does), else the pooled fit's."""
    fitted = [t.setup_s for t in roles.values() if t.new_lengths]
    return max(fitted) if fitted else pooled.setup_s


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


def priced_dirs(est: Estimator, timeline_dirs: Iterable[str | Path]) -> dict[str, list[Priced]]:
    """`priced_by_role` of each directory's timelines on their own (one server's workers: which prefill
    group a decode step ran beside, which lengths a worker had run, are questions within one server),
    pooled per role."""
    out: dict[str, list[Priced]] = {}
    for d in timeline_dirs:
        for role, steps in priced_by_role(read_timelines([d]), est).items():
            out.setdefault(role, []).extend(steps)
    return out


def served_step_times(profile: str | Path, timeline_dirs: Iterable[str | Path], setup: bool = True) -> StepTimes:
    return fit([step for steps in priced_dirs(load_estimator(str(profile)), timeline_dirs).values() for step in steps],
               setup)


def served_step_times_by_role(profile: str | Path, timeline_dirs: Iterable[str | Path],
                              setup: bool = True) -> tuple[StepTimes, dict[str, StepTimes]]:
    return fit_by_role(priced_dirs(load_estimator(str(profile)), timeline_dirs), setup)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the estimator profile the simulator would use")
    p.add_argument("--by-role", action="store_true", help="also fit each worker role on its own")
    p.add_argument("--no-attention-setup", action="store_true",
                   help="fit no set-up per new attention length (the fit before 2026-11-27)")
    p.add_argument("timelines", nargs="+", help="a served run's timeline directories (<role>.jsonl files)")
    args = p.parse_args()
    if not args.by_role:
        times = served_step_times(args.profile, args.timelines, not args.no_attention_setup)
        print(json.dumps(times.as_dict(), indent=1))
        print(f"replay with: --step-time-scale {times.scale:.4g} --step-overhead-ms {times.overhead_s * 1e3:.4g}"
              f" --attention-setup-ms {times.setup_s * 1e3:.4g}")
        return 0
    pooled, roles = served_step_times_by_role(args.profile, args.timelines, not args.no_attention_setup)
    print(json.dumps({"pooled": pooled.as_dict(), **{role: t.as_dict() for role, t in roles.items()}}, indent=1))
    print(f"replay with: --step-time-scale {pooled.scale:.4g} --step-overhead-ms {pooled.overhead_s * 1e3:.4g}"
          + "".join(f" --role-step-time {role}={t.scale:.4g},{t.overhead_s * 1e3:.4g}" for role, t in roles.items())
          + f" --attention-setup-ms {attention_setup(pooled, roles) * 1e3:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
