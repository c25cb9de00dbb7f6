"""`bullet profile`: measure this CPU and the served model so the estimator predicts real prefill
and decode latencies here, alone and beside each other (Bullet §3.2.4).

    path = ensure_profile(None, "auto", "bfloat16", cores=[0, 1])   # cached, or measured (~1 min)
    Estimator.load(path).decode_time((16, 16 * 512), units=1, co_prefill_tokens=256)

`measure_profile` does the work in the calling process: probe the CPU (compute and bandwidth per
core count), sweep the model's kernels and time end-to-end steps at every core count, time each
phase beside the other running on the complementary cores, calibrate, save. It pins every thread
of its process while it measures, so `ensure_profile` runs it in a child process (`bullet profile`)
and leaves its caller's threads alone."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from estimator.profile import EstimatorProfile, Provenance

ESTIMATOR_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ---- names and cache ---------------------------------------------------------------------------

def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown-cpu"


def estimator_dtype(dtype) -> str:
    """"bf16" | "fp32" | "fp16" from a torch dtype or any name `engines.device` accepts ("auto" too)."""
    import torch

    from engines.device import resolve_dtype

    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(None if dtype in (None, "auto") else str(dtype).removeprefix("torch."),
                              torch.device("cpu"))
    return ESTIMATOR_DTYPES[str(dtype).removeprefix("torch.")]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-") or "x"


def model_cache_name(model_path: str | None, load_format: str = "auto") -> str:
    """The model's name plus a digest of what identifies its weights (file path, size, mtime; or
    the config for dummy weights), so two different files of the same name never share a profile."""
    from engines.weights import DEFAULT_MODEL
    from engines.weights.resolve import dummy_config, resolve_model_path

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


def default_profile_path(model_name: str, dtype: str, cores: int | Sequence[int]) -> Path:
    """Where the profile of `model_name` in `dtype` on this many cores of this CPU, measured by
    this version of bullet, is cached: under $BULLET_CACHE_DIR/profiles or ~/.cache/bullet/profiles."""
    from bullet import __version__

    count = cores if isinstance(cores, int) else len(list(cores))
    name = f"{_slug(model_name)}-{_slug(dtype)}-{count}c-{_slug(cpu_model_name())}-bullet{__version__}.json"
    return cache_dir() / name


def _resolve_cores(cores: int | Sequence[int] | None) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    if cores is None:
        return allowed
    if isinstance(cores, int):
        if not 0 < cores <= len(allowed):
            raise ValueError(f"cannot profile on {cores} cores: {len(allowed)} allowed ({allowed})")
        return allowed[:cores]
    return sorted(set(cores))


def reusable(path: Path, model: str, dtype: str, cores: Sequence[int], quick: bool) -> bool:
    """A cached profile fits if it was measured for this model, dtype, core count, CPU and bullet
    version (a full profile also serves a quick request, not the other way round)."""
    from bullet import __version__

    try:
        profile = EstimatorProfile.read(path)
    except (OSError, ValueError):
        return False
    p = profile.provenance
    return (p is not None and p.model == model and p.dtype == dtype and len(p.cores) == len(cores)
            and p.cpu == cpu_model_name() and p.bullet_version == __version__ and (quick or p.plan == "full"))


def ensure_profile(model_path: str | None, load_format: str = "auto", dtype="auto",
                   cores: int | Sequence[int] | None = None, quick: bool = True, progress: bool = True,
                   output: str | Path | None = None) -> Path:
    """The path of a profile of this model on these cores: the cached one when it still fits,
    else measured now in a child process (`bullet profile`; about a minute with `quick`), with a
    progress bar (`progress`) or log lines only, on stderr."""
    core_ids = _resolve_cores(cores)
    est_dtype = estimator_dtype(dtype)
    name = model_cache_name(model_path, load_format)
    path = Path(output) if output else default_profile_path(name, est_dtype, core_ids)
    if path.exists() and reusable(path, name, est_dtype, core_ids, quick):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        # Two servers starting together measure once: the second waits, then finds the profile.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and reusable(path, name, est_dtype, core_ids, quick):
            return path
        return _measure_in_child(model_path, load_format, est_dtype, core_ids, quick, progress, path)


def _measure_in_child(model_path, load_format: str, dtype: str, core_ids: list[int], quick: bool, progress: bool,
                      path: Path) -> Path:
    command = [sys.executable, "-m", "bullet.cli", "profile", "--load-format", load_format, "--dtype", dtype,
               "--cores", ",".join(map(str, core_ids)), "--output", str(path)]
    if model_path:
        command += ["--model-path", str(model_path)]
    if quick:
        command.append("--quick")
    if not progress:
        command.append("--no-progress")
    try:  # the child's output goes to our stderr: a server's stdout stays its own
        out = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        out = None  # stderr replaced by an object without a file (captured): inherit instead
    result = subprocess.run(command, stdout=out, stderr=out)
    if result.returncode != 0 or not path.exists():
        raise RuntimeError(f"bullet profile failed (exit code {result.returncode}): {' '.join(command)}")
    return path


# ---- measuring ---------------------------------------------------------------------------------

def measure_profile(model_path: str | None, load_format: str, dtype, cores: Sequence[int] | int | None,
                    quick: bool, output: str | Path, progress: bool = True,
                    log: Callable[[str], None] | None = None, plan=None) -> EstimatorProfile:
    """Measure, calibrate and write the profile to `output`; returns it. `plan` replaces the
    quick/full `ProfilePlan` (tests use a smaller one)."""
    import torch

    from bullet import __version__
    from engines.weights import load_weights
    from estimator.local_fit import build_estimator
    from estimator.local_plan import ProfilePlan
    from estimator.local_sweep import run_plan

    began = time.monotonic()
    core_ids = _resolve_cores(cores)
    est_dtype = estimator_dtype(dtype)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[est_dtype]
    plan = plan or ProfilePlan.named(quick)
    weights = load_weights(model_path, load_format, torch_dtype)
    hardware, samples, warnings = run_plan(weights.config, weights.state, torch_dtype, core_ids, plan, progress, log)
    estimator = build_estimator(weights.config, hardware, est_dtype, samples)
    provenance = Provenance(
        model=model_cache_name(model_path, load_format), model_source=str(weights.source) if weights.source else None,
        load_format=weights.load_format, dtype=est_dtype, cores=core_ids, cpu=cpu_model_name(),
        bullet_version=__version__, torch_version=torch.__version__, plan=plan.name,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), duration_s=round(time.monotonic() - began, 1))
    notes = [f"bullet profile ({plan.name}) of {weights.config.name} in {est_dtype} on cores {core_ids} "
             f"of {cpu_model_name()}: kernel sweeps and end-to-end steps at every core count, "
             "each phase beside the other on the complementary cores",
             "co-running on 2 cores can only be 1 + 1 cores: contention is measured at that split"
             if len(core_ids) == 2 else f"co-running measured with decode on {sorted({s.units for s in estimator.contention.samples if s.kind == 'decode'})} cores"]
    profile = EstimatorProfile.from_estimator(estimator, notes + warnings, provenance)
    profile.write(output)
    return profile
