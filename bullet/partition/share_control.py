"""The GPU profiler's way of running on a share of the SMs: the serving workers' own partition
backend, one per role, each with the stream its kernels launch on (`launch_stream`). It implements
`estimator.profiler.shares.ShareControl`; the estimator receives it from `bullet profile`
because it may not import the control plane.

It is picklable as `functools.partial(PartitionShares, backend, **options)`, which is how the
profiler's co-running process builds its own."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from bullet.partition.base import ROLES
from bullet.partition.cuda_access import CudaAccess
from bullet.partition.launch_stream import open_worker_partition


class PartitionShares:
    def __init__(self, backend: str, device_index: int = 0, cuda: CudaAccess | None = None, **options):
        """`backend`: libsmctrl, green-ctx or none, on CUDA device `device_index`; `options`: the
        backend's (e.g. `library=`). `cuda` replaces torch.cuda (tests)."""
        device = torch.device("cuda", device_index)
        self.name = backend
        self._roles = {}
        try:
            for role in ROLES:
                self._roles[role] = open_worker_partition(backend, role, device, dict(options), cuda)
        except BaseException:
            self.close()
            raise
        self.total_units = self._roles["prefill"][0].total_units

    def feasible(self, role: str) -> list[int]:
        backend = self._roles[role][0]
        if backend.name == "none":  # restricts nothing: only the whole device is a real share
            return [backend.total_units]
        return backend.feasible_units()

    @contextmanager
    def use(self, role: str, units: int) -> Iterator[None]:
        """Kernels launched inside run on `role`'s share of `units` SMs (and have finished when the
        block ends)."""
        backend, stream = self._roles[role]
        backend.apply(units)
        with stream.step():
            yield

    def stream_of(self, role: str):
        return self._roles[role][1]

    def close(self) -> None:
        for backend, _ in self._roles.values():
            backend.close()
        self._roles.clear()


def share_factory(backend: str, libsmctrl: str | None = None, allow_untested_driver: bool = False):
    """A picklable factory of the profiler's share control for `backend` (the co-running process
    builds its own from it)."""
    options = {}
    if backend == "libsmctrl":
        options = {"library": libsmctrl, "allow_untested_driver": allow_untested_driver}
    return functools.partial(PartitionShares, backend, **options)
