"""`cpu` backend: a worker's share is a set of cores.

Applying a share does two things, both needed:
* `sched_setaffinity` on **every thread of the process** (`engines.host.pin_all_threads`: torch's
  OpenMP pool threads already exist when the first share is applied).
* `torch.set_num_threads(len(cores))`, so intra-op parallelism matches the share instead of
  oversubscribing it. OpenMP's thread count is per calling thread: call `apply` from the thread that
  runs the model (the worker loop does), not from a helper thread.

Units are indices into the cores the process was allowed when the backend was created (taskset or
cgroup cpuset), so `prefill` gets the lowest allowed cores and `decode` the highest, whatever their
ids. A worker split over tensor-parallel ranks (`--tp-size`) runs one process per rank: rank r of N
takes the r-th of N runs of its worker's share (ranks share a core only when the share has fewer
cores than ranks). Thread-binding variables (OMP_PROC_BIND, GOMP_CPU_AFFINITY, KMP_AFFINITY) make the OpenMP
runtime pin threads it creates later by itself; `bullet doctor` flags them."""

from __future__ import annotations

import os

from bullet.partition.base import Granularity, PartitionBackend, PartitionUnavailable, role_slice
from engines.host import pin_all_threads

THREAD_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


class CpuCoreBackend(PartitionBackend):
    name = "cpu"
    unit_kind = "core"

    def __init__(self, role: str, cores: list[int] | None = None, set_torch_threads: bool = True,
                 interop_threads: int | None = 1, rank: int = 0, ranks: int = 1):
        """`cores`: the OS cpu ids this worker may ever use (default: the process's affinity now).
        `interop_threads`: inter-op pool size to fix at start (workers do not use inter-op
        parallelism; torch only accepts this before the pool first runs — otherwise kept as is)."""
        allowed = sorted(set(cores)) if cores is not None else sorted(os.sched_getaffinity(0))
        if not allowed:
            raise PartitionUnavailable("cpu: no cores allowed for this process")
        super().__init__(role, len(allowed), Granularity(minimum=1, step=1))
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} of {ranks}: expected 0 <= rank < ranks")
        self._cores = allowed
        self._rank, self._ranks = rank, ranks
        self._torch = _import_torch() if set_torch_threads else None
        self._interop = self._settle_interop_threads(interop_threads)
        self._threads_pinned = 0
        self._pinned_cores: set[int] | None = None

    def _ids_of(self, positions: range) -> list[int]:
        return [self._cores[i] for i in positions]

    def _apply(self, units: int) -> None:
        cores = set(self._ids_of(rank_part(role_slice(self.total_units, units, self.role), self._rank, self._ranks)))
        if self._torch is not None and self._torch.get_num_threads() != len(cores):
            self._torch.set_num_threads(len(cores))
        if cores == self._pinned_cores:
            return  # every thread already holds this set, and threads created since inherited it
        self._threads_pinned = pin_all_threads(cores)
        self._pinned_cores = cores

    def _settle_interop_threads(self, wanted: int | None) -> str:
        if self._torch is None or wanted is None:
            return "unchanged"
        if self._torch.get_num_interop_threads() == wanted:
            return f"{wanted}"
        try:
            self._torch.set_num_interop_threads(wanted)
            return f"{wanted}"
        except RuntimeError:  # already started or already set once: torch refuses a second change
            return f"{self._torch.get_num_interop_threads()} (could not change: already in use)"

    def _details(self) -> dict:
        return {
            "allowed_cores": list(self._cores),
            "torch_threads": self._torch.get_num_threads() if self._torch is not None else None,
            "interop_threads": self._interop,
            "threads_pinned_last_apply": self._threads_pinned,
            "thread_binding_env": {k: os.environ[k] for k in THREAD_BINDING_ENV if k in os.environ},
        }


def rank_part(positions: range, rank: int, ranks: int) -> range:
    """Rank `rank`'s run of `positions` cut into `ranks` contiguous runs (sizes differ by at most one,
    the larger first); with fewer positions than ranks, the one position rank `rank` shares."""
    if ranks == 1 or not len(positions):
        return positions
    if len(positions) < ranks:
        i = rank % len(positions)
        return positions[i:i + 1]
    base, extra = divmod(len(positions), ranks)
    start = rank * base + min(rank, extra)
    return positions[start:start + base + (1 if rank < extra else 0)]


def _import_torch():
    try:
        import torch
    except ImportError:
        return None
    return torch
