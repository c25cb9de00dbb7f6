"""Calibration of the SRM against measurements (Bullet Eq. 2, alpha = measured / SRM).

Samples are raw measurements — what ran, in which state, on how many units, how long it took — so
that a profile stays valid when the SRM or the hardware description changes: the estimator turns
them into alpha curves when it is built.

Two kinds of samples:
* op samples time one kernel (`kind` = a class of `estimator.ops.ALL_CLASSES`), e.g. from an operator
  profile such as Vidur's; `seconds` is one launch.
* phase samples time a whole step of the served model (`kind` = "prefill" or "decode"), e.g. from
  `bullet profile`; they calibrate what the op-level model still misses, end to end. A "hybrid"
  sample times one step of fresh prompt chunks (`prefill_lens`) beside a decode batch, as a
  chunked-prefill engine runs them (`Estimator.hybrid_step_time`).

At most a couple of samples per kind are needed. Between two samples alpha is interpolated, outside
them it is held flat ("log" mode: linear in log(size)), or the pair is read as a fixed cost plus a
slope ("affine" mode: measured = q + p * SRM, i.e. alpha linear in 1/SRM), which suits kernels with a
large fixed cost such as split-KV decode attention. "constant" mode keeps one alpha (the geometric
mean) for every size: a residual factor that must not bend the shape of the model below it.
"piecewise" mode goes through every sample: measured time linear in the SRM time between adjacent
samples, alpha held flat beyond them. It never predicts less for more work when the samples do not
(alpha linear in log(size) can dip between two samples of equal time), which matters on a CPU, where
small kernels cost the same whatever their size."""

from __future__ import annotations

import bisect
import functools
import math
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from estimator.ops import ALL_CLASSES

PHASES = ("prefill", "decode", "hybrid")  # hybrid: a prompt chunk and decode rows in one step (chunked baselines)
Interpolation = Literal["log", "affine", "constant", "piecewise"]
# Modes that read the SRM time of the state itself (not only its size) at prediction time.
SRM_MODES = ("affine", "piecewise")
# Decode attention pays planning and split-KV merge costs whatever the context: a fixed cost plus
# a bandwidth-bound slope fits it (numbers.md: batch 1..128), alpha(log size) does not.
DEFAULT_INTERPOLATION: dict[str, Interpolation] = {"attn_decode": "affine"}
# A kernel without samples borrows the curve of a kernel of the same kind.
FALLBACK_CLASS = {"post_attn_norm": "input_norm", "final_norm": "input_norm", "input_norm": "post_attn_norm",
                  "lm_head": "gate_up_proj", "embedding": "residual_add"}


class Sample(BaseModel):
    """One measured latency. The state is a packed prefill (`prefill_lens`) and/or a decode batch
    (`decode_batch` requests holding `decode_context` KV tokens in total). For a per-token kernel a
    T-row sample is simply `prefill_lens=[T]`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    units: int = Field(gt=0)
    seconds: float = Field(gt=0)
    prefill_lens: tuple[int, ...] = ()
    decode_batch: int = 0
    decode_context: int = 0
    num_layers: int | None = None  # phase samples: layers run (None = all)
    include_head: bool = True  # phase samples: embedding + LM head included
    co_running: int = 0  # phase samples: decode batch / prefill tokens running on the other units
    # phase samples beside the other phase: the units it ran on (0: not recorded, the complementary share).
    # Beside a co-runner holding some of the same units (`shares_units`), the sample measures what sharing
    # them costs (a CPU's cores time-sliced between two processes), not memory contention
    co_units: int = 0

    def model_post_init(self, _context) -> None:
        if self.kind not in ALL_CLASSES and self.kind not in PHASES:
            raise ValueError(f"unknown sample kind {self.kind!r}")
        if not self.prefill_lens and not self.decode_batch:
            raise ValueError("a sample needs prefill_lens or a decode batch")

    @property
    def tokens(self) -> int:
        return sum(self.prefill_lens) + self.decode_batch


def shares_units(sample: Sample, total_units: int) -> bool:
    """Whether `sample` ran on units that its co-runner also held (shares summing above the device)."""
    return sample.co_units > 0 and sample.units + sample.co_units > total_units


class AlphaCurve:
    """alpha as a function of size (log mode) or of the SRM time itself (affine mode), from points
    (size, srm_seconds, measured_seconds). Points of equal size are averaged first."""

    def __init__(self, points: Sequence[tuple[float, float, float]], mode: Interpolation = "log"):
        if not points:
            raise ValueError("an alpha curve needs at least one sample")
        by_size: dict[float, list[tuple[float, float]]] = {}
        for size, srm, measured in points:
            by_size.setdefault(size, []).append((srm, measured))
        merged = sorted((s, sum(p[0] for p in v) / len(v), sum(p[1] for p in v) / len(v))
                        for s, v in by_size.items())
        self.mode = mode
        self.log_sizes = tuple(math.log(max(s, 1.0)) for s, _, _ in merged)
        self.alphas = tuple(m / srm for _, srm, m in merged)
        self.srms = tuple(srm for _, srm, _ in merged)
        if mode == "piecewise":
            self.piece_srms, self.piece_times = _piecewise_points(points)
        self._alpha_of_size: dict[float, float] = {}  # log modes: alpha depends on the size alone
        if mode == "constant":  # one alpha for every size: the geometric mean, as a single point
            self.alphas = (math.exp(sum(math.log(a) for a in self.alphas) / len(self.alphas)),)
            self.log_sizes, self.srms = self.log_sizes[:1], self.srms[:1]
        # affine: measured = q + p * srm through the two outermost points
        if mode == "affine" and len(merged) >= 2 and merged[-1][1] != merged[0][1]:
            (_, s0, m0), (_, s1, m1) = merged[0], merged[-1]
            self.slope = (m1 - m0) / (s1 - s0)
            self.fixed = m0 - self.slope * s0
        else:
            self.slope, self.fixed = self.alphas[0], 0.0

    def _piecewise(self, srm: float) -> float:
        xs, ys = self.piece_srms, self.piece_times
        if srm <= xs[0]:
            return ys[0] / xs[0] * srm
        if srm >= xs[-1]:
            return ys[-1] / xs[-1] * srm
        k = bisect.bisect_right(xs, srm)
        t = (srm - xs[k - 1]) / (xs[k] - xs[k - 1])
        return ys[k - 1] + t * (ys[k] - ys[k - 1])

    def segment(self) -> tuple[float, float, float, float]:
        """(x0, x1, alpha0, alpha1) of the log-mode segment, for the predictor's fast path."""
        return self.log_sizes[0], self.log_sizes[-1], self.alphas[0], self.alphas[-1]

    def alpha_at_log_size(self, log_size: float) -> float:
        xs, ys = self.log_sizes, self.alphas
        if log_size <= xs[0]:
            return ys[0]
        if log_size >= xs[-1]:
            return ys[-1]
        for k in range(1, len(xs)):
            if log_size <= xs[k]:
                t = (log_size - xs[k - 1]) / (xs[k] - xs[k - 1])
                return ys[k - 1] + t * (ys[k] - ys[k - 1])
        return ys[-1]

    def calibrated(self, size: float, srm_seconds: float) -> float:
        """Predicted seconds = alpha * SRM."""
        if self.mode == "piecewise":
            return self._piecewise(srm_seconds)
        if self.mode == "affine":
            predicted = self.fixed + self.slope * srm_seconds
            if self.fixed < 0 and srm_seconds < self.srms[0]:  # a negative floor: hold alpha flat
                return self.alphas[0] * srm_seconds
            return predicted if predicted > 0 else self.alphas[0] * srm_seconds
        alpha = self._alpha_of_size.get(size)
        if alpha is None:
            if len(self._alpha_of_size) >= 1 << 16:
                self._alpha_of_size.clear()
            alpha = self._alpha_of_size[size] = self.alpha_at_log_size(math.log(max(size, 1.0)))
        return alpha * srm_seconds


def _piecewise_points(points: Sequence[tuple[float, float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(SRM times, measured times) ordered by SRM, one point per distinct SRM time."""
    by_srm: dict[float, list[float]] = {}
    for _, srm, measured in points:
        by_srm.setdefault(srm, []).append(measured)
    ordered = sorted((srm, sum(v) / len(v)) for srm, v in by_srm.items())
    return tuple(p[0] for p in ordered), tuple(p[1] for p in ordered)


def unit_blend(sampled: Sequence[int], units: int) -> tuple[tuple[int, float], ...]:
    """Which sampled unit counts a prediction on `units` units takes its alpha from, with weights:
    the count itself if sampled, else a linear blend of the two sampled counts around it, else the
    nearest. With samples at one unit count only, alpha carries over to every count unchanged (the
    GPU profiles: Bullet samples at full device and extrapolates); a measured CPU has samples at
    every core count, because its cores share caches and clocks and alpha moves with the count."""
    counts = sorted(set(sampled))
    if not counts:
        return ()
    if units <= counts[0]:
        return ((counts[0], 1.0),)
    if units >= counts[-1]:
        return ((counts[-1], 1.0),)
    for lo, hi in zip(counts, counts[1:]):
        if units == lo:
            return ((lo, 1.0),)
        if lo < units < hi:
            t = (units - lo) / (hi - lo)
            return ((lo, 1.0 - t), (hi, t))
    return ((counts[-1], 1.0),)


def by_units(points: Sequence[tuple[int, tuple[float, float, float]]], mode: Interpolation,
             total_units: int) -> list[tuple[tuple[AlphaCurve, float], ...]]:
    """Alpha curves fitted per sampled unit count from (units, (size, srm, measured)) points,
    and for every unit count 0..total_units the blend of them a prediction uses (index = units)."""
    grouped: dict[int, list[tuple[float, float, float]]] = {}
    for units, point in points:
        grouped.setdefault(units, []).append(point)
    curves = {units: AlphaCurve(pts, mode) for units, pts in grouped.items()}
    blends = [()]
    for units in range(1, total_units + 1):
        blends.append(tuple((curves[u], w) for u, w in unit_blend(list(curves), units)))
    return blends


@functools.lru_cache(maxsize=4096)
def _bucket_keys(phase: str, size_bucket: int, units_bucket: int) -> tuple[str, str, str]:
    """The three keys of a bucket (built once: predictions ask about the same buckets all the time)."""
    return (f"{phase}/{size_bucket}/{units_bucket}", f"{phase}/{size_bucket}", phase)


# the keys of each (phase, size, units, total units, units buckets) a prediction asked about: a
# scheduler asks about the same few all the time, and the factor is on its hot path
_KEYS_OF_CALL: dict[tuple, tuple[str, ...]] = {}  # a co-run call: its tree's three keys, then the solo tree's
_KEYS_LIMIT = 1 << 16
CO_RUN = "+co"  # the phase's tree of steps that ran beside the other worker's (OnlineCorrection)


class OnlineCorrection(BaseModel):
    """Multiplicative corrections learnt from observed step latencies: an exponentially weighted
    moving average of observed / predicted at three levels — (phase), (phase, size bucket) and
    (phase, size bucket, units bucket). A prediction uses the finest level observed so far; a level
    seen for the first time starts from its parent's value, so one odd step moves it by `weight`
    only, and a systematic error spreads at once to sizes and splits not yet observed.

    A lone spike is held back: an observation more than `spike` times off the current correction
    (either way) is folded in only when the phase's next observation is off the same way too — a
    shift that lasts is learnt one step late, a one-off is not learnt at all. On an H200 the first
    layer group of every prompt of a new length took 50-70 ms instead of 3-10 (a per-shape kernel
    plan) and the very first step 713 ms: folded at weight 0.25, each made every prefill prediction
    for the next several steps 1.3-3x too long (the decisions of the bullet policy rest on them).

    Steps that ran beside the other worker's (`co=True`) learn in a tree of their own (`CO_RUN`
    appended to the phase), whose first value is the solo correction of the same state: what a
    co-run costs beyond the contention model is learnt apart from the estimator's error alone. With
    one tree for both, a co-run that cost twice its price made every step look twice as slow — decode
    alone on every unit after a burst, prefill alone while decode idles (found in simulation with
    `--corun-scale 2`)."""

    weight: float = Field(0.25, gt=0, le=1, description="EWMA weight of a new observation")
    units_buckets: int = Field(4, gt=0)
    spike: float = Field(3.0, gt=1, description="an observation this many times off the current correction, "
                                                "either way, waits for the next one to confirm it")
    factors: dict[str, float] = Field(default_factory=dict)  # "phase", "phase/s", "phase/s/u" (and "phase+co"...)
    # per tree ("phase", "phase+co"): the spike held back (whether it was slow, and its observe() arguments),
    # until the tree's next one
    _held: dict[str, tuple[bool, tuple[int, int, int, float]]] = PrivateAttr(default_factory=dict)
    _spikes_held: int = PrivateAttr(0)

    @property
    def spikes_held(self) -> int:
        """Lone spikes dropped so far (held back, then not confirmed by the next observation)."""
        return self._spikes_held

    def keys(self, phase: str, size: int, units: int, total_units: int) -> tuple[str, str, str]:
        """Finest first. Sizes are bucketed by powers of two, units by fractions of the device."""
        size_bucket = max(size, 1).bit_length()
        units_bucket = min(self.units_buckets - 1, units * self.units_buckets // (total_units + 1))
        return _bucket_keys(phase, size_bucket, units_bucket)

    def factor(self, phase: str, size: int, units: int, total_units: int, co: bool = False) -> float:
        """The correction of a prediction; `co`: of a step beside the other worker's (its own tree,
        else the solo one)."""
        factors = self.factors
        if not factors:
            return 1.0
        # the scheduler's hot path: both trees' keys of a call found in one look-up of the cache
        call = (phase, size, units, total_units, self.units_buckets, co)
        keys = _KEYS_OF_CALL.get(call)
        if keys is None:
            if len(_KEYS_OF_CALL) >= _KEYS_LIMIT:
                _KEYS_OF_CALL.clear()
            keys = self.keys(phase, size, units, total_units)
            if co:
                keys = self.keys(phase + CO_RUN, size, units, total_units) + keys
            _KEYS_OF_CALL[call] = keys
        for key in keys:
            found = factors.get(key)
            if found is not None:
                return found
        return 1.0

    def observe(self, phase: str, size: int, units: int, total_units: int, ratio: float, co: bool = False) -> None:
        """Fold one observed / predicted ratio (of the uncorrected prediction) into every level of the
        tree of `phase` (`co`: of a step beside the other worker's) — unless it is a spike (see the
        class): then it waits for the tree's next observation."""
        # a private attribute is a pydantic __getattr__ per access (microseconds; this runs every
        # step): read from the dict pydantic keeps them in
        held_by_phase = self.__pydantic_private__["_held"]
        tree = phase + CO_RUN if co else phase
        held = held_by_phase.pop(tree, None) if held_by_phase else None
        current = self.factor(phase, size, units, total_units, co)
        up = ratio > current * self.spike
        if up or ratio * self.spike < current:
            if held is not None and held[0] == up:  # two in a row, the same way: the error is real
                self._fold(phase, co, *held[1])
                self._fold(phase, co, size, units, total_units, ratio)
                return
            if held is not None:  # the one before was a one-off: dropped
                self._spikes_held += 1
            held_by_phase[tree] = (up, (size, units, total_units, ratio))
            return
        if held is not None:
            self._spikes_held += 1
        self._fold(phase, co, size, units, total_units, ratio)

    def _fold(self, phase: str, co: bool, size: int, units: int, total_units: int, ratio: float) -> None:
        # a level seen for the first time starts from its parent; the co-run tree's root from the solo
        # correction of this state
        parent = self.factor(phase, size, units, total_units) if co else 1.0
        factors, weight = self.factors, self.weight
        for key in reversed(self.keys(phase + CO_RUN if co else phase, size, units, total_units)):
            old = factors.get(key, parent)
            factors[key] = old + weight * (ratio - old)
            parent = old

    def reset(self) -> None:
        self.factors.clear()
        self._held.clear()


class Calibration(BaseModel):
    """Everything measured about one (model, device): samples plus the online corrections."""

    samples: list[Sample] = Field(default_factory=list)
    interpolation: dict[str, Interpolation] = Field(default_factory=lambda: dict(DEFAULT_INTERPOLATION))
    online: OnlineCorrection = Field(default_factory=OnlineCorrection)

    def add(self, kind: str, seconds: float, units: int, **state) -> Sample:
        """Record one measurement, e.g. `add("qkv_proj", 43e-6, 108, prefill_lens=[128])` or
        `add("decode", 0.012, 2, decode_batch=8, decode_context=8192)`."""
        sample = Sample(kind=kind, seconds=seconds, units=units, **state)
        self.samples.append(sample)
        return sample

    def of_kind(self, kind: str) -> list[Sample]:
        return [s for s in self.samples if s.kind == kind]

    def kinds(self) -> set[str]:
        return {s.kind for s in self.samples}

    def mode(self, kind: str) -> Interpolation:
        return self.interpolation.get(kind, "log")
