"""How the GPU profiler restricts its kernels to a share of the SMs, and which shares it measures.

The mechanism is the serving workers' own partition backend (libsmctrl masks, green-context
streams), which lives in the control plane; the estimator must not import it. So the caller hands
the profiler a `ShareControl` — `bullet.partition.share_control.PartitionShares` in `bullet profile`,
a fake in the tests — and a picklable factory of one for the co-running process.

Shares are measured where the SRM curve bends and where the policy operates: a few small shares
(decode's usual), the middle, and everything; the calibration interpolates between them."""

from __future__ import annotations

import bisect
from typing import Callable, ContextManager, Protocol, Sequence

# fractions of the device the solo sweeps measure (rounded up to a share the backend can grant)
SOLO_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
QUICK_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1.0)
# decode's share when the two phases co-run (prefill gets the rest)
CORUN_DECODE_FRACTIONS = (1 / 4, 1 / 2)


class ShareControl(Protocol):
    """Runs kernels on a share of the GPU: inside `use(role, units)`, the current CUDA stream is the
    one the backend restricts to that share (prefill's SMs from the low end, decode's from the high)."""

    name: str
    total_units: int

    def feasible(self, role: str) -> list[int]:
        """Share sizes the backend can grant `role`, ascending."""

    def use(self, role: str, units: int) -> ContextManager: ...

    def close(self) -> None: ...


ShareFactory = Callable[[], ShareControl]


def round_up(feasible: Sequence[int], units: float) -> int:
    """The smallest feasible share >= units (the largest if none is)."""
    i = bisect.bisect_left(feasible, units)
    return feasible[min(i, len(feasible) - 1)]


def profiled_shares(feasible: Sequence[int], quick: bool = False) -> list[int]:
    """The SM counts the solo sweeps run on: a share per fraction, without repeats."""
    feasible = sorted(feasible)
    total = feasible[-1]
    fractions = QUICK_FRACTIONS if quick else SOLO_FRACTIONS
    return sorted({round_up(feasible, f * total) for f in fractions})


def corun_splits(prefill_feasible: Sequence[int], decode_feasible: Sequence[int]) -> list[tuple[int, int]]:
    """(prefill units, decode units) pairs for co-running: decode on about a quarter and a half of
    the device, prefill on the largest share that does not overlap it."""
    prefill_feasible, decode_feasible = sorted(prefill_feasible), sorted(decode_feasible)
    total = max(prefill_feasible[-1], decode_feasible[-1])
    splits = set()
    for fraction in CORUN_DECODE_FRACTIONS:
        decode = round_up(decode_feasible, fraction * total)
        fitting = [p for p in prefill_feasible if p + decode <= total]
        if fitting:
            splits.add((fitting[-1], decode))
    return sorted(splits, key=lambda s: s[1])
