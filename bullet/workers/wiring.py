"""Everything a worker process runs with, built once: the model runner over the shared weights and
KV pool, the shared page allocator and state buffer, the partition backend, the sockets, the
estimator (SLO-aware policies), the loop core and its driver."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from bullet.core.finish import FinishChecker
from bullet.core.worker_state import ControlFlags, WorkerFlags
from bullet.loops.base import LoopEnv
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline
from bullet.partition import PartitionBackend, make_backend
from bullet.schedulers.intensity import ridge_token_limit
from bullet.schedulers.views import MonotonicClock
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.shm.state_buffer import StateBuffer
from bullet.workers.driver import WorkerDriver
from bullet.workers.executor import ModelExecutor
from bullet.workers.io import WorkerIO
from bullet.workers.outbox import MessageOutbox
from bullet.workers.spec import WorkerSpec
from engines.host import release_free_heap
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner
from engines.tokenizer import DecodeTokenizer
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

    def run(self) -> None:
        self.driver.run()

    def mark_failed(self) -> None:
        core = self.driver.core
        try:
            core.flags |= WorkerFlags.FAILED
            core.publish()
        except Exception:
            pass

    def close(self) -> None:
        for closer in (self.timeline.flush, self.io.close, self.partition.close, self.allocator.close, self.state.close):
            try:
                closer()
            except Exception:
                pass


def build_worker(spec: WorkerSpec, stopped: Callable[[], bool]) -> Worker:
    args, shared, role = spec.args, spec.model, spec.role
    partition = make_backend(args.partition_backend, role.partition_side, **_backend_options(spec))
    partition.apply(spec.initial_units)  # before the model runs: its threads start inside the share
    torch.set_grad_enabled(False)
    model = build_model(shared.config, shared.state, shared.device)
    kv = KVPool(shared.config, shared.num_pages, shared.page_size, shared.kv.dtype, shared.device, tensor=shared.kv)
    runner = ModelRunner(model, kv, shared.device)
    tokenizer = DecodeTokenizer(shared.tokenizer_dir) if shared.tokenizer_dir else None
    finish = FinishChecker(tokenizer, set(shared.eos_token_ids), shared.config.max_position_embeddings)
    estimator = limit = None
    if args.policy_name == "bullet":
        estimator = load_estimator(spec.estimator_profile, model=shared.config)
        limit = ridge_token_limit(shared.config, estimator.hardware, estimator.dtype, shared.kv.element_size())
    allocator = SharedPageAllocator.attach(spec.instance_id)
    state = StateBuffer.attach(spec.instance_id)
    io = WorkerIO(role, spec.endpoints)
    timeline = Timeline(args.timeline_dir, role.value)
    env = LoopEnv(role=role, clock=MonotonicClock(), state=state, allocator=allocator, partition=partition,
                  timeline=timeline, executor=ModelExecutor(runner, finish), outbox=MessageOutbox(io, role.value),
                  pid=os.getpid())
    core = build_core(env, args, model.num_layers, estimator, limit)

    def should_stop() -> bool:
        return stopped() or os.getppid() != spec.launcher_pid or bool(state.control() & ControlFlags.SHUTDOWN)

    driver = WorkerDriver(core, io, should_stop, on_idle=release_free_heap)
    return Worker(spec, driver, allocator, state, partition, io, timeline)


def _backend_options(spec: WorkerSpec) -> dict:
    name = spec.args.partition_backend
    if name == "cpu":
        return {"cores": spec.cores}
    if name == "none":
        return {"total_units": len(spec.cores)}
    if name == "libsmctrl":  # masks the stream this worker launches on
        return {"stream": lambda: torch.cuda.current_stream().cuda_stream}
    return {}
