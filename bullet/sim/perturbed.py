"""A policy's view of the device that is wrong by a realistic amount: the simulated device charges
steps with one estimator, and each policy predicts with a copy whose every prediction is off by a
fixed, seeded factor per region of the state space — as a calibrated estimator is off on hardware
(held-out error about 10 %: `bullet profile` on this project's CPU, 4-9 % per operator on the A100
reference data). Without it, policies would predict the simulated device exactly (up to its noise)
and look better than they can be.

A region is (phase, batch size or token count in powers of two, share in eighths of the device);
its factor is exp(N(0, s)) with s chosen so that the mean absolute error is `error`.

Online refinement compares what a step took with what *this* predictor said it would take, as a
worker's estimator on hardware does: an observation reaches the estimator underneath divided by the
region's factor, so its correction learns the error too, region by region (its buckets are coarser
in units than the error's: some error stays). With `learnable=False` observations pass through
unchanged and the error is permanent — the simulator before 2026-11-25, which hid the error from the
refinement that exists to correct it."""

from __future__ import annotations

import math
import random
from typing import Iterator, Sequence

from estimator.estimator import Estimator

MEAN_ABS_LOGNORMAL = math.sqrt(2.0 / math.pi)  # E|X| of X ~ N(0, 1)


class PerturbedPredictor:
    def __init__(self, est: Estimator, error: float, seed: int | str = 0, learnable: bool = True):
        if not 0.0 <= error < 1.0:
            raise ValueError(f"error must lie in [0, 1), got {error}")
        self.est, self.error, self.seed, self.learnable = est, error, seed, learnable
        self.sigma = error / MEAN_ABS_LOGNORMAL
        self.hardware, self.model, self.dtype = est.hardware, est.model, est.dtype
        self._factors: dict[tuple, float] = {}  # per region
        self._by_call: dict[tuple, float] = {}  # per (phase, size, units) asked about: its region's factor

    def factor(self, phase: str, size: int, units: int) -> float:
        if not self.error:
            return 1.0
        f = self._by_call.get((phase, size, units))  # the same (size, units) come back all the time
        if f is None:
            key = (phase, max(0, int(size)).bit_length(), min(8, max(1, round(8 * units / self.hardware.units))))
            f = self._factors.get(key)
            if f is None:
                f = self._factors[key] = math.exp(random.Random(f"{self.seed}|{key}").gauss(0.0, self.sigma))
            self._by_call[(phase, size, units)] = f
        return f

    def prediction_epoch(self, phase: str) -> int | None:
        """`Estimator.prediction_epoch`: the error factors are fixed per region, so this predictor's
        answers change exactly when the estimator's do."""
        return self.est.prediction_epoch(phase)

    # -- the Predictor protocol ---------------------------------------------------------------------
    def prefill_time(self, seq_lens: Sequence[int], units: int, num_layers: int | None = None,
                     include_head: bool = True, co_decode_batch: int = 0,
                     cached: Sequence[int] | None = None) -> float:
        t = self.est.prefill_time(seq_lens, units, num_layers, include_head, co_decode_batch, cached)
        return t * self.factor("prefill", sum(seq_lens), units)

    def decode_time(self, batch: int, context: int, units: int, co_prefill_tokens: int = 0) -> float:
        return self.est.decode_time(batch, context, units, co_prefill_tokens) * self.factor("decode", batch, units)

    def decode_time_for(self, context_lens: Sequence[int], units: int, co_prefill_tokens: int = 0) -> float:
        t = self.est.decode_time_for(context_lens, units, co_prefill_tokens)
        return t * self.factor("decode", len(context_lens), units)

    def prefill_times(self, seq_lens: Sequence[int], units: Sequence[int], num_layers: int | None = None,
                      include_head: bool = True, co_decode_batch: int = 0,
                      cached: Sequence[int] | None = None) -> Iterator[float]:
        size = sum(seq_lens)
        times = self.est.prefill_times(seq_lens, units, num_layers, include_head, co_decode_batch, cached)
        for u, t in zip(units, times):
            yield t * self.factor("prefill", size, u)

    def decode_times(self, batch: int, context: int, units: Sequence[int], co_prefill_tokens: int = 0) -> Iterator[float]:
        for u, t in zip(units, self.est.decode_times(batch, context, units, co_prefill_tokens)):
            yield t * self.factor("decode", batch, u)

    # -- online refinement reaches the estimator underneath -------------------------------------------
    def observe_prefill(self, seq_lens: Sequence[int], units: int, seconds: float, num_layers: int | None = None,
                        include_head: bool = True, co_decode_batch: int = 0) -> None:
        seen = seconds / self.factor("prefill", sum(seq_lens), units) if self.learnable else seconds
        self.est.observe_prefill(seq_lens, units, seen, num_layers, include_head, co_decode_batch)

    def observe_decode(self, context_lens: Sequence[int], units: int, seconds: float,
                       co_prefill_tokens: int = 0) -> None:
        seen = seconds / self.factor("decode", len(context_lens), units) if self.learnable else seconds
        self.est.observe_decode(context_lens, units, seen, co_prefill_tokens)
