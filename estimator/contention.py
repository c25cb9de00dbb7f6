"""Interference between the two workers when they run side by side on disjoint units (Bullet §3.2.3).

Units are isolated but memory is not. Decode, bandwidth-bound, loses bandwidth to a prefill running
on the other units: we keep the attainable bandwidth D_{p,sl} as a fraction of the bandwidth the
same p units get alone, measured for a few prefill lengths sl (a bandwidth probe on p units beside a
large GEMM on the others) and interpolated in log(sl). Prefill, compute-bound, barely notices decode
(paper: < 8 % above 60 % of the SMs); an optional slowdown table over the decode batch covers it.

No table means no contention: that is the state of the built-in GPU descriptions until the profiler
has measured them on a device.

Where the two share units instead (a CPU profile times each phase on every core beside the other on
every core too), `shared_units` keeps what that costs each phase: the simulator's time-sliced CPU
device charges it (`bullet.sim.device`)."""

from __future__ import annotations

import bisect
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from estimator.calibration import Sample


class BandwidthPoint(BaseModel):
    """D_{p,sl} / D_p measured with `units` units running the bandwidth probe."""

    model_config = ConfigDict(frozen=True)
    units: int = Field(gt=0)
    prefill_tokens: int = Field(gt=0)
    fraction: float = Field(gt=0, le=1.5)


class SlowdownPoint(BaseModel):
    """Prefill time with a decode batch beside it / prefill time alone."""

    model_config = ConfigDict(frozen=True)
    decode_batch: int = Field(gt=0)
    factor: float = Field(gt=0)


def _interp_log(xs: list[float], ys: list[float], x: float, at_zero: float) -> float:
    """Piecewise linear in log(x) through (xs, ys); flat beyond the last point; from `at_zero`
    at x = 0 linearly up to the first point."""
    if x <= 0 or not xs:
        return at_zero
    if x <= xs[0]:
        return at_zero + (ys[0] - at_zero) * x / xs[0]
    if x >= xs[-1]:
        return ys[-1]
    k = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[k - 1])) / (math.log(xs[k]) - math.log(xs[k - 1]))
    return ys[k - 1] + t * (ys[k] - ys[k - 1])


class ContentionLookup:
    """The tables of a `ContentionModel` as plain lists, for the predictor's hot path."""

    __slots__ = ("curves", "units", "slow", "_fractions", "_slowdowns")

    def __init__(self, model: "ContentionModel"):
        self.curves: dict[int, tuple[list[float], list[float]]] = {}
        for point in sorted(model.decode_bandwidth, key=lambda p: (p.units, p.prefill_tokens)):
            xs, ys = self.curves.setdefault(point.units, ([], []))
            xs.append(float(point.prefill_tokens))
            ys.append(point.fraction)
        self.units = sorted(self.curves)
        slow = sorted(model.prefill_slowdown, key=lambda p: p.decode_batch)
        self.slow = ([float(p.decode_batch) for p in slow], [p.factor for p in slow])
        # answers by argument: the predictor asks about the same few states all the time
        self._fractions: dict[tuple[int, int], float] = {}
        self._slowdowns: dict[int, float] = {}

    def decode_bandwidth_fraction(self, prefill_tokens: int, units: int) -> float:
        if prefill_tokens <= 0 or not self.units:
            return 1.0
        key = (prefill_tokens, units)
        fraction = self._fractions.get(key)
        if fraction is None:
            if len(self._fractions) >= 1 << 16:
                self._fractions.clear()
            fraction = self._fractions[key] = self._fraction(prefill_tokens, units)
        return fraction

    def _fraction(self, prefill_tokens: int, units: int) -> float:
        profiled = self.units
        k = bisect.bisect_left(profiled, units)
        nearest = profiled[min(k, len(profiled) - 1)]
        if k > 0 and (k == len(profiled) or units - profiled[k - 1] < profiled[k] - units):
            nearest = profiled[k - 1]
        xs, ys = self.curves[nearest]
        return _interp_log(xs, ys, float(prefill_tokens), 1.0)

    def prefill_slowdown_factor(self, decode_batch: int) -> float:
        if decode_batch <= 0 or not self.slow[0]:
            return 1.0
        factor = self._slowdowns.get(decode_batch)
        if factor is None:
            if len(self._slowdowns) >= 1 << 16:
                self._slowdowns.clear()
            factor = self._slowdowns[decode_batch] = _interp_log(*self.slow, float(decode_batch), 1.0)
        return factor


class SharedUnitsPoint(BaseModel):
    """A step of `kind` on every unit while the other phase looped on every unit too (a CPU's cores,
    which the OS time-slices between the two processes) / the same step alone."""

    model_config = ConfigDict(frozen=True)
    kind: Literal["prefill", "decode"]
    factor: float = Field(gt=0)


class ContentionModel(BaseModel):
    decode_bandwidth: list[BandwidthPoint] = Field(default_factory=list)
    prefill_slowdown: list[SlowdownPoint] = Field(default_factory=list)
    shared_units: list[SharedUnitsPoint] = Field(default_factory=list)
    # The co-running steps the tables were fitted to (`bullet profile`), kept so that a profile
    # can be refitted without measuring again. The predictor reads only the tables.
    samples: list[Sample] = Field(default_factory=list)

    def lookup(self) -> ContentionLookup:
        return ContentionLookup(self)

    def decode_bandwidth_fraction(self, prefill_tokens: int, units: int) -> float:
        """D_{p,sl} / D_p for decode on `units` units beside a prefill of `prefill_tokens` tokens,
        from the curve of the nearest profiled unit count (1 without a table)."""
        return self.lookup().decode_bandwidth_fraction(prefill_tokens, units)

    def prefill_slowdown_factor(self, decode_batch: int) -> float:
        """Prefill time beside a decode batch / alone (1 without a table)."""
        return self.lookup().prefill_slowdown_factor(decode_batch)

    def add_bandwidth(self, units: int, prefill_tokens: int, fraction: float) -> None:
        self.decode_bandwidth.append(BandwidthPoint(units=units, prefill_tokens=prefill_tokens, fraction=fraction))

    def shared_units_slowdown(self) -> float | None:
        """How many times its time alone a step takes on units the other phase also holds: the geometric
        mean over the measured phases (None: not measured)."""
        if not self.shared_units:
            return None
        return math.exp(sum(math.log(p.factor) for p in self.shared_units) / len(self.shared_units))

    def shared_units_text(self) -> str:
        """The measured factors as the profile's notes print them ("prefill 1.31x, decode 2.04x")."""
        return ", ".join(f"{p.kind} {p.factor:.2f}x" for p in self.shared_units)

    def add_slowdown(self, decode_batch: int, factor: float) -> None:
        self.prefill_slowdown.append(SlowdownPoint(decode_batch=decode_batch, factor=factor))
