"""Which partition backend a GPU server runs when `--partition-backend auto`: the first candidate,
in order of preference, that `bullet doctor`'s cross-process timing check found to keep the two
workers on disjoint SMs **on this GPU, driver and MPS state** — never assumed.

| order | backend          | why this place                                                        |
|-------|------------------|-----------------------------------------------------------------------|
| 1     | `green-ctx`      | official API, a per-step split (a pool of streams), graphs per share  |
| 2     | `libsmctrl`      | the paper's per-step TPC mask; needs a user-built library, and a driver past its known range needs `--allow-untested-driver` |
| 3     | `mps-percentage` | official, but fixed per worker at start: a static split in space      |

The verdicts are recorded by the doctor like graph replays' (`records`), keyed by GPU name, driver
and MPS on/off — a driver update or starting MPS invalidates them. When none holds, the server still
runs on green contexts (each worker's kernels stay in its share inside its process; the two processes
may share SMs) and says so; a one-process mode (prefill and decode as two streams of one process on
green contexts) would be the way there, and is not built."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bullet.partition.cuda_access import CudaAccess
from bullet.partition.gpu_helper import cache_dir
from bullet.partition.graph_policy import current_device_identity
from bullet.partition.libsmctrl import KNOWN_WORKING_MAX_DRIVER, LIBRARY_ENV, untested_driver_allowed
from bullet.partition.mps import detect_mps
from bullet.partition.records import device_key, read_entries, write_entry
from engines.device import require_device

RECORD_NAME = "partition-verdicts.json"
CANDIDATES = ("green-ctx", "libsmctrl", "mps-percentage")  # order of preference
ISOLATED = "disjoint"  # the timing check's outcome that proves a backend (doctor.isolation.DISJOINT)


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    reason: str
    proven: bool  # the doctor measured this backend isolating the two processes here


def record_path() -> Path:
    return cache_dir() / RECORD_NAME


def mps_label(mps_on: bool) -> str:
    return "on" if mps_on else "off"


def record_isolation_verdict(backend: str, device_name: str, driver: int | None, mps_on: bool, outcome: str,
                             summary: str, path: Path | None = None, **measured) -> Path:
    """Store the timing check's outcome for `backend` on this GPU, driver and MPS state."""
    return write_entry(Path(path) if path is not None else record_path(),
                       device_key(device_name, driver, mps_label(mps_on)), backend,
                       {"outcome": outcome, "summary": summary, **measured})


def read_isolation_verdicts(device_name: str, driver: int | None, mps_on: bool,
                            path: Path | None = None) -> dict[str, dict]:
    """backend -> recorded verdict for this GPU, driver and MPS state."""
    return read_entries(Path(path) if path is not None else record_path(),
                        device_key(device_name, driver, mps_label(mps_on)))


def choose_backend(device_type: str, verdicts: dict[str, dict], mps_on: bool, driver: int | None,
                   libsmctrl_library: str | None = None, allow_untested_driver: bool = False) -> BackendChoice:
    """The backend for `--partition-backend auto` (see the module doc)."""
    if device_type != "cuda":
        return BackendChoice("cpu", "a CPU: cores are pinned per worker", True)
    mps = f"MPS {mps_label(mps_on)}"
    skipped = []
    for backend in CANDIDATES:
        verdict = verdicts.get(backend)
        if not verdict or verdict.get("outcome") != ISOLATED:
            continue
        if backend == "libsmctrl":
            if not libsmctrl_library:
                skipped.append("libsmctrl isolated the processes, but no library is given (BULLET_LIBSMCTRL)")
                continue
            if driver is not None and driver > KNOWN_WORKING_MAX_DRIVER and not allow_untested_driver:
                skipped.append("libsmctrl isolated the processes, but this driver is past its known range: "
                               "opt in with --allow-untested-driver")
                continue
        when = verdict.get("measured_at", "?")
        return BackendChoice(backend, f"bullet doctor ({when}) measured {backend} keeping the two workers on "
                                      f"disjoint SMs on this GPU and driver with {mps}"
                                      + (f" ({'; '.join(skipped)})" if skipped else ""), True)
    if not mps_on:
        why = "MPS is off: the two worker processes time-slice the GPU whatever the backend"
    elif not verdicts:
        why = f"no bullet doctor isolation verdict for this GPU and driver with {mps} (run `bullet doctor`)"
    else:
        outcomes = ", ".join(f"{b}: {v.get('outcome')}" for b, v in sorted(verdicts.items()))
        why = f"no backend kept the two workers on disjoint SMs with {mps} ({outcomes})"
    if skipped:
        why += "; " + "; ".join(skipped)
    return BackendChoice("green-ctx", f"{why}; green-ctx keeps each worker's kernels inside its share within its "
                                      "process, but the split is not enforced between the processes", False)


def choose_for_device(device: torch.device, cuda: CudaAccess | None = None) -> BackendChoice:
    """`choose_backend` for this machine: its GPU, driver, MPS state, the recorded verdicts and the
    libsmctrl environment (`BULLET_LIBSMCTRL`, `BULLET_LIBSMCTRL_ALLOW_UNTESTED=1`). `device`: the
    serving device (`engines.device.resolve_device`); `cuda` replaces torch.cuda (tests)."""
    device = require_device(device)
    if device.type != "cuda":
        return choose_backend(device.type, {}, False, None)
    name, driver = current_device_identity(device, cuda)
    mps_on = detect_mps().running
    return choose_backend("cuda", read_isolation_verdicts(name, driver, mps_on), mps_on, driver,
                          os.environ.get(LIBRARY_ENV), untested_driver_allowed())
