"""Runs every doctor check in order; a check that raises is reported as FAIL, never crashes the run."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

from bullet import __version__
from bullet.doctor import cpu_check, gpu_checks, host_checks, isolation_check, mask_checks, stream_checks
from bullet.doctor.results import CheckResult, failed
from bullet.partition.cuda_driver import cuda_driver_version, format_cuda_version
from bullet.partition.mps import detect_mps


@dataclass
class DoctorOptions:
    min_shm_mb: int = 512
    libsmctrl: str | None = None
    allow_untested_driver: bool = False
    isolation: bool = True  # the cross-process timing check (about 10 s per GPU backend)


def _guarded(name: str, fn, *args) -> CheckResult:
    try:
        return fn(*args)
    except Exception as e:  # a broken check is a finding, and must not hide the other checks
        return failed(name, f"check raised {type(e).__name__}: {e}")


def run_checks(opts: DoctorOptions) -> tuple[list[CheckResult], dict]:
    no_gpu = gpu_checks.gpu_unavailable_reason()
    plan = [
        ("python and torch", host_checks.check_versions),
        ("/dev/shm writable", host_checks.check_shm, opts.min_shm_mb),
        ("leftover /dev/shm/bullet-* segments", host_checks.check_stale_segments),
        ("cores for two workers", host_checks.check_cores),
        ("cpu backend restricts a worker", cpu_check.check_cpu_backend),
        ("CUDA device", gpu_checks.check_cuda, no_gpu),
        ("MPS daemon", gpu_checks.check_mps, no_gpu),
        ("driver within libsmctrl's range", gpu_checks.check_driver_for_libsmctrl, no_gpu),
        ("libsmctrl masks", mask_checks.check_libsmctrl_masks, no_gpu, opts.libsmctrl,
         opts.allow_untested_driver),
        ("green-context pools", mask_checks.check_green_ctx_pools, no_gpu),
        # after the mask checks: they record whether graph replays stay partitioned
        ("worker steps run on the partitioned stream", stream_checks.check_worker_stream, no_gpu, opts.libsmctrl,
         opts.allow_untested_driver),
        ("decode CUDA graphs", stream_checks.check_decode_graphs, no_gpu),
        ("profiler timing follows the partition", stream_checks.check_profiler_timing, no_gpu, opts.libsmctrl,
         opts.allow_untested_driver),
        ("CUDA IPC zero-copy", gpu_checks.check_cuda_ipc, no_gpu),
        # last: it starts processes of its own, and records which backend serves (--partition-backend auto)
        (isolation_check.NAME, isolation_check.check_cross_process_isolation,
         no_gpu or (None if opts.isolation else "--no-isolation"), opts.libsmctrl, opts.allow_untested_driver),
    ]
    results = [_guarded(name, fn, *args) for name, fn, *args in plan]
    context = {"bullet": __version__, "host": platform.node(), "gpu": no_gpu or "available",
               "gpu_checks_note": gpu_checks.NOT_RUN if no_gpu else "run on this machine",
               "measured_on": measured_on(no_gpu)}
    return results, context


def measured_on(no_gpu: str | None) -> dict:
    """What every number of this report holds for: GPU model, driver, MPS on/off and the date (each
    check's details name its backend)."""
    gpu = None
    if not no_gpu:
        import torch

        gpu = torch.cuda.get_device_name(0)
    driver = cuda_driver_version()
    return {"gpu": gpu, "driver": format_cuda_version(driver), "driver_version": driver, "mps": detect_mps().label,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
