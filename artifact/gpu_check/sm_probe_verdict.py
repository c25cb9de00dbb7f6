"""The isolation probe's arithmetic: what the spin probe's rates say about two shares.

A spin block holds one SM (one core on a CPU) for a fixed wall time and nothing else changes its
duration — not the clock, the power limit, L2 or HBM. So a side's spin rate together with the other
side, over its rate alone, is the fraction of its SMs nobody else took:

* **disjoint**: both sides keep >= `DISJOINT_KEEP` (0.97: what start-up skew between the two sides and
  the µs a block takes to start leave of a perfect 1.0);
* **shared**: the two fractions add up to about one (<= `SHARED_SUM`): both run on one set of SMs, or
  the device time-slices the two (two processes without MPS);
* **partial**: in between. If a side's S SMs include `o` that the other side also uses, and both
  keep every SM busy, each gets about half of those: kept = (S - o / 2) / S, so the overlap fraction
  of its share is o / S = 2 (1 - kept) (clipped to 0..1), `overlap_units` = that x S.
* **noisy**: one side's alone rounds differ by more than `NOISE_LIMIT`, or a side alone counted fewer
  than `BUSY_FLOOR` of the units it was granted (something else held them: other work on the device,
  other processes on the cores) — the rates then say nothing about the two shares.
A side that alone counts more units than it was granted (by `GRAPH_HOLD`) was not restricted at all;
the summary says so.

The FMA (SM clock), copy (HBM) and GEMM rates are reported as kept fractions beside it: with a
disjoint spin verdict, an FMA that keeps less says clocks fell (power), a copy that keeps less says
the two share memory bandwidth — contention the SM count does not explain.

Graph replays: a spin launched from a CUDA graph captured on a restricted stream should count the
same SMs as launched directly; a replay that counts more than `GRAPH_HOLD` x the share escaped the
restriction (libsmctrl's stream mask is not carried into graph launches, by its own account)."""

from __future__ import annotations

import statistics
from typing import Sequence

DISJOINT_KEEP = 0.97
SHARED_SUM = 1.15
NOISE_LIMIT = 0.10
GRAPH_HOLD = 1.05
BUSY_FLOOR = 0.8

DISJOINT, SHARED, PARTIAL, NOISY, FAILED = "disjoint", "shared", "partial", "noisy", "failed"


def kept(alone: Sequence[float], together: Sequence[float]) -> float | None:
    """Median together over median alone; None without both."""
    if not alone or not together or statistics.median(alone) <= 0:
        return None
    return statistics.median(together) / statistics.median(alone)


def spread(rates: Sequence[float]) -> float:
    mid = statistics.median(rates) if rates else 0.0
    return (max(rates) - min(rates)) / mid if mid > 0 else float("inf")


def overlap_fraction(kept_fraction: float) -> float:
    return min(1.0, max(0.0, 2.0 * (1.0 - kept_fraction)))


def judge_spin(alone: dict[str, Sequence[float]], together: dict[str, Sequence[float]], units: dict[str, int],
               keep: float = DISJOINT_KEEP, shared_sum: float = SHARED_SUM, noise_limit: float = NOISE_LIMIT,
               effective_alone: dict[str, float] | None = None, shared_sm_blocks: int = 0) -> dict:
    """The verdict over two sides' spin rates (`alone`/`together`: side -> rates, one a round;
    `effective_alone`: side -> units it counted alone, checked against `units` when given;
    `shared_sm_blocks`: blocks seen starting on an SM another of the side's blocks still held)."""
    if shared_sm_blocks:
        return {"outcome": FAILED, "shared_sm_blocks": shared_sm_blocks,
                "summary": f"{shared_sm_blocks} spin blocks started on an SM another block still held: the "
                           "shared-memory request did not keep one block per SM, so the rates do not count SMs"}
    names = sorted(alone)
    if len(names) != 2 or any(not alone.get(n) or not together.get(n) for n in names):
        return {"outcome": FAILED, "summary": "each of two sides needs spin rates alone and together"}
    if min(min(alone[n]) for n in names) <= 0 or min(min(together[n]) for n in names) <= 0:
        return {"outcome": FAILED, "summary": "a side made no progress in a round (rate 0)"}
    k = {n: kept(alone[n], together[n]) for n in names}
    noise = max(spread(alone[n]) for n in names)
    overlap = {n: overlap_fraction(k[n]) for n in names}
    out = {"kept": k, "spread": noise, "overlap_fraction": overlap,
           "overlap_units": {n: round(overlap[n] * units.get(n, 0), 1) for n in names}, "threshold": keep}
    shown = ", ".join(f"{n} keeps {k[n]:.3f}" for n in names)
    counted = {n: (effective_alone or {}).get(n) for n in names}
    short = [n for n in names if counted[n] is not None and units.get(n) and counted[n] < BUSY_FLOOR * units[n]]
    loose = [n for n in names if counted[n] is not None and units.get(n) and counted[n] > GRAPH_HOLD * units[n]]
    if loose:
        shown += "; " + ", ".join(f"{n} alone counted {counted[n]:.1f} units, more than its {units[n]}: "
                                  "not restricted" for n in loose)
    if short:
        return {**out, "outcome": NOISY,
                "summary": f"{shown}, but " + ", ".join(f"{n} alone counted {counted[n]:.2f} of its {units[n]} units"
                                                        for n in short)
                           + ": something else holds them, too busy to judge"}
    if noise > noise_limit:
        return {**out, "outcome": NOISY,
                "summary": f"{shown}, but alone rounds differ by {noise:.0%} (> {noise_limit:.0%}): too noisy to judge"}
    if min(k.values()) >= keep:
        return {**out, "outcome": DISJOINT, "summary": f"{shown}: disjoint (both >= {keep})"}
    if sum(k.values()) <= shared_sum:
        return {**out, "outcome": SHARED, "summary": f"{shown}: one set of SMs, or time-sliced (sum <= {shared_sum})"}
    est = ", ".join(f"{n} ~{out['overlap_units'][n]:g} of {units.get(n, '?')} units shared" for n in names)
    return {**out, "outcome": PARTIAL, "summary": f"{shown}: partly overlapping ({est})"}


def kept_by_kind(alone: dict[str, Sequence[float]], together: dict[str, Sequence[float]]) -> dict[str, float | None]:
    return {n: kept(alone.get(n, ()), together.get(n, ())) for n in sorted(alone)}


def judge_graph(eager_units: float | None, graph_units: float | None, share: int, total: int | None,
                hold: float = GRAPH_HOLD) -> dict:
    """Did a graph replay stay within the share? From effective units alone (eager and replayed)."""
    if not eager_units or not graph_units:
        return {"outcome": FAILED, "summary": "no eager or graph spin rate"}
    held = graph_units <= hold * max(share, eager_units)
    whole = f" of {total}" if total else ""
    return {"outcome": "held" if held else "escaped", "eager_units": eager_units, "graph_units": graph_units,
            "share": share,
            "summary": (f"graph replay counts {graph_units:.1f}{whole} units, eager {eager_units:.1f}, share {share}: "
                        + ("the restriction holds for graph replays" if held else
                           "the replay ran outside the share (the restriction does not reach graph launches)"))}
