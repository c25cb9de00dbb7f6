"""Cached estimator profiles of this CPU or GPU and the served model (Bullet §3.2.4): names, the
cache, whether a cached profile still fits, and measuring one when none does (`cached_or_measured`,
for both devices).

    path = ensure_profile(None, "auto", "bfloat16", cores=[0, 1])   # cached, or measured (~1 min)
    load_estimator(path).decode_time(16, 16 * 512, units=1, co_prefill_tokens=256)

On the CPU `estimator.profiler.measure.measure_profile` does the work; it pins every thread of its
process while it measures, so `ensure_profile` runs it in a child process (`python -m
estimator.profiler`, the same command as `bullet profile`) and leaves its caller's threads alone.
A GPU profile is measured in the caller's process (`cuda_measure.ensure_cuda_profile`)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from engines.device import cpu_identity, resolve_dtype
from engines.weights import DEFAULT_MODEL
from engines.weights.resolve import dummy_config, resolve_model_path
from estimator.profile import EstimatorProfile, Provenance
from estimator.profiler.timing import QUIET_BELOW, others_busy
from estimator.version import package_version

log = logging.getLogger(__name__)

BUSY_LOOK_S = 0.5  # how long `reusable` watches the machine before it trusts a profile measured while it was busy
ESTIMATOR_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}  # and back


# ---- names and cache ---------------------------------------------------------------------------

def cpu_model_name() -> str:
    """The CPU a profile is measured on, with any kernel-ISA caps in force (see `engines.device`)."""
    return cpu_identity()


def estimator_dtype(dtype) -> str:
    """"bf16" | "fp32" | "fp16" from a torch dtype or any name `engines.device` accepts ("auto" too)."""
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(None if dtype in (None, "auto") else str(dtype).removeprefix("torch."),
                              torch.device("cpu"))
    return ESTIMATOR_DTYPES[str(dtype).removeprefix("torch.")]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-") or "x"


def model_cache_name(model_path: str | None, load_format: str = "auto") -> str:
    """The model's name plus a digest of what identifies its weights (file path, size, mtime; or
    the config for dummy weights), so two different files of the same name never share a profile."""
    path, fmt = resolve_model_path(model_path, load_format)
    if fmt == "dummy":
        config = dummy_config(model_path)
        return f"{_slug(config.name)}-dummy-{hashlib.sha1(config.model_dump_json().encode()).hexdigest()[:8]}"
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    name = DEFAULT_MODEL if model_path in (None, "", "default", DEFAULT_MODEL) else path.name.removesuffix(".gguf")
    return f"{_slug(name)}-{hashlib.sha1(identity.encode()).hexdigest()[:8]}"


def cache_dir() -> Path:
    root = os.environ.get("BULLET_CACHE_DIR")
    return Path(root) / "profiles" if root else Path.home() / ".cache" / "bullet" / "profiles"


def default_profile_path(model_name: str, dtype: str, cores: int | Sequence[int], quantization: str = "none") -> Path:
    """Where the profile of `model_name` in `dtype` (its weights served as `quantization`) on this many
    cores of this CPU, measured by this version of bullet, is cached: under $BULLET_CACHE_DIR/profiles
    or ~/.cache/bullet/profiles."""
    count = cores if isinstance(cores, int) else len(list(cores))
    served = "" if quantization == "none" else f"-{_slug(quantization)}"
    name = (f"{_slug(model_name)}-{_slug(dtype)}{served}-{count}c-{_slug(cpu_model_name())}"
            f"-bullet{package_version()}.json")
    return cache_dir() / name


def gpu_identity(device: int = 0) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.multi_processor_count} SMs)"


def cuda_profile_path(model_name: str, dtype: str, gpu: str, backend: str) -> Path:
    """Where the GPU profile of `model_name` in `dtype` on `gpu` under the partition `backend`,
    measured by this version of bullet, is cached."""
    name = f"{_slug(model_name)}-{_slug(dtype)}-{_slug(gpu)}-{_slug(backend)}-bullet{package_version()}.json"
    return cache_dir() / name


def resolve_cores(cores: int | Sequence[int] | None) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    if cores is None:
        return allowed
    if isinstance(cores, int):
        if not 0 < cores <= len(allowed):
            raise ValueError(f"cannot profile on {cores} cores: {len(allowed)} allowed ({allowed})")
        return allowed[:cores]
    return sorted(set(cores))


def _provenance(path: Path) -> Provenance | None:
    try:
        return EstimatorProfile.read(path).provenance
    except (OSError, ValueError):
        return None


def _current(p: Provenance, quick: bool) -> bool:
    """Measured by this bullet version, with a plan that serves the request (a full profile also
    serves a quick request, not the other way round)."""
    return p.bullet_version == package_version() and (quick or p.plan == "full")


def reusable(path: Path, model: str, dtype: str, cores: Sequence[int], quick: bool, quantization: str = "none") -> bool:
    """A cached profile fits if it was measured for this model, dtype, quantization, core count, CPU
    and bullet version (a full profile also serves a quick request, not the other way round) — and,
    if other processes kept the machine busy while it was measured, only while they still do: on a
    quiet machine it is measured again, undisturbed."""
    p = _provenance(path)
    fits = (p is not None and p.model == model and p.dtype == dtype and p.quantization == quantization
            and len(p.cores) == len(cores) and p.cpu == cpu_model_name() and _current(p, quick))
    if fits and p.busy_measurements and others_busy(BUSY_LOOK_S) < QUIET_BELOW:
        log.info("the cached profile %s was measured while other processes kept the machine busy; it is "
                 "quiet now: measuring it again", path)
        return False
    return fits


def cuda_reusable(path: Path, model: str, dtype: str, gpu: str, backend: str, quick: bool) -> bool:
    """A cached GPU profile fits if it was measured for this model, dtype, GPU, partition backend
    and bullet version (a full profile serves a quick request, not the other way round)."""
    p = _provenance(path)
    return p is not None and p.model == model and p.dtype == dtype and p.cpu == f"{gpu} via {backend}" \
        and _current(p, quick)


def cached_or_measured(path: Path, fits: Callable[[Path], bool], measure: Callable[[], object],
                       announce: Callable[[], object] | None = None) -> Path:
    """`path`, once a profile that `fits` is there: the cached one, or the one `measure()` writes
    now, after `announce()` (a caller's word that the wait is a measurement). Two servers starting
    together measure once: the second waits on the lock, then finds the profile."""
    if path.exists() and fits(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path.exists() and fits(path)):
            if announce is not None:
                announce()
            measure()
    return path


def ensure_profile(model_path: str | None, load_format: str = "auto", dtype="auto",
                   cores: int | Sequence[int] | None = None, quick: bool = True, progress: bool = True,
                   output: str | Path | None = None, quantization: str = "none",
                   announce: Callable[[], object] | None = None) -> Path:
    """The path of a profile of this model on these cores, its weights served as `quantization` (none |
    w8a8_int8: a profile must time the kernels the server runs): the cached one when it still fits,
    else measured now in a child process (`python -m estimator.profiler`; about a minute with `quick`), with a
    progress bar (`progress`) or log lines only, on stderr; `announce()` is called before measuring."""
    core_ids = resolve_cores(cores)
    est_dtype = estimator_dtype(dtype)
    name = model_cache_name(model_path, load_format)
    path = Path(output) if output else default_profile_path(name, est_dtype, core_ids, quantization)
    return cached_or_measured(
        path, lambda p: reusable(p, name, est_dtype, core_ids, quick, quantization),
        lambda: _measure_in_child(model_path, load_format, est_dtype, core_ids, quick, progress, path, quantization),
        announce)


def _ignore_sigint() -> None:
    """Run in the profiling child between fork and exec. A Ctrl-C at a terminal reaches the whole process
    group, and the parent is the one to answer it (a server stops its start-up, a script gets
    KeyboardInterrupt) by killing this child, as subprocess.run does on any exception. An ignored SIGINT
    stays ignored across exec, and Python keeps it so: the child ignores Ctrl-C from its first
    instruction and prints nothing of its own (set from inside the child, a Ctrl-C before that line
    printed a traceback, or "Fatal Python error", beside the server's one line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _measure_in_child(model_path, load_format: str, dtype: str, core_ids: list[int], quick: bool, progress: bool,
                      path: Path, quantization: str = "none") -> Path:
    args = ["--load-format", load_format, "--dtype", dtype,
            "--quantization", quantization, "--cores", ",".join(map(str, core_ids)), "--output", str(path)]
    if model_path:
        args += ["--model-path", str(model_path)]
    if quick:
        args.append("--quick")
    if not progress:
        args.append("--no-progress")
    try:  # the child's output goes to our stderr: a server's stdout stays its own
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        out = None  # stderr replaced by an object without a file (captured): inherit instead
    command = [sys.executable, "-m", "estimator.profiler", *args]
    result = subprocess.run(command, stdout=out, stderr=out, preexec_fn=_ignore_sigint)
    if result.returncode != 0 or not path.exists():
        raise RuntimeError(f"bullet profile failed (exit code {result.returncode}): {' '.join(command)}")
    return path
