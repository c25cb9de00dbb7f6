"""One interface for every way of dividing an accelerator's compute units between the two workers.

A *unit* is what the backend divides: a CPU core (`cpu`), or a streaming multiprocessor (`libsmctrl`,
`green-ctx`), always counted in the same units the estimator uses. Each worker owns one backend
object for its own process and role:

* `prefill` takes units from the low end of the id range, `decode` from the high end. Two workers
  whose counts sum to at most `total_units` therefore hold disjoint sets without talking to each
  other, and they overlap (in the middle) only when the policy asks for more than the total — which
  Bullet does on purpose during hand-over instead of idling units (§3.3).
* `apply(units)` is called between steps, so it must be cheap; its cost is recorded for every call
  (the runtime reports it as "resource re-configuration" time, Bullet Table 5).
* Requests are rounded *up* to the next count the mechanism can express (`feasible_units()`), so a
  policy that asked for the fewest units keeping TPOT never gets fewer; `current_units` reports
  what was actually granted.

Policy code calls only this interface; it never branches on the backend type."""

from __future__ import annotations

import bisect
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from bullet.partition.stats import ApplyCostRecorder, ApplyCostSummary
from engines.cpuset import format_id_list, parse_id_list  # noqa: F401 (re-exported: the CLI and reports use them)

ROLES = ("prefill", "decode")
PEER = {"prefill": "decode", "decode": "prefill"}


class PartitionUnavailable(RuntimeError):
    """The backend cannot work on this machine; the message names what is missing."""


@dataclass(frozen=True)
class Granularity:
    """Smallest share (`minimum`) and the step between expressible shares, in units."""

    minimum: int
    step: int

    def __post_init__(self):
        if self.minimum < 1 or self.step < 1:
            raise ValueError(f"granularity needs minimum >= 1 and step >= 1, got {self}")

    def feasible(self, total: int) -> list[int]:
        return list(range(self.minimum, total + 1, self.step))


def role_slice(total: int, units: int, role: str) -> range:
    """Unit ids of a `units`-sized share for `role`: prefill from the low end, decode from the high."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    units = max(0, min(units, total))
    return range(0, units) if role == "prefill" else range(total - units, total)


class PartitionBackend(ABC):
    name: str = "?"
    unit_kind: str = "unit"  # "core" or "SM": what one unit is, for reports

    def __init__(self, role: str, total_units: int, granularity: Granularity):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if total_units < granularity.minimum:
            raise PartitionUnavailable(
                f"{self.name}: only {total_units} {self.unit_kind}s, fewer than the minimum share "
                f"{granularity.minimum}")
        self.role = role
        self.total_units = total_units
        self.granularity = granularity
        self._current = total_units  # a fresh worker runs on everything until the first apply
        self._costs = ApplyCostRecorder()

    # ---- the interface policy code uses -------------------------------------------------------
    def feasible_units(self) -> list[int]:
        """Every share size this backend can grant, ascending."""
        return self.granularity.feasible(self.total_units)

    def peer_feasible_units(self) -> list[int]:
        """The share sizes the other worker's backend grants beside this one (the same pool here; a
        pool whose remainder joins prefill's shares differs by role: `GreenContextBackend`)."""
        return self.feasible_units()

    def round_units(self, units: int) -> int:
        """The share `apply(units)` would grant: the smallest feasible count >= units (capped at
        the largest)."""
        if units < 1:
            raise ValueError(f"a worker needs at least one {self.unit_kind}, asked for {units}")
        feasible = self.feasible_units()
        return feasible[min(bisect.bisect_left(feasible, units), len(feasible) - 1)]

    def apply(self, units: int) -> None:
        """Change this worker's share to `units` (rounded up to a feasible count). Affects work
        issued after the call; cheap enough to call between any two steps."""
        granted = self.round_units(units)
        start = time.perf_counter_ns()
        self._apply(granted)
        self._costs.record(time.perf_counter_ns() - start)
        self._current = granted

    @property
    def current_units(self) -> int:
        return self._current

    def unit_set(self) -> frozenset[int]:
        """Concrete ids of the units this worker currently holds (core ids, SM ids)."""
        return frozenset(self._ids_of(role_slice(self.total_units, self._current, self.role)))

    def unit_mask(self) -> int:
        """`unit_set()` as a bit mask (bit u set = unit u held): what a worker publishes."""
        mask = 0
        for u in self.unit_set():
            mask |= 1 << u
        return mask

    def launch_stream(self) -> int | None:
        """CUDA stream handle the worker must launch its kernels on after `apply`, or None when
        the backend does not dictate one (it restricts whatever the worker already uses)."""
        return None

    def apply_costs(self) -> ApplyCostSummary:
        return self._costs.summary()

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "role": self.role,
            "unit_kind": self.unit_kind,
            "total_units": self.total_units,
            "granularity": {"minimum": self.granularity.minimum, "step": self.granularity.step},
            "current_units": self.current_units,
            "unit_set": format_id_list(self.unit_set()),
            "apply_cost": self.apply_costs().as_dict(),
            **self._details(),
        }

    def close(self) -> None:
        """Release what the backend holds (green contexts, streams). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- what each backend implements ---------------------------------------------------------
    @abstractmethod
    def _apply(self, units: int) -> None:
        """Make the share exactly `units` (already feasible)."""

    def _ids_of(self, positions: range) -> list[int]:
        """Map positions 0..total-1 (low to high) to concrete unit ids; identity by default."""
        return list(positions)

    def _details(self) -> dict:
        return {}
