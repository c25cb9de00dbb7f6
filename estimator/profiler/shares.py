"""How the profiler puts its kernels on a share of the device, and which GPU shares it measures.

Both devices answer the same `Shares`, and the measuring core (`session`) and the co-runner
(`corun`) go through it on either:
* on a CPU a share is a set of cores: `CoreShares` pins every thread of the process to it, exactly
  as a worker's `cpu` partition backend does;
* on a GPU a share is a set of SMs, restricted by the serving workers' own partition backend
  (libsmctrl masks, green-context streams). It lives in the control plane, which the estimator must
  not import, so the caller hands the profiler a `ShareControl` (`Shares` that also say which sizes
  the backend grants): `bullet.partition.share_control.PartitionShares` in `bullet profile`, a fake
  in the tests, and a picklable factory of one for the co-running process.

GPU shares are measured where the SRM curve bends and where the policy operates: a few small shares
(decode's usual), the middle, and everything; the calibration interpolates between them. (The CPU
plan measures every core count on small CPUs: `sweep.profiled_unit_counts`.)"""

from __future__ import annotations

import bisect
from contextlib import contextmanager
from typing import Callable, ContextManager, Protocol, Sequence

from engines.host import share_of, use_cores

# fractions of the device the solo sweeps measure (rounded up to a share the backend can grant)
SOLO_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
QUICK_FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1.0)
# decode's share when the two phases co-run (prefill gets the rest)
CORUN_DECODE_FRACTIONS = (1 / 4, 1 / 2)


class Shares(Protocol):
    """Runs kernels on a share of the device: inside `use(role, units)`, this process's threads (CPU)
    or the current CUDA stream (GPU) are restricted to that share — prefill's units from the low end,
    decode's from the high end, as the workers split them. What the measuring core and the co-runner
    need of either device."""

    def use(self, role: str, units: int) -> ContextManager: ...

    def close(self) -> None: ...


class ShareControl(Shares, Protocol):
    """A GPU's shares, and which ones its backend can grant (the GPU plan picks among them)."""

    name: str
    total_units: int

    def feasible(self, role: str) -> list[int]:
        """Share sizes the backend can grant `role`, ascending."""


ShareFactory = Callable[[], ShareControl]  # picklable: `bullet profile` hands one to the GPU profiler


class CoreShares:
    """The CPU's `Shares`: `use(role, units)` pins every thread of this process to `role`'s `units`
    of `cores` (prefill: the low cores, decode: the high ones) with as many torch threads, exactly as
    a worker's `cpu` partition backend does. A pinning outlasts its block (the next `use` replaces
    it; `session.ProfileSession.close` gives the process its cores back). Picklable, so the
    co-runner builds its own from `functools.partial(CoreShares, cores)`."""

    def __init__(self, cores: Sequence[int]):
        self.cores = list(cores)

    @contextmanager
    def use(self, role: str, units: int):
        use_cores(share_of(self.cores, units, from_high=role == "decode"))
        yield

    def close(self) -> None:
        pass  # nothing held: the threads keep their last share until the session restores them


def round_up(feasible: Sequence[int], units: float) -> int:
    """The smallest feasible share >= units (the largest if none is)."""
    i = bisect.bisect_left(feasible, units)
    return feasible[min(i, len(feasible) - 1)]


def nearest(feasible: Sequence[int], units: float) -> int:
    """The feasible share closest to `units` (the larger of two as close)."""
    return min(feasible, key=lambda u: (abs(u - units), -u))


def profiled_shares(feasible: Sequence[int], quick: bool = False) -> list[int]:
    """The SM counts the solo sweeps run on: a share per fraction, the feasible one nearest to it,
    without repeats. Nearest, not rounded up: a server's green-context pool splits the device at these
    fractions rounded to the nearest group (`GroupLayout.coarse_counts`), so the profile measures the
    shares a server runs on; rounded up, an H200's eighth was measured at 24 SMs while its decode
    worker ran on 16, a share the profile then extrapolated to twice its served time (2026-11-26)."""
    feasible = sorted(feasible)
    total = feasible[-1]
    fractions = QUICK_FRACTIONS if quick else SOLO_FRACTIONS
    return sorted({nearest(feasible, f * total) for f in fractions})


def corun_splits(prefill_feasible: Sequence[int], decode_feasible: Sequence[int]) -> list[tuple[int, int]]:
    """(prefill units, decode units) pairs for co-running: decode on about a quarter and a half of
    the device, prefill on the largest share that does not overlap it."""
    prefill_feasible, decode_feasible = sorted(prefill_feasible), sorted(decode_feasible)
    total = max(prefill_feasible[-1], decode_feasible[-1])
    splits = set()
    for fraction in CORUN_DECODE_FRACTIONS:
        decode = nearest(decode_feasible, fraction * total)  # as `profiled_shares`
        fitting = [p for p in prefill_feasible if p + decode <= total]
        if fitting:
            splits.add((fitting[-1], decode))
    return sorted(splits, key=lambda s: s[1])
