"""Checks that need no accelerator: interpreter and torch, /dev/shm, leftover segments, cores."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

from bullet.doctor.results import CheckResult, failed, passed
from bullet.partition import format_id_list

SHM = Path("/dev/shm")
MIN_PYTHON = (3, 10)


def check_versions() -> CheckResult:
    name = "python and torch"
    py = platform.python_version()
    if sys.version_info < MIN_PYTHON:
        return failed(name, f"Python {py} is older than {'.'.join(map(str, MIN_PYTHON))}")
    try:
        import torch
    except ImportError as e:
        return failed(name, f"Python {py}; torch does not import: {e}")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    return passed(name, f"Python {py}, torch {torch.__version__} ({build})",
                  python=sys.executable, torch=torch.__version__, torch_cuda=torch.version.cuda)


def check_shm(min_free_mb: int) -> CheckResult:
    name = "/dev/shm writable"
    if not SHM.is_dir():
        return failed(name, "/dev/shm does not exist: the state buffer and page allocator need POSIX shared memory")
    try:
        with tempfile.NamedTemporaryFile(dir=SHM, prefix="bullet-doctor-probe.") as f:
            f.write(b"\0" * 4096)
            f.flush()
    except OSError as e:
        return failed(name, f"cannot write to /dev/shm: {e}")
    st = os.statvfs(SHM)
    free_mb = st.f_bavail * st.f_frsize // 2**20
    total_mb = st.f_blocks * st.f_frsize // 2**20
    details = {"free_mb": free_mb, "size_mb": total_mb, "required_mb": min_free_mb}
    if free_mb < min_free_mb:
        return failed(name, f"only {free_mb} MiB free of {total_mb} MiB, need {min_free_mb} MiB", **details)
    return passed(name, f"{free_mb} MiB free of {total_mb} MiB", **details)


def check_stale_segments() -> CheckResult:
    """Lists segments of servers whose creator is gone. Listing only: removing them is the
    launcher's job (`bullet.shm.segments.cleanup_instance`), and a live server's segments must stay."""
    name = "leftover /dev/shm/bullet-* segments"
    try:
        from bullet.shm.segments import list_instances  # deferred: posix_ipc may be missing; fall back below
    except ImportError as e:  # posix_ipc missing: fall back to a plain listing
        names = sorted(p.name for p in SHM.glob("*bullet-*"))
        return passed(name, f"{len(names)} found (owner liveness unknown: {e})", segments=names)
    instances = list_instances()
    stale = [i for i in instances if i.creator_alive is False]
    unknown = [i for i in instances if i.creator_alive is None]
    details = {
        "stale": {i.instance_id: list(i.segments) for i in stale},
        "creator_unknown": {i.instance_id: list(i.segments) for i in unknown},
        "live_instances": [i.instance_id for i in instances if i.creator_alive],
    }
    if not instances:
        return passed(name, "none")
    summary = (f"{len(instances)} instance(s): {len(stale)} stale (creator gone), "
               f"{len(unknown)} of unknown owner — listed only, not removed")
    return passed(name, summary, **details)


def check_cores() -> CheckResult:
    name = "cores for two workers"
    allowed = sorted(os.sched_getaffinity(0))
    details = {"allowed": format_id_list(allowed), "online": os.cpu_count()}
    if len(allowed) < 2:
        return failed(name, f"{len(allowed)} core allowed: the cpu backend needs 2 to give each worker its own",
                      **details)
    return passed(name, f"{len(allowed)} allowed ({format_id_list(allowed)}) of {os.cpu_count()} online",
                  **details)
