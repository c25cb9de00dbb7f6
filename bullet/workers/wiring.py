"""Everything a worker process runs with, built once: the model runner over the shared weights and
KV pool, the shared page allocator and state buffer, the partition backend, the sockets, the
estimator (SLO-aware policies), the loop core and its driver."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from bullet.loops.base import LoopEnv
from bullet.loops.clock import MonotonicClock
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline
from bullet.partition import PartitionBackend
from bullet.partition.cuda_access import CudaAccess, cuda_access, tensor_device
from bullet.partition.decode_graphs import GraphedDecode, build_graphed_decode, reserve_scratch_page
from bullet.partition.graph_policy import decide_for_worker
from bullet.partition.launch_stream import open_worker_partition
from bullet.policies.intensity import ridge_token_limit
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.shm.state_buffer import StateBuffer
from bullet.types.finish import FinishChecker
from bullet.types.roles import Role
from bullet.types.worker_state import ControlFlags, WorkerFlags, heartbeat_interval_s
from bullet.workers.driver import WorkerDriver
from bullet.workers.executor import ModelExecutor
from bullet.workers import kernel_stats
from bullet.workers.io import WorkerIO
from bullet.workers.outbox import MessageOutbox
from bullet.workers.spec import WorkerSpec
from bullet.workers.tensor_parallel import join_rank_group, share_threads
from bullet.workers.vetting import MessageVetter
from engines.device import require_device
from engines.grammar import Grammars
from engines.host import release_free_heap
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner
from engines.tensor_parallel import LeadingRunner
from engines.tokenizer import DecodeTokenizer
from engines.triton_compiles import COUNTER
from estimator.profile import load_estimator


@dataclass
class Worker:
    spec: WorkerSpec
    driver: WorkerDriver
    allocator: SharedPageAllocator
    state: StateBuffer
    partition: PartitionBackend
    io: WorkerIO
    timeline: Timeline
    decode: GraphedDecode | None = None  # decode-only steps' forward on a GPU (CUDA graphs where allowed)

    def run(self) -> None:
        self.driver.run()

    def mark_failed(self) -> None:
        core = self.driver.core
        try:
            core.flags |= WorkerFlags.FAILED
            core.publish()
        except Exception:
            pass

    def shutdown_requested(self) -> bool:
        """Whether the launcher asked the workers to stop (it then removes the instance's files itself)."""
        try:
            return bool(self.state.control() & ControlFlags.SHUTDOWN)
        except Exception:
            return False

    def close(self) -> None:
        release_graphs = self.decode.release if self.decode is not None else (lambda: None)
        for closer in (self.timeline.flush, self.io.close, release_graphs, self.partition.close, self.allocator.close,
                       self.state.close):
            try:
                closer()
            except Exception:
                pass


def build_worker(spec: WorkerSpec, stopped: Callable[[], bool], cuda: CudaAccess | None = None) -> Worker:
    """`cuda` replaces torch.cuda (tests: a fake GPU whose tensors stay on the CPU)."""
    args, shared, role = spec.args, spec.model, spec.role
    device = require_device(shared.device)
    if device.type == "cuda":
        cuda_access(cuda).make_current(device)
        COUNTER.install()  # before the first kernel: warm-up and capture compiles count as before serving
    # on a GPU: the worker's own stream, restricted by the backend; every step's kernels launch on it
    partition, stream = open_worker_partition(args.partition_backend, role.partition_side, device,
                                              backend_options(spec), cuda)
    partition.apply(spec.initial_units)  # before the model runs: its threads start inside the share
    share_threads(spec, partition)
    torch.set_grad_enabled(False)
    data = tensor_device(device, cuda)
    model, runner = model_runner(shared, data, device)
    if spec.args.tp_size > 1:  # rank 0 of the worker's ranks: every runner call reaches the others first
        runner = LeadingRunner(runner, join_rank_group(spec, model), units=lambda: partition.current_units)
    tokenizer = DecodeTokenizer(shared.tokenizer_dir) if shared.tokenizer_dir else None
    finish = FinishChecker(tokenizer, set(shared.eos_token_ids), shared.config.max_position_embeddings)
    estimator = limit = None
    if args.uses_estimator:
        # the whole model's config: the profile measured it unsplit (what its ranks cost is not modelled here)
        estimator = load_estimator(spec.estimator_profile, model=shared.model_config)
        limit = ridge_token_limit(shared.model_config, estimator.hardware, estimator.dtype, shared.kv.element_size())
    allocator = SharedPageAllocator.attach(spec.instance_id)
    state = StateBuffer.attach(spec.instance_id)
    if runner.device.type == "cuda":  # every Triton variant compiled now, on the stream steps run on
        with stream.step():
            kernel_stats.warm(runner, reserve_scratch_page(allocator))
    decode = None
    if stream.on_gpu and role is not Role.PREFILL:  # decode steps, and the unified worker's decode-only steps
        # every graph captured now, before the worker reports ready: for each share the decode policy
        # may pick (a fixed split keeps the one applied above)
        shares = partition.feasible_units() if args.uses_estimator else [partition.current_units]
        decode = build_graphed_decode(runner, stream, decide_for_worker(args.partition_backend, device, cuda),
                                      allocator, max_batch=args.max_running_requests, shares=shares,
                                      graph_api_factory=cuda_access(cuda).graphs)
    # compiled on first use, in a thread: a server that never sees a grammar never loads xgrammar
    grammars = (Grammars.for_tokenizer_dir(shared.tokenizer_dir, shared.config.vocab_size, shared.eos_token_ids)
                if shared.tokenizer_dir else None)
    executor = ModelExecutor(runner, finish, stream if stream.on_gpu else None, decode, grammars)
    io = WorkerIO(role, spec.endpoints)
    timeline = Timeline(args.timeline_dir, role.value, annotate=kernel_stats.timeline_fields)
    env = LoopEnv(role=role, clock=MonotonicClock(), state=state, allocator=allocator, partition=partition,
                  timeline=timeline, executor=executor, outbox=MessageOutbox(io, role.value),
                  pid=os.getpid())
    core = build_core(env, args, model.num_layers, estimator, limit)

    def should_stop() -> bool:
        return stopped() or os.getppid() != spec.launcher_pid or bool(state.control() & ControlFlags.SHUTDOWN)

    vet = MessageVetter(shared.config.vocab_size, shared.config.max_position_embeddings, allocator, shared.page_size)
    driver = WorkerDriver(core, io, should_stop, on_idle=release_free_heap, vet=vet,
                          prefetch=grammars.prefetch if grammars is not None else lambda constraint: None,
                          # ranks out of step cannot run another step: the worker exits and is restarted
                          fatal=(lambda: runner.broken) if isinstance(runner, LeadingRunner) else (lambda: False),
                          heartbeat_s=heartbeat_interval_s(args.heartbeat_timeout))
    kernel_stats.serving_starts()  # warmed and captured: a compile from here on is one while serving
    # under --tp-size the other ranks are not stopped from here: the launcher ends them (SIGTERM ends a
    # follower at once), and a message to a rank already gone could hold up this worker's exit
    return Worker(spec, driver, allocator, state, partition, io, timeline, decode)


def model_runner(shared, data, device: torch.device) -> tuple:
    """(the model over the shared weights, its runner over the shared KV pool) — of the whole model, or
    of one tensor-parallel rank's shard."""
    model = build_model(shared.config, shared.state, data)
    kv = KVPool(shared.config, shared.num_pages, shared.page_size, shared.kv.dtype, data, tensor=shared.kv)
    # paged kernels wherever a GPU serves (the fake GPU's tensors are on the CPU); on a CPU the runner
    # decides (the int8 model reads its pool in place, float models gather)
    return model, ModelRunner(model, kv, data, paged=True if device.type == "cuda" else None)


def backend_options(spec: WorkerSpec) -> dict:
    name = spec.args.partition_backend
    if name == "cpu":  # a tensor-parallel rank runs on its part of the worker's share
        return {"cores": spec.cores, "rank": spec.tp_rank, "ranks": spec.args.tp_size}
    if name == "none" and spec.model.device.type != "cuda":  # on a GPU: its SMs (open_worker_partition)
        return {"total_units": len(spec.cores)}
    if name == "green-ctx":
        return {"pool": spec.args.partition_pool}  # its streams and device come from open_worker_partition
    if name == "mps-percentage" and spec.total_units:
        # the device's SMs as the uncapped launcher counted them: under its MPS cap this process's torch
        # reports the capped count, and the cap would be taken of that again
        return {"total_units": spec.total_units}
    return {}  # libsmctrl gets its stream (and device) from open_worker_partition
