"""Measuring a profile in this process: probe the CPU, sweep the model's kernels and time
end-to-end steps at every core count, time each phase beside the other, calibrate, save. It pins
every thread of its process while it measures (`ensure_profile` runs it in a child process)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from engines.weights import load_weights
from estimator.calibration import shares_units
from estimator.profile import EstimatorProfile, Provenance
from estimator.profiler.cache import TORCH_DTYPES, cpu_model_name, estimator_dtype, model_cache_name, resolve_cores
from estimator.profiler.fit import build_estimator
from estimator.profiler.plan import ProfilePlan
from estimator.profiler.sweep import run_plan
from estimator.version import package_version


def measure_profile(model_path: str | None, load_format: str, dtype, cores: Sequence[int] | int | None,
                    quick: bool, output: str | Path, progress: bool = True,
                    log: Callable[[str], None] | None = None, plan=None, quantization: str = "none") -> EstimatorProfile:
    """Measure, calibrate and write the profile to `output`; returns it. `plan` replaces the
    quick/full `ProfilePlan` (tests use a smaller one). `quantization` times the weights as the server
    serves them (`w8a8_int8`: the int8 model, which computes in fp32 — so `dtype` must be fp32)."""
    began = time.monotonic()
    core_ids = resolve_cores(cores)
    est_dtype = estimator_dtype(dtype)
    torch_dtype = TORCH_DTYPES[est_dtype]
    plan = plan or ProfilePlan.named(quick)
    weights = load_weights(model_path, load_format, torch_dtype, quantization=quantization)
    if weights.dtype != torch_dtype:
        raise ValueError(f"{weights.quantization} weights compute in {weights.dtype}, not {torch_dtype}: "
                         "profile them with --dtype float32 (as the server runs them)")
    hardware, samples, warnings, busy = run_plan(weights.config, weights.state, torch_dtype, core_ids, plan,
                                                 progress, log)
    estimator = build_estimator(weights.config, hardware, est_dtype, samples)
    provenance = Provenance(
        model=model_cache_name(model_path, load_format), model_source=str(weights.source) if weights.source else None,
        load_format=weights.load_format, dtype=est_dtype, quantization=weights.quantization, cores=core_ids, cpu=cpu_model_name(),
        bullet_version=package_version(), torch_version=torch.__version__, plan=plan.name,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), duration_s=round(time.monotonic() - began, 1),
        busy_measurements=busy)
    served = "" if weights.quantization == "none" else f" ({weights.quantization} weights)"
    notes = [f"bullet profile ({plan.name}) of {weights.config.name} in {est_dtype}{served} on cores {core_ids} "
             f"of {cpu_model_name()}: kernel sweeps and end-to-end steps at every core count, "
             "each phase beside the other on the complementary cores",
             "co-running on 2 cores can only be 1 + 1 cores: contention is measured at that split"
             if len(core_ids) == 2 else f"co-running measured with decode on {sorted({s.units for s in estimator.contention.samples if s.kind == 'decode' and not shares_units(s, len(core_ids))})} cores"]
    shared = estimator.contention.shared_units_slowdown()
    if shared is not None:
        notes.append(f"each phase on every core beside the other on every core too took {shared:.2f}x its time alone "
                     "(geometric mean of " + estimator.contention.shared_units_text()
                     + "): what the simulator charges a step on cores both workers hold")
    profile = EstimatorProfile.from_estimator(estimator, notes + warnings, provenance)
    profile.write(output)
    return profile
