"""Whether decode may run as CUDA graphs under a partition backend — decided from what `bullet
doctor` measured on this GPU and driver, never assumed.

A graph replay launches kernels the stream did not see at capture time, and whether a partition
reaches them depends on the mechanism: MuxWise's authors report that libsmctrl masks did not change
the SMs of graph replays, while a green context's graph is documented to run in the partition of
the stream it was captured on. The doctor launches an %smid probe as a graph and records, per
backend, on which SMs the replays ran (`record_replay_verdict`). A worker reads that record and
picks one of three modes:

| mode        | when                                                               | graphs            |
|-------------|--------------------------------------------------------------------|-------------------|
| `shared`    | replays follow the partition in force at replay (or none is set)   | one per bucket    |
| `per-share` | replays keep the partition of their capture stream                 | per bucket, share |
| `eager`     | replays escape the partition, nothing measured for libsmctrl, a CPU | none              |

`BULLET_DECODE_GRAPHS=off` forces eager; `=on` uses graphs where nothing was measured (never
where the doctor saw replays escape). The record is keyed by GPU name and driver version: a driver
update invalidates it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bullet.partition.cuda_access import CudaAccess, cuda_access
from bullet.partition.cuda_driver import cuda_driver_version
from bullet.partition.gpu_helper import cache_dir
from bullet.partition.records import device_key, read_entries, write_entry
from engines.device import require_device

OVERRIDE_ENV = "BULLET_DECODE_GRAPHS"
RECORD_NAME = "graph-replay-verdicts.json"
EAGER, SHARED, PER_SHARE = "eager", "shared", "per-share"
# backends that leave a worker's stream unrestricted: a replay cannot escape a partition
_UNRESTRICTED = {"none", "cpu"}


@dataclass(frozen=True)
class ReplayVerdict:
    """What the doctor saw for one backend: kernels launched directly stayed inside the share;
    a graph replayed under the partition it was captured under stayed inside it; a graph replayed
    after the partition changed followed the new one (None: the backend cannot repartition a stream)."""

    direct: bool
    replay_same_partition: bool
    replay_after_repartition: bool | None = None
    detail: str = ""


@dataclass(frozen=True)
class GraphDecision:
    mode: str
    reason: str

    @property
    def enabled(self) -> bool:
        return self.mode != EAGER


def record_path() -> Path:
    return cache_dir() / RECORD_NAME


def record_replay_verdict(backend: str, device_name: str, driver: int | None, verdict: ReplayVerdict,
                          path: Path | None = None) -> Path:
    """Store the doctor's verdict for `backend` on this GPU and driver (other entries are kept)."""
    return write_entry(Path(path) if path is not None else record_path(), device_key(device_name, driver), backend,
                       asdict(verdict))


def read_replay_verdict(backend: str, device_name: str, driver: int | None,
                        path: Path | None = None) -> ReplayVerdict | None:
    """The doctor's verdict for `backend` on this GPU and driver, or None if it never measured it."""
    path = Path(path) if path is not None else record_path()
    entry = read_entries(path, device_key(device_name, driver)).get(backend)
    if entry is None:
        return None
    try:
        return ReplayVerdict(bool(entry["direct"]), bool(entry["replay_same_partition"]),
                             entry.get("replay_after_repartition"), str(entry.get("detail", "")))
    except KeyError:
        return None


def decide_decode_graphs(backend: str, device_type: str, verdict: ReplayVerdict | None,
                         override: str | None = None) -> GraphDecision:
    """How decode runs for a worker of `backend` on `device_type` given the doctor's `verdict`.
    `override`: "auto" (default), "on" or "off" (see the module doc)."""
    override = (override or "auto").lower()
    if override not in ("auto", "on", "off"):
        raise ValueError(f"{OVERRIDE_ENV} must be auto, on or off, got {override!r}")
    if device_type != "cuda":
        return GraphDecision(EAGER, "CUDA graphs need a CUDA device")
    if override == "off":
        return GraphDecision(EAGER, f"{OVERRIDE_ENV}=off")
    if backend in _UNRESTRICTED:
        return GraphDecision(SHARED, f"the {backend} backend restricts no stream: replays cannot escape a partition")
    if verdict is not None:
        if not verdict.direct:
            return GraphDecision(EAGER, f"bullet doctor: {backend} does not confine even direct launches")
        if verdict.replay_after_repartition:
            return GraphDecision(SHARED, f"bullet doctor: {backend} replays follow the partition in force")
        if verdict.replay_same_partition:
            return GraphDecision(PER_SHARE, f"bullet doctor: {backend} replays keep the partition they were "
                                            "captured under: one graph per share")
        return GraphDecision(EAGER, f"bullet doctor: {backend} partitions do not reach graph replays")
    if backend == "green-ctx":
        return GraphDecision(PER_SHARE, "green contexts: a graph runs in the partition of its capture stream "
                                        "(documented; not yet checked by bullet doctor on this GPU)")
    if override == "on":
        return GraphDecision(PER_SHARE, f"{OVERRIDE_ENV}=on without a doctor verdict for {backend}: "
                                        "one graph per share (the safer of the two graph modes)")
    return GraphDecision(EAGER, f"no bullet doctor verdict for {backend} on this GPU and driver: decode runs "
                                "eagerly (run `bullet doctor` to measure whether graph replays stay partitioned)")


def decide_for_worker(backend: str, device: torch.device, cuda: CudaAccess | None = None) -> GraphDecision:
    """`decide_decode_graphs` for a worker serving on `device`, with this machine's record and the
    environment override (`cuda` replaces torch.cuda: tests)."""
    device = require_device(device)
    verdict = None
    if device.type == "cuda" and backend not in _UNRESTRICTED:
        name, driver = current_device_identity(device, cuda)
        verdict = read_replay_verdict(backend, name, driver)
    return decide_decode_graphs(backend, device.type, verdict, os.environ.get(OVERRIDE_ENV))


def current_device_identity(device: torch.device | None = None,
                            cuda: CudaAccess | None = None) -> tuple[str, int | None]:
    """(GPU name, driver version) of `device` (default cuda:0): what a verdict is keyed by."""
    device = require_device(device) if device is not None else torch.device("cuda", 0)
    return cuda_access(cuda).device_name(device), cuda_driver_version()
