"""How long the served comparison's points take, planned: which systems and rates fit the time a
run gives it (`fit`). No server and no import of one: the dry run prints the plan from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from artifact.gpu_check.plan import ServePlan

STOP_S = 3.0       # planned: SIGTERM, the process group gone, GPU memory released (1-2 s on the 2026-11-26 H200)
WARM_S = 2.0       # planned: the one short request after a start
SETTLE_S = 1.0     # planned: after a point, until the server is idle again
SETTLE_CAP_S = 15.0
PROFILE_S = 75.0   # what a bullet launch adds when it must measure its profile itself


def point_cost(sp: ServePlan) -> float:
    """A point as planned: its arrivals, the drain expected after them, the server settling."""
    return sp.window_s + sp.drain_s + SETTLE_S


def system_cost(sp: ServePlan, launch_s: float, rates: int) -> float:
    return launch_s + WARM_S + STOP_S + rates * point_cost(sp)


def fit(sp: ServePlan, seconds: float, launches: list[float]) -> tuple[int, list[float]] | None:
    """(how many of the plan's systems, which rates) fit in `seconds`, each system's start planned
    at `launches` (in the plan's order): every system at every rate; if not, the highest rates go
    (down to `min_rates`), then the last systems (down to `min_systems`); None when even that does
    not fit."""
    systems, rates = len(sp.systems), list(sp.rates)

    def cost() -> float:
        return sum(system_cost(sp, launch, len(rates)) for launch in launches[:systems])

    while cost() > seconds and len(rates) > sp.min_rates:
        rates.pop()
    while cost() > seconds and systems > sp.min_systems:
        systems -= 1
    return (systems, rates) if cost() <= seconds else None


def describe(sp: ServePlan, seconds: float, profile_given: bool) -> str:
    """What `fit` makes of `seconds` for the served comparison, in words."""
    launches = [sp.launch_s + (0.0 if profile_given or p != "bullet" else PROFILE_S) for p, _ in sp.systems]
    chosen = fit(sp, seconds, launches)
    if chosen is None:
        return f"in {seconds:.0f} s: nothing fits"
    count, rates = chosen
    planned = sum(system_cost(sp, x, len(rates)) for x in launches[:count])
    return (f"in {seconds:.0f} s: {', '.join(p for p, _ in sp.systems[:count])} at "
            f"{', '.join(f'{r:g}' for r in rates)} req/s (planned {planned:.0f} s)")
