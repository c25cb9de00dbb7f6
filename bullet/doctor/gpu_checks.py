"""GPU checks that need no compiled probe: the device, MPS, the driver against libsmctrl's range,
and CUDA IPC through torch.multiprocessing. Written against official APIs (torch.cuda, the MPS
control daemon, cuDriverGetVersion); on a machine without a GPU each reports SKIP with the reason."""

from __future__ import annotations

import os
from pathlib import Path

from bullet.doctor.results import CheckResult, failed, passed, skipped
from bullet.partition.cuda_driver import cuda_driver_version, format_cuda_version
from bullet.partition.libsmctrl import KNOWN_WORKING_MAX_DRIVER
from bullet.partition.mps import detect_mps

ARTIFACT_MAX_DRIVER = 12060  # Bullet's artifact requires CUDA <= 12.6
NOT_RUN = "written against official APIs; not run on this machine"


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device is usable from torch, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import: {e}"
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    return f"no CUDA device (torch {build}, {format_cuda_version(cuda_driver_version())})"


def skip_gpu(name: str, reason: str) -> CheckResult:
    result = skipped(name, f"{reason}; not run here")
    result.needs_gpu = True
    return result


def check_cuda(no_gpu: str | None) -> CheckResult:
    name = "CUDA device"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    props = torch.cuda.get_device_properties(0)
    summary = (f"{props.name}: compute capability {props.major}.{props.minor}, "
               f"{props.multi_processor_count} SMs, driver {format_cuda_version(cuda_driver_version())}, "
               f"torch built for CUDA {torch.version.cuda}")
    return passed(name, summary, devices=torch.cuda.device_count(), sms=props.multi_processor_count,
                  visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))


def check_mps(no_gpu: str | None, proc_root: Path = Path("/proc"), env=None) -> CheckResult:
    """Two CUDA processes run kernels concurrently only under MPS; without it they time-slice and
    partitioning SMs between them buys nothing. Found by its control pipe or its full command line
    (`bullet.partition.mps`)."""
    name = "MPS daemon"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    status = detect_mps(proc_root, env)
    if not status.running:
        return failed(name, "MPS control daemon not running: the two workers would time-slice; "
                            "start it with `nvidia-cuda-mps-control -d`", **status.as_dict())
    return passed(name, f"running: {status.evidence()}", **status.as_dict())


def check_driver_for_libsmctrl(no_gpu: str | None) -> CheckResult:
    name = "driver within libsmctrl's range"
    version = cuda_driver_version()
    if version is None:
        return skip_gpu(name, no_gpu or "no CUDA driver")
    shown = format_cuda_version(version)
    known = format_cuda_version(KNOWN_WORKING_MAX_DRIVER)
    if version > KNOWN_WORKING_MAX_DRIVER:
        return failed(name, f"driver {shown} is newer than libsmctrl's known-working range (<= {known}): "
                            "use the green-ctx backend, or check masks with this doctor and opt in",
                      driver=version)
    note = "within Bullet's artifact range (<= 12.6)" if version <= ARTIFACT_MAX_DRIVER else \
        f"known to work upstream (<= {known}); Bullet's artifact used <= 12.6"
    return passed(name, f"driver {shown}: {note}", driver=version)


def ipc_child(inbox, outbox) -> None:
    """Spawned child: receive a CUDA tensor by IPC handle, write to it, report back."""
    import torch

    try:
        shared = inbox.get(timeout=120)
        shared.fill_(7.0)
        torch.cuda.synchronize()
        outbox.put(("ok", shared.device.index, shared.numel()))
    except Exception as e:  # report instead of dying silently: the parent prints it
        outbox.put(("error", repr(e), 0))


def check_cuda_ipc(no_gpu: str | None) -> CheckResult:
    """Weights and the KV pool reach the workers as CUDA IPC handles; a child's writes must land in
    the parent's memory (zero-copy), which a copied tensor would not show."""
    name = "CUDA IPC zero-copy"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # never fork after CUDA init
    inbox, outbox = ctx.Queue(), ctx.Queue()
    tensor = torch.zeros(1 << 20, device="cuda")  # 4 MiB: its own allocator segment
    child = ctx.Process(target=ipc_child, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        inbox.put(tensor)
        status, info, count = outbox.get(timeout=180)
    except Exception as e:
        return failed(name, f"child did not answer: {e!r}")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    if status != "ok":
        return failed(name, f"child failed: {info}")
    torch.cuda.synchronize()
    seen = int((tensor == 7.0).sum())
    if seen != tensor.numel():
        return failed(name, f"parent sees {seen} of {tensor.numel()} values the child wrote: not shared",
                      child_device=info)
    return passed(name, f"a spawned child's writes to a shared {tensor.numel() * 4 >> 20} MiB tensor "
                        "are visible in the parent", child_device=info, elements=count)
