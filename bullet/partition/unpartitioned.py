"""`none` backend: no partition — the "naive concurrent" baseline (Bullet Fig. 23 "Naive").

Both workers keep every unit; `apply` records the request (and its near-zero cost) so the runtime's
reports have the same shape as with a real backend, and changes nothing. `current_units` and
`unit_set()` therefore always describe the whole device: that is what the worker really has."""

from __future__ import annotations

import os

from bullet.partition.base import Granularity, PartitionBackend


class NoPartitionBackend(PartitionBackend):
    name = "none"

    def __init__(self, role: str, total_units: int | None = None, unit_kind: str = "core"):
        """`total_units`: size of the device being shared (default: the cores this process may
        use), so policies reading `total_units` see the same number as with a real backend."""
        self.unit_kind = unit_kind
        total = total_units if total_units is not None else len(os.sched_getaffinity(0))
        super().__init__(role, total, Granularity(minimum=1, step=1))
        self.requested_units: int | None = None

    def apply(self, units: int) -> None:
        super().apply(units)
        self.requested_units = self.round_units(units)
        self._current = self.total_units  # nothing was restricted

    def _apply(self, units: int) -> None:
        pass

    def _details(self) -> dict:
        return {"requested_units": self.requested_units, "mechanism": "none (naive concurrent)"}
