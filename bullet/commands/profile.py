"""`bullet profile`: the profiler's own command (`estimator.profiler.command`) on the CPU; with
`--device cuda`, the GPU profiler (`estimator.profiler.cuda_measure`) restricted by the partition
backend the server will use — which lives here in the control plane, so this command builds it and
hands it to the estimator."""

from __future__ import annotations

import sys

from estimator.profiler.command import DESCRIPTION as CPU_DESCRIPTION
from estimator.profiler.command import HELP, NAME
from estimator.profiler.command import add_arguments as add_cpu_arguments
from estimator.profiler.command import run as run_cpu

DESCRIPTION = CPU_DESCRIPTION + (
    " With --device cuda: per-kernel sweeps over token counts and SM shares timed with CUDA events, SMs "
    "restricted by --partition-backend, each phase beside the other in a second process (needs MPS), "
    "calibrated with the same code. Run on an NVIDIA H200 with --partition-backend green-ctx (libsmctrl not yet on "
    "hardware): run `bullet doctor` first.")


def add_arguments(p) -> None:
    add_cpu_arguments(p)
    gpu = p.add_argument_group("GPU (measured on an H200 with green contexts)")
    gpu.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="where the server will run")
    gpu.add_argument("--partition-backend", default="green-ctx", choices=["libsmctrl", "green-ctx", "none"],
                     help="how SMs are restricted, as the server will restrict them")
    gpu.add_argument("--libsmctrl", metavar="PATH", default=None, help="libsmctrl.so (default: $BULLET_LIBSMCTRL)")
    gpu.add_argument("--allow-untested-driver", action="store_true",
                     help="libsmctrl on a driver newer than its known-working range (after `bullet doctor` passed)")
    gpu.add_argument("--no-corun", action="store_true", help="skip the contention measurements")


def share_factory(backend: str, libsmctrl: str | None = None, allow_untested_driver: bool = False):
    """A picklable factory of the profiler's share control for `backend`."""
    from bullet.partition.share_control import share_factory as make  # deferred: the CPU profile needs no CUDA pieces

    return make(backend, libsmctrl, allow_untested_driver)


def run(args) -> int:
    from engines.device import resolve_device  # deferred: `bullet --help` lists commands without torch

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"bullet profile: {exc}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        return run_cpu(args)
    from bullet.doctor.gpu_checks import check_mps  # deferred: GPU-only pieces
    from bullet.partition import PartitionUnavailable  # deferred: as above
    from bullet.partition.graph_policy import decide_for_worker  # deferred: as above
    from estimator.profiler.cache import (  # deferred: as above
        cuda_profile_path,
        estimator_dtype,
        gpu_identity,
        model_cache_name,
    )
    from estimator.profiler.cuda_measure import measure_cuda_profile  # deferred: as above

    def log(line: str) -> None:
        print(f"[bullet profile] {line}", file=sys.stderr, flush=True)

    backend = args.partition_backend
    graphs = decide_for_worker(backend, device)
    log(f"decode CUDA graphs: {graphs.mode} ({graphs.reason})")
    corun = not args.no_corun
    if corun and check_mps(None).status != "PASS":
        log("MPS is not running: two processes would time-slice, so contention is not measured "
            "(start `nvidia-cuda-mps-control -d` and profile again)")
        corun = False
    dtype = estimator_dtype(args.dtype)
    output = args.output or cuda_profile_path(model_cache_name(args.model_path, args.load_format), dtype,
                                              gpu_identity(), backend)
    try:
        profile = measure_cuda_profile(args.model_path, args.load_format, dtype,
                                       share_factory(backend, args.libsmctrl, args.allow_untested_driver), backend,
                                       args.quick, output, corun=corun, decode_graphs=graphs.enabled,
                                       kernel_graphs=graphs.enabled, log=log)
    except (PartitionUnavailable, RuntimeError, ValueError) as exc:
        print(f"bullet profile: {exc}", file=sys.stderr)
        return 1
    print(f"profile of {profile.model.name} ({profile.dtype}) on {profile.hardware.name}: {output}")
    for note in profile.notes:
        print(f"  {note}")
    return 0


__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run", "share_factory"]
