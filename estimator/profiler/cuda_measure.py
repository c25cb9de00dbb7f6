"""Measuring a GPU profile: the model on the GPU, per-share GEMM and copy rates (`cuda_probe`), the
plan's kernel sweeps and steps on each profiled share, each phase beside the other in a second
process (`corun.CoRunner`), the same Eq. 2 calibration as the CPU profile (`fit.build_estimator`),
written where `bullet launch --policy bullet` looks for it (`cache.cuda_profile_path`).

The partition mechanism arrives as `share_factory` (see `shares`); `decode_graphs` says whether
decode steps are timed as the CUDA-graph replays a worker would run (only where `bullet doctor` found
the backend's partitions reach replays — the caller decides), `kernel_graphs` likewise for the
kernel sweeps. Profiles are cached per model, dtype, GPU, partition backend and bullet version."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch

from engines.cuda_graphs import DecodeGraphs, TorchCudaGraphs, graph_blocker
from engines.weights import load_weights
from estimator.profile import EstimatorProfile, Provenance
from estimator.profiler.cache import (TORCH_DTYPES, cached_or_measured, cuda_profile_path, cuda_reusable,
                                     estimator_dtype, gpu_identity, model_cache_name)
from estimator.profiler.corun import CoRunner
from estimator.profiler.cuda_probe import COPY_BYTES, GEMM_N, gpu_hardware, probe_rates
from estimator.profiler.cuda_sweep import run_cuda_plan
from estimator.profiler.cuda_timing import CudaEventTimer
from estimator.profiler.fit import build_estimator
from estimator.profiler.plan import gpu_plan
from estimator.profiler.shares import ShareFactory, profiled_shares
from estimator.profiler.workload import PAGE_SIZE, DecodeCase, ModelBench, kv_tokens_needed
from estimator.version import package_version

def _decode_steps_as_graphs(bench: ModelBench, max_batch: int):
    """`step_for(case)` timing decode steps as graph replays. Graphs are dropped at every new
    measurement, so each is captured on the share it is timed on (right for both graph modes)."""
    scratch = (bench.num_pages - 1) * PAGE_SIZE  # the bench's spare last page (see kv_tokens below)
    graphs = DecodeGraphs(bench.runner, scratch, TorchCudaGraphs(), max_batch=max_batch)

    def step_for(case):
        if not isinstance(case, DecodeCase):
            return bench.step(case)
        graphs.release()
        chunks = bench.chunks(case)
        return lambda: graphs.forward(chunks)

    return step_for


def _probe(shares, units: list[int], timer: CudaEventTimer, dtype: torch.dtype):
    """GEMM FLOP/s and copy bytes/s on each share (the tensors are freed on return)."""
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=dtype)
    src = torch.empty(COPY_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return probe_rates(units, lambda u: shares.use("prefill", u), timer.kernels, lambda: a @ a, 2.0 * GEMM_N**3,
                       lambda: dst.copy_(src), 2.0 * COPY_BYTES)


def measure_cuda_profile(model_path: str | None, load_format: str, dtype, share_factory: ShareFactory,
                         backend: str, quick: bool, output: str | Path, corun: bool = True,
                         decode_graphs: bool = False, kernel_graphs: bool = False,
                         log: Callable[[str], None] = print, plan=None) -> EstimatorProfile:
    """Measure, calibrate and write the GPU profile to `output`; returns it."""
    began = time.monotonic()
    est_dtype = estimator_dtype(dtype)
    torch_dtype = TORCH_DTYPES[est_dtype]
    plan = plan or gpu_plan(quick)
    # dummy weights are drawn on the GPU (minutes of CPU draws for an 8B model otherwise)
    weights = load_weights(model_path, load_format, torch_dtype, device=torch.device("cuda", 0))
    state = {name: t.to("cuda") for name, t in weights.state.items()}
    kv_tokens = kv_tokens_needed(plan.all_cases()) + PAGE_SIZE  # + a spare page: decode graphs' scratch
    gpu = gpu_identity()
    with ExitStack() as stack:
        shares = share_factory()
        stack.callback(shares.close)
        bench = ModelBench(weights.config, state, kv_tokens, torch_dtype, device="cuda")
        timer = CudaEventTimer(repeats=plan.repeats, graphs=kernel_graphs)
        probe_units = profiled_shares(shares.feasible("prefill"), quick)
        flops, bandwidth = _probe(shares, probe_units, timer, torch_dtype)
        log(" ".join(f"{u} SMs: {flops[u] / 1e12:.0f} TFLOP/s, {bandwidth[u] / 1e9:.0f} GB/s;" for u in probe_units))
        feasible = shares.feasible("prefill")
        step = feasible[1] - feasible[0] if len(feasible) > 1 else feasible[0]
        hardware = gpu_hardware(torch.cuda.get_device_name(), shares.total_units, est_dtype, flops, bandwidth,
                                min_partition=feasible[0], partition_step=step, backend=backend)
        max_batch = max(c.batch for c in plan.all_cases() if isinstance(c, DecodeCase))
        blocker = graph_blocker(bench.runner) if decode_graphs else None
        if blocker is not None:  # time what a worker would run: eager decode steps
            log(f"decode steps timed eagerly: {blocker}")
            decode_graphs = False
        step_for = _decode_steps_as_graphs(bench, max_batch) if decode_graphs else None
        other = stack.enter_context(CoRunner(weights.config, state, torch_dtype, kv_tokens, share_factory, "cuda")) \
            if corun else None
        samples, notes, padded = run_cuda_plan(bench, shares, timer, plan, step_for, other, log)
        # free what ran on the shares' streams (graphs, KV, inputs) before the shares close: a block
        # freed after its stream's green context is gone may need that stream
        del step_for, bench
        torch.cuda.synchronize()
    if padded is not None:  # measured on this GPU: overrides what the engine's kernels are expected to do
        hardware = hardware.model_copy(update={"decode_attention_padded": padded})
    estimator = build_estimator(weights.config, hardware, est_dtype, samples)
    provenance = Provenance(
        model=model_cache_name(model_path, load_format), model_source=str(weights.source) if weights.source else None,
        load_format=weights.load_format, dtype=est_dtype, cores=[], cpu=f"{gpu} via {backend}",
        bullet_version=package_version(), torch_version=torch.__version__, plan=plan.name,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), duration_s=round(time.monotonic() - began, 1))
    summary = (f"bullet profile ({plan.name}) of {weights.config.name} in {est_dtype} on {gpu}, SMs restricted by "
               f"the {backend} backend: kernel sweeps and steps on {probe_units} SMs, timed with CUDA events"
               f"{'; decode steps as CUDA-graph replays' if decode_graphs else ''}")
    notes = [summary, *notes]
    shared = estimator.contention.shared_units_slowdown()
    if shared is not None:  # co-running is measured only under MPS (`bullet profile` checks it first)
        notes.append("each phase on every SM beside the other on every SM (two MPS clients) took "
                     + estimator.contention.shared_units_text() + " its time alone: what the simulator charges a step on SMs both workers hold")
    profile = EstimatorProfile.from_estimator(estimator, notes, provenance)
    profile.write(output)
    return profile


def ensure_cuda_profile(model_path: str | None, load_format: str, dtype, share_factory: ShareFactory, backend: str,
                        quick: bool = True, output: str | Path | None = None,
                        announce: Callable[[], object] | None = None, **options) -> Path:
    """The cached GPU profile of this model under `backend`, or one measured now (in this process;
    two servers starting together measure once), after `announce()`. `options` go to `measure_cuda_profile`."""
    est_dtype = estimator_dtype(dtype)
    name, gpu = model_cache_name(model_path, load_format), gpu_identity()
    # a profile whose decode steps were graph replays is another profile than an eager one
    label = f"{backend}-graphs" if options.get("decode_graphs") else backend
    path = Path(output) if output else cuda_profile_path(name, est_dtype, gpu, label)
    return cached_or_measured(
        path, lambda p: cuda_reusable(p, name, est_dtype, gpu, backend, quick),
        lambda: measure_cuda_profile(model_path, load_format, dtype, share_factory, backend, quick, path, **options),
        announce)
