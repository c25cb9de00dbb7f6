"""The partition backend of a simulated GPU: the real `PartitionBackend` contract (feasible counts
from the hardware's granularity, per role — the remainder of a device that does not divide into
groups joins prefill's shares, as the green-context pool builds them — requests rounded *up*,
prefill from the low unit ids and decode from the high ones, so shares that sum above the total
overlap in the middle) with nothing to configure — the simulated device reads `current_units` when
it charges a step."""

from __future__ import annotations

from bullet.partition.base import PEER, Granularity, PartitionBackend
from estimator.hardware import HardwareSpec


class SimulatedPartition(PartitionBackend):
    name = "simulated"

    def __init__(self, role: str, hardware: HardwareSpec):
        self.unit_kind = hardware.unit_name
        self._sizes = hardware.partition_sizes(role)
        self._peer_sizes = hardware.partition_sizes(PEER[role])
        super().__init__(role, hardware.units, Granularity(self._sizes[0], hardware.partition_step))

    def feasible_units(self) -> list[int]:
        return list(self._sizes)

    def peer_feasible_units(self) -> list[int]:
        return list(self._peer_sizes)

    def _apply(self, units: int) -> None:
        """Nothing to program: the simulated device reads the share when it charges a step."""

    def unit_mask(self) -> int:
        """Bit mask of `unit_set()` (what a worker publishes), built without materialising the set."""
        share = (1 << self.current_units) - 1
        return share if self.role == "prefill" else share << (self.total_units - self.current_units)


def overlap(prefill_units: int, decode_units: int, total: int) -> int:
    """Units both workers hold: prefill takes ids from the low end, decode from the high end."""
    return max(0, prefill_units + decode_units - total)
