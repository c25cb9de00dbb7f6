"""Does the worker's GPU path work as wired? Three checks, each on the real pieces a worker uses:

* **worker stream**: a backend opened the way a worker opens it (`open_worker_partition`), a step
  entered the way the executor enters one (`WorkerStream.step`): the current CUDA stream inside must
  be the partitioned one, and the %smid probe launched on *the current stream* must run on the SMs
  the share's own stream runs on (physical ids, observed directly) — before and after a repartition.
* **decode graphs**: what decode will do under each backend on this GPU and driver (from the
  verdicts the mask checks recorded), and a tiny model's decode step replayed as a CUDA graph
  (`engines.cuda_graphs`) must produce the eager step's logits.
* **profiler timing**: the GPU profiler's CUDA-event timer, inside a share of the backend, must see a
  GEMM slow down on a quarter of the SMs — otherwise a profile would calibrate nothing.

Run after the mask checks (their verdicts decide the graph modes). SKIP without a GPU."""

from __future__ import annotations

import os

from bullet.doctor.gpu_checks import skip_gpu
from bullet.doctor.mask_checks import _probe
from bullet.doctor.results import CheckResult, failed, passed, skipped
from bullet.partition import PartitionUnavailable, format_id_list
from bullet.partition.graph_policy import decide_for_worker
from bullet.partition.launch_stream import open_worker_partition
from bullet.partition.libsmctrl import LIBRARY_ENV


def _gpu_backends(library: str | None, allow_untested: bool) -> list[tuple[str, dict]]:
    """The SM-restricting backends worth checking here: libsmctrl when a library is given, green-ctx."""
    backends = []
    if library or os.environ.get(LIBRARY_ENV):
        backends.append(("libsmctrl", {"library": library, "allow_untested_driver": allow_untested}))
    backends.append(("green-ctx", {}))
    return backends


def judge_worker_step(units: int, pool_seen: set[int], step_seen: set[int], on_partitioned_stream: bool) -> str | None:
    """None when a worker step stayed inside its own share, else what went wrong.

    `pool_seen`: the SM ids (%smid, physical) the share's stream ran the probe on when launched on
    directly; `step_seen`: where the probe ran when launched from inside `WorkerStream.step()` on the
    current stream. The step must run on the stream's own SMs — never compared with the backend's
    logical positions (`unit_set()`), which the driver never promised to equal physical SM ids (a
    green context of 40 SMs ran on 68-77,82-91,96-105,110-119 of an H200, not on 92-131)."""
    if not on_partitioned_stream:
        return "its current stream is not the partitioned stream"
    if not pool_seen:
        return f"the {units}-SM share's stream ran the probe on no SM"
    if len(pool_seen) > units:
        return f"the {units}-SM share's stream ran on {len(pool_seen)} SMs ({format_id_list(pool_seen)})"
    if not step_seen:
        return "the step's probe ran on no SM"
    outside = step_seen - pool_seen
    if outside:
        return f"a step's kernel ran on {format_id_list(outside)}, outside its share's SMs {format_id_list(pool_seen)}"
    return None


def check_worker_stream(no_gpu: str | None, library: str | None = None, allow_untested: bool = False) -> CheckResult:
    name = "worker steps run on the partitioned stream"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    probe, why = _probe()
    if probe is None:
        return skipped(name, why)
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    findings, problems, unavailable = [], [], []
    for backend_name, options in _gpu_backends(library, allow_untested):
        try:
            backend, stream = open_worker_partition(backend_name, "decode", device, options)
        except PartitionUnavailable as e:
            unavailable.append(f"{backend_name}: {e}")
            continue
        try:
            for fraction in (4, 2):  # a quarter, then a repartition to half
                backend.apply(backend.round_units(max(1, total // fraction)))
                pool_seen = probe.run(stream.handle(), total)  # the share's own stream, launched on directly
                with stream.step():
                    current = torch.cuda.current_stream().cuda_stream
                    seen = probe.run(current, total)
                on_stream = current == stream.handle() and current != 0
                problem = judge_worker_step(backend.current_units, pool_seen, seen, on_stream)
                findings.append({"backend": backend_name, "units": backend.current_units,
                                 "current_is_partitioned": on_stream, "share_stream_ran_on": format_id_list(pool_seen),
                                 "step_ran_on": format_id_list(seen), "outside": format_id_list(seen - pool_seen)})
                if problem:
                    problems.append(f"{backend_name} at {backend.current_units} SMs: {problem}")
        finally:
            backend.close()
    if problems:
        return failed(name, "; ".join(problems), findings=findings, unavailable=unavailable)
    if not findings:
        return skipped(name, "no SM-restricting backend available: " + "; ".join(unavailable))
    checked = sorted({f["backend"] for f in findings})
    return passed(name, f"{', '.join(checked)}: steps launch on the partitioned stream and stay on its SMs "
                        "across a repartition", findings=findings, unavailable=unavailable)


def check_decode_graphs(no_gpu: str | None) -> CheckResult:
    name = "decode CUDA graphs"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    from engines.cuda_graphs import DecodeGraphs, TorchCudaGraphs  # deferred: CUDA only
    from engines.kv_pool import KVPool  # deferred: CUDA only
    from engines.model.build import build_model  # deferred: CUDA only
    from engines.model_config import ModelConfig  # deferred: CUDA only
    from engines.runner import ModelRunner, SeqChunk  # deferred: CUDA only
    from engines.weights.dummy import dummy_weights  # deferred: CUDA only

    device = torch.device("cuda", 0)
    modes = {b: decide_for_worker(b, device) for b in ("libsmctrl", "green-ctx", "none")}
    config = ModelConfig(name="doctor-tiny", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                         max_position_embeddings=1024)
    # fp32: the graph pads the context, which changes reduction lengths; in fp32 that stays far below
    # the tolerance, so a mismatch means wrong tables, not rounding
    state = {k: v.to(device) for k, v in dummy_weights(config, torch.float32).items()}
    runner = ModelRunner(build_model(config, state, device), KVPool(config, 64, 16, torch.float32, device), device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tables = [[2 * i, 2 * i + 1] for i in range(3)]
        runner.forward([SeqChunk(list(range(5, 5 + 10 + i)), 0, t) for i, t in enumerate(tables)])
        chunks = [SeqChunk([7 + i], 10 + i, t) for i, t in enumerate(tables)]
        kv = runner.kv.tensor.clone()
        eager = runner.forward(chunks).last_logits.clone()
        runner.kv.tensor.copy_(kv)
        graphs = DecodeGraphs(runner, 63 * 16, TorchCudaGraphs(), max_batch=4)
        replayed = graphs.forward(chunks).last_logits.clone()
        again = graphs.forward(chunks).last_logits.clone()
        graphs.release()
    stream.synchronize()
    summary = "; ".join(f"{b}: {d.mode}" for b, d in modes.items())
    details = {"modes": {b: f"{d.mode} — {d.reason}" for b, d in modes.items()},
               "max_abs_diff": float((replayed - eager).abs().max())}
    if not torch.allclose(replayed, eager, rtol=1e-3, atol=1e-4) or not torch.equal(replayed, again):
        return failed(name, "a decode step replayed as a CUDA graph does not match the eager step", **details)
    if not torch.equal(replayed.argmax(-1), eager.argmax(-1)):
        return failed(name, "graph replay picks different greedy tokens than the eager step", **details)
    return passed(name, f"replays match the eager step; decode runs {summary}", **details)


def check_profiler_timing(no_gpu: str | None, library: str | None = None, allow_untested: bool = False) -> CheckResult:
    name = "profiler timing follows the partition"
    if no_gpu:
        return skip_gpu(name, no_gpu)
    import torch

    from bullet.partition.share_control import PartitionShares  # deferred: CUDA only
    from estimator.profiler.cuda_timing import CudaEventTimer  # deferred: CUDA only

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    timer = CudaEventTimer(repeats=5)
    results, unavailable = {}, []
    for backend_name, options in _gpu_backends(library, allow_untested):
        try:
            shares = PartitionShares(backend_name, **options)
        except PartitionUnavailable as e:
            unavailable.append(f"{backend_name}: {e}")
            continue
        try:
            feasible = shares.feasible("prefill")
            quarter = next(u for u in feasible if u >= shares.total_units // 4)
            times = {}
            for units in (quarter, feasible[-1]):
                with shares.use("prefill", units):
                    times[units] = timer.kernels(lambda: a @ a)
            results[backend_name] = times
        finally:
            shares.close()
    if not results:
        return skipped(name, "no SM-restricting backend available: " + "; ".join(unavailable))
    slow = {b: t[min(t)] / t[max(t)] for b, t in results.items()}
    details = {"gemm_seconds": {b: {str(u): s for u, s in t.items()} for b, t in results.items()},
               "quarter_over_full": slow, "unavailable": unavailable}
    flat = [b for b, ratio in slow.items() if ratio < 1.5]
    if flat:
        return failed(name, f"{', '.join(flat)}: an 8192^3 GEMM on a quarter of the SMs is not slower than on "
                            "all of them: the profiler would measure the whole GPU", **details)
    return passed(name, "a GEMM on a quarter share takes " + ", ".join(f"{r:.1f}x ({b})" for b, r in slow.items())
                  + " its time on the whole GPU", **details)
