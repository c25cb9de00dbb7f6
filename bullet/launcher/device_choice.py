"""The device a server runs on, decided once — before any weight is loaded — from `--device`, and
checked against `--partition-backend`: the launcher hands the result (a `torch.device` with an
index) to every worker, and nothing downstream parses a device name again.

Why a `torch.device` rather than a type of our own: it crosses the spawn boundary as itself
(it pickles to its type and index), every torch call takes it as it is, and the data plane
(`engines/`), which may not import the control plane, already speaks it. What made the first GPU
run crash — a bare string, and `torch.device("cuda")` whose index is None — is ruled out by
`engines.device.resolve_device` (always an index on CUDA) and `require_device`, which every
consumer calls on what it is handed."""

from __future__ import annotations

import torch

from bullet.config import ServerArgs
from bullet.partition.cuda_access import CudaAccess, cuda_access
from engines.device import resolve_device

GPU_BACKENDS = ("libsmctrl", "green-ctx", "mps-percentage")  # restrict the SMs of an NVIDIA GPU
CPU_BACKENDS = ("cpu",)  # pins CPU cores; `none` and `auto` fit either device


def check_backend_fits(backend: str, device_type: str, device_flag: str) -> None:
    """A ValueError naming both flags when `--partition-backend` cannot divide the device."""
    if device_type == "cuda" and backend in CPU_BACKENDS:
        raise ValueError(f"--partition-backend {backend} pins CPU cores and cannot divide a GPU (--device "
                         f"{device_flag}): pass --partition-backend auto (or green-ctx, libsmctrl, "
                         "mps-percentage, none)")
    if device_type == "cpu" and backend in GPU_BACKENDS:
        raise ValueError(f"--partition-backend {backend} restricts the SMs of an NVIDIA GPU, but the server runs "
                         f"on the CPU (--device {device_flag}): pass --partition-backend auto (or cpu, none), or "
                         "--device cuda")


def serving_device(args: ServerArgs, cuda: CudaAccess | None = None) -> torch.device:
    """The server's device (`cuda` replaces torch.cuda's view of the machine: tests). Raises a
    one-line ValueError naming the flag to change when the device is missing or the partition
    backend cannot work on it — a mismatch of the two flags first, since no GPU fixes that."""
    if args.device != "auto":
        check_backend_fits(args.partition_backend, args.device.partition(":")[0], args.device)
    device = resolve_device(args.device, cuda_access(cuda).device_count())
    check_backend_fits(args.partition_backend, device.type, args.device)
    return device
