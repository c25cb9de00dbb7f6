"""Everything a worker loop uses, built once per process: the model runner over the shared
weights and KV pool, the shared page allocator and state buffer, the partition backend, the
sockets, the policy, and the finish checker."""

from __future__ import annotations

import os
from dataclasses import dataclass

from bullet.finish import FinishChecker
from bullet.partition import PartitionBackend, make_backend
from bullet.schedulers.base import MonotonicClock
from bullet.schedulers.timeline import Timeline
from bullet.shm_page_allocator import SharedPageAllocator
from bullet.state_buffer import ControlFlags, StateBuffer, WorkerFlags, WorkerState
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner
from engines.workers.bootstrap import StopFlag, WorkerSpec
from engines.workers.io import WorkerIO


@dataclass
class WorkerContext:
    spec: WorkerSpec
    stop: StopFlag
    runner: ModelRunner
    allocator: SharedPageAllocator
    state: StateBuffer
    partition: PartitionBackend
    io: WorkerIO
    finish: FinishChecker
    clock: MonotonicClock
    timeline: Timeline
    estimator: object | None = None  # estimator.Estimator for SLO-aware policies
    batch_token_limit: object | None = None  # units -> tokens where prefill batching stops paying
    flags: int = 0
    step: int = 0

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def peer_role(self) -> str:
        return "decode" if self.spec.role == "prefill" else "prefill"

    def should_stop(self) -> bool:
        if self.stop.stop or os.getppid() != self.spec.launcher_pid:
            return True
        return bool(self.state.control() & ControlFlags.SHUTDOWN)

    def read_peer(self) -> WorkerState:
        return self.state.read(self.peer_role)

    def apply_units(self, units: int) -> None:
        if units != self.partition.current_units:
            self.partition.apply(units)

    def publish(self, idle: bool = False, **fields) -> None:
        """Publish this worker's state; an idle worker reports no units (it uses none)."""
        ws = WorkerState(pid=os.getpid(), step=self.step, flags=self.flags, **fields)
        if not idle:
            ws.set_units(u for u in self.partition.unit_set() if u < 128)  # the mask holds ids 0-127
            ws.compute_units = self.partition.current_units  # the count holds them all (H100: 132)
        self.state.publish(self.state_role, ws)

    @property
    def state_role(self) -> str:
        # the chunked baseline's single worker reports in the prefill block
        return "prefill" if self.role == "unified" else self.role

    def became_idle(self) -> None:
        """Return the step's freed activation memory to the OS (glibc keeps it otherwise): an idle
        worker should hold little beyond the shared weights and pool."""
        from bullet.runtime.shared_model import release_free_heap

        release_free_heap()

    def mark_failed(self) -> None:
        try:
            self.flags |= WorkerFlags.FAILED
            self.publish()
        except Exception:
            pass

    def close(self) -> None:
        for closer in (self.timeline.flush, self.io.close, self.partition.close, self.allocator.close, self.state.close):
            try:
                closer()
            except Exception:
                pass


def build_context(spec: WorkerSpec, stop: StopFlag) -> WorkerContext:
    import torch

    args, shared = spec.args, spec.model
    backend_role = "decode" if spec.role == "decode" else "prefill"  # unified: the whole device
    partition = make_backend(args.partition_backend, backend_role, **_backend_options(spec))
    partition.apply(spec.initial_units)  # before the model runs: its threads start inside the share
    model = build_model(shared.config, shared.state, shared.device)
    kv = KVPool(shared.config, shared.num_pages, shared.page_size, shared.kv.dtype, shared.device, tensor=shared.kv)
    runner = ModelRunner(model, kv, shared.device)
    tokenizer = None
    if shared.tokenizer_dir:
        from engines.tokenizer import DecodeTokenizer

        tokenizer = DecodeTokenizer(shared.tokenizer_dir)
    finish = FinishChecker(tokenizer, set(shared.eos_token_ids), shared.config.max_position_embeddings)
    torch.set_grad_enabled(False)
    estimator = limit = None
    if args.policy_name == "bullet":
        from bullet.schedulers.intensity import ridge_token_limit
        from estimator import Estimator

        estimator = Estimator.load(spec.extra["estimator_profile"], model=shared.config)
        limit = ridge_token_limit(shared.config, estimator.hardware, estimator.dtype,
                                  shared.kv.element_size())
    return WorkerContext(
        spec=spec, stop=stop, runner=runner,
        allocator=SharedPageAllocator.attach(spec.instance_id),
        state=StateBuffer.attach(spec.instance_id),
        partition=partition, io=WorkerIO(spec.role, spec.endpoints), finish=finish, clock=MonotonicClock(),
        timeline=Timeline(args.timeline_dir, spec.role), estimator=estimator, batch_token_limit=limit,
    )


def _backend_options(spec: WorkerSpec) -> dict:
    name = spec.args.partition_backend
    if name == "cpu":
        return {"cores": spec.cores}
    if name == "none":
        return {"total_units": len(spec.cores)}
    if name == "libsmctrl":  # masks the stream this worker launches on
        import torch

        return {"stream": lambda: torch.cuda.current_stream().cuda_stream}
    return {}
