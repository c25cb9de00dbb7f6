"""`mps-percentage` backend: MPS's own per-client SM limit, a coarse cross-process fallback.

Under MPS a client process whose environment holds `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=P` when CUDA
initialises runs its kernels on at most P % of the device's SMs (it can only lower a limit the
control daemon set with `set_default_active_thread_percentage` / `set_active_thread_percentage`).
What this can and cannot do, from NVIDIA's documentation:

* the limit is **fixed per context at creation**: a running process cannot change it, and the
  control daemon's `set_active_thread_percentage <server pid> P` reaches only clients created
  after it. So a worker's share is fixed for its life: `apply` records the policy's request (the
  reports show what it wanted) and grants nothing else — `current_units` stays the cap;
* a limit **caps, it does not reserve**: two clients at 50 % each are not promised disjoint SMs.
  Whether they are on this GPU and driver is what the doctor's cross-process timing check measures;
* what stays dynamic with this backend is everything but the split: request ordering, preemption,
  decode pausing for a prefill burst and resuming (the policy's time sharing);
* a real dynamic split under MPS would need several contexts per worker, each created with its own
  SM count (`cuCtxCreate_v3` with a `CU_EXEC_AFFINITY_TYPE_SM_COUNT` affinity — NVIDIA's suggested
  way to vary a process's limit), switched between steps like the green-context pool; not built:
  whether torch's tensors (one context's allocations) are usable from the other contexts is unproven.

The launcher sets the variable in each worker's environment before the worker starts
(`worker_environment`): a worker initialises CUDA while it unpickles its IPC tensors, before any of
its own code runs. Without MPS the variable does nothing; the backend then restricts nothing."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator, Mapping

from bullet.partition.base import Granularity, PartitionBackend, PartitionUnavailable
from bullet.partition.mps import THREAD_PERCENTAGE_ENV


def percentage_for(units: int, total_units: int) -> int:
    """The thread percentage that covers `units` of `total_units` SMs (rounded up, 1..100)."""
    if total_units < 1 or units < 1:
        raise ValueError(f"need units and total_units >= 1, got {units} of {total_units}")
    return max(1, min(100, math.ceil(100 * units / total_units)))


def units_for(percentage: float, total_units: int) -> int:
    """SMs a client capped at `percentage` may use (MPS rounds the limit to whole SMs; up, here)."""
    return max(1, min(total_units, math.ceil(total_units * percentage / 100)))


def worker_environment(backend: str, units: int, total_units: int) -> dict[str, str]:
    """Variables a worker of `backend` must start with, given its share: the MPS cap for
    mps-percentage, nothing for the other backends."""
    if backend != "mps-percentage":
        return {}
    return {THREAD_PERCENTAGE_ENV: str(percentage_for(units, total_units))}


def fixed_split(prefill_units: int, decode_units: int, total_units: int) -> tuple[int, int]:
    """The caps two workers start with: their initial shares where those fit the device together (a
    static split), else half each — a policy that starts both on every unit (bullet) would otherwise
    cap neither, and its later splits cannot reach a running worker."""
    if prefill_units + decode_units <= total_units:
        return prefill_units, decode_units
    return max(1, total_units // 2), max(1, total_units - total_units // 2)


@contextmanager
def environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with `overrides` for the block: a worker started inside (spawned,
    it copies the environment at start) inherits them; restored afterwards."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MpsPercentageBackend(PartitionBackend):
    name = "mps-percentage"
    unit_kind = "SM"

    def __init__(self, role: str, total_units: int | None = None, device: int = 0,
                 env: Mapping[str, str] | None = None):
        """`total_units`: the device's SM count (default: asked from torch). The cap is read from
        `env` (default: this process's environment), where the launcher put it."""
        env = os.environ if env is None else env
        raw = env.get(THREAD_PERCENTAGE_ENV)
        if raw is None:
            raise PartitionUnavailable(
                f"mps-percentage: {THREAD_PERCENTAGE_ENV} is not set in this process's environment; it must be "
                "set before CUDA initialises (bullet launch sets it for each worker)")
        try:
            percentage = float(raw)
        except ValueError:
            raise PartitionUnavailable(f"mps-percentage: {THREAD_PERCENTAGE_ENV}={raw!r} is not a number") from None
        if not 0 < percentage <= 100:
            raise PartitionUnavailable(f"mps-percentage: {THREAD_PERCENTAGE_ENV}={raw} is outside (0, 100]")
        if total_units is None:
            total_units = _sm_count(device)
        super().__init__(role, total_units, Granularity(minimum=1, step=1))
        self.percentage = percentage
        self.cap = units_for(percentage, total_units)
        self._current = self.cap
        self.requested_units: int | None = None

    def apply(self, units: int) -> None:
        super().apply(units)
        self.requested_units = self.round_units(units)
        self._current = self.cap  # fixed at CUDA initialisation: the request changes nothing

    def _apply(self, units: int) -> None:
        pass

    def unit_set(self) -> frozenset[int]:
        # which SMs MPS picks is not observable (and need not be contiguous): positions, for reports
        return frozenset(range(self.cap)) if self.role == "prefill" else \
            frozenset(range(self.total_units - self.cap, self.total_units))

    def _details(self) -> dict:
        return {"percentage": self.percentage, "cap_units": self.cap, "requested_units": self.requested_units,
                "mechanism": f"{THREAD_PERCENTAGE_ENV}, fixed at CUDA initialisation (caps, does not reserve)"}


def _sm_count(device: int) -> int:
    import torch

    if not torch.cuda.is_available():
        raise PartitionUnavailable("mps-percentage: no CUDA device")
    return torch.cuda.get_device_properties(device).multi_processor_count
