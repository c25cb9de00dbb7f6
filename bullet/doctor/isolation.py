"""Are two processes' shares really disjoint? Judged by timing, which needs no SM ids: process A
loops a GEMM on its share while process B loops one on the complementary share, and each one's
rate together is compared with its rate alone.

* disjoint units: both keep (nearly) their alone rate — at least KEEP (90 %) each;
* shared units, or a device that time-slices the two (no MPS): they split the time, so the two
  fractions kept add up to about one (at most SHARED_SUM);
* anything between: the shares partly overlap (or contend for something else, e.g. memory
  bandwidth or a power cap) — neither proven disjoint nor plainly shared;
* unless the device itself sets that limit: side A alone on the whole device (`whole`) shows what
  all the units together deliver. Where the two halves alone add up to more than the whole device
  does (a power cap lowers the clocks once every SM is busy), perfectly disjoint shares keep only
  `reference` = whole / (A alone + B alone), scaled to the units they hold — and shares that keep
  at least KEEP of that are disjoint as far as this device allows (on an H200 under MPS, 2026-11-26,
  each kept 74–76 % of its alone rate: overlap or power could not be told apart without it).

Rates are measured in rounds (A alone, B alone, both together), repeated; the median of each is
used, and when the alone rounds of one side disagree by more than NOISE_LIMIT the verdict is
"noisy": the machine was too busy to tell. This module is the pure judgement over measured rates
(`isolation_run` measures them), so every outcome is tested with synthetic rates."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

KEEP = 0.90  # each side keeps >= 90 % of its alone rate: disjoint
SHARED_SUM = 1.15  # the fractions kept add up to about one: the two split one set of units in time
NOISE_LIMIT = 0.15  # alone rounds of one side may differ by this much (relative to their median)

DISJOINT, SHARED, PARTIAL, NOISY, FAILED = "disjoint", "shared", "partial", "noisy", "failed"


@dataclass(frozen=True)
class IsolationSamples:
    """Rates (iterations per second) of side A and side B, alone and together, one per round.
    `errors`: what went wrong on a side that could not measure (its rates are then missing)."""

    alone_a: Sequence[float] = ()
    alone_b: Sequence[float] = ()
    together_a: Sequence[float] = ()
    together_b: Sequence[float] = ()
    errors: dict[str, str] = field(default_factory=dict)
    whole: Sequence[float] = ()  # side A alone on every unit (the device's own limit; empty: not measured)
    units: tuple[int, int, int] | None = None  # units A and B held, and the whole device's


@dataclass(frozen=True)
class IsolationVerdict:
    outcome: str  # DISJOINT, SHARED, PARTIAL, NOISY or FAILED
    summary: str
    kept_a: float | None = None  # median together / median alone
    kept_b: float | None = None
    spread: float | None = None  # largest relative spread of one side's alone rounds
    reference: float | None = None  # what disjoint shares keep on this device (module doc); None: not measured

    @property
    def isolated(self) -> bool:
        return self.outcome == DISJOINT

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "summary": self.summary, "kept_a": self.kept_a, "kept_b": self.kept_b,
                "spread": self.spread, "reference": self.reference}


def _spread(rates: Sequence[float]) -> float:
    mid = statistics.median(rates)
    return (max(rates) - min(rates)) / mid if mid > 0 else float("inf")


def judge_isolation(samples: IsolationSamples, keep: float = KEEP, shared_sum: float = SHARED_SUM,
                    noise_limit: float = NOISE_LIMIT) -> IsolationVerdict:
    """The verdict for one pair of shares (see the module doc)."""
    if samples.errors:
        return IsolationVerdict(FAILED, "; ".join(f"side {side}: {why}" for side, why in sorted(samples.errors.items())))
    sides = {"A": (samples.alone_a, samples.together_a), "B": (samples.alone_b, samples.together_b)}
    for side, (alone, together) in sides.items():
        if not alone or not together:
            return IsolationVerdict(FAILED, f"side {side} has no {'alone' if not alone else 'together'} rate")
        if min(alone) <= 0 or min(together) <= 0:
            return IsolationVerdict(FAILED, f"side {side} made no progress in a round (rate 0)")
    kept_a, kept_b = (statistics.median(t) / statistics.median(a) for a, t in sides.values())
    spread = max(_spread(samples.alone_a), _spread(samples.alone_b))
    shown = f"A keeps {kept_a:.0%}, B keeps {kept_b:.0%} of its alone rate together"
    if spread > noise_limit or max(kept_a, kept_b) > 1.0 + noise_limit:
        return IsolationVerdict(NOISY, f"{shown}, but rounds alone differ by up to {spread:.0%}: too noisy to judge",
                                kept_a, kept_b, spread)
    if min(kept_a, kept_b) >= keep:
        return IsolationVerdict(DISJOINT, f"{shown}: disjoint (both >= {keep:.0%})", kept_a, kept_b, spread)
    if kept_a + kept_b <= shared_sum:
        return IsolationVerdict(SHARED, f"{shown}: they split one set of units in time (shared, or time-sliced)",
                                kept_a, kept_b, spread)
    ref = device_reference(samples)
    if ref is not None and min(kept_a, kept_b) >= keep * ref:
        return IsolationVerdict(DISJOINT, f"{shown}: disjoint as far as this device allows — on every unit alone, "
                                          f"side A runs at {ref:.0%} of what the two shares make alone (a limit of "
                                          f"the whole device: power, memory), and both keep >= {keep:.0%} of that",
                                kept_a, kept_b, spread, ref)
    why = f"; disjoint shares would keep {ref:.0%} here (A on every unit)" if ref is not None else ""
    return IsolationVerdict(PARTIAL, f"{shown}: partly overlapping or contending (neither >= {keep:.0%} each nor "
                                     f"a plain time split{why})", kept_a, kept_b, spread, ref)


def device_reference(samples: IsolationSamples) -> float | None:
    """What two disjoint shares keep of their alone rates on this device (module doc), at most 1;
    None without a whole-device measurement."""
    if not samples.whole or samples.units is None or min(samples.whole) <= 0:
        return None
    units_a, units_b, total = samples.units
    alone = statistics.median(samples.alone_a) + statistics.median(samples.alone_b)
    if alone <= 0 or total <= 0:
        return None
    return min(1.0, statistics.median(samples.whole) / alone * (units_a + units_b) / total)
