"""The launcher: loads weights and allocates the KV pool once, creates the instance's shared
memory (state buffer, page allocator) and private socket directory, starts the prefill and decode
worker processes, restarts or stops them, and removes every segment and socket however the server
ends — and, at start, what crashed instances of this user left behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

import torch.multiprocessing as mp

from bullet.config import ServerArgs
from bullet.launcher.device_choice import serving_device
from bullet.partition.backend_choice import choose_for_device
from bullet.partition.cuda_access import CudaAccess, cuda_access
from bullet.partition.graph_policy import decide_for_worker
from bullet.partition.libsmctrl import LIBRARY_ENV
from bullet.partition.mps_share import environment, fixed_split, worker_environment
from bullet.partition.share_control import share_factory
from bullet.policies.factory import initial_units, roles_for
from bullet.shared.endpoints import Endpoints, make_runtime_dir, remove_runtime_dir, stale_runtime_dirs
from bullet.shared.model import load_shared_model, shard_shared_model
from bullet.shm.page_allocator import CACHE_OWNER
from bullet.shm.segments import cleanup_at_exit_only, cleanup_instance, instance_alive, new_instance_id, stale_instances
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.shm.state_buffer import StateBuffer
from bullet.types.roles import Role
from bullet.types.worker_state import ControlFlags, WorkerFlags
from bullet.workers.bootstrap import worker_main
from bullet.workers.spec import WorkerSpec
from engines.host import bound_thread_spin_waits
from estimator.profiler.cache import ensure_profile
from estimator.profiler.cuda_measure import ensure_cuda_profile

log = logging.getLogger("bullet.launcher")


def reclaim_stale_instances() -> list[str]:
    """Remove the segments and socket directories of instances whose creator no longer runs (a
    launcher killed with SIGKILL cannot clean up after itself); returns what was removed."""
    removed = []
    for info in stale_instances():
        removed.extend(cleanup_instance(info.instance_id))
    for path in stale_runtime_dirs(instance_alive):
        remove_runtime_dir(path)
        removed.append(str(path))
    if removed:
        log.info("removed %d leftovers of crashed instances: %s", len(removed), ", ".join(removed[:6]))
    return removed


class WorkerStartupError(RuntimeError):
    pass


class StartupInterrupted(BaseException):
    """A stop signal (Ctrl-C, SIGTERM) arrived while the server was still starting: raised out of
    the start-up where it stood — loading the model, measuring the estimator profile (its child is
    killed), starting the workers — so that the server stops at once instead of after a start that
    can take minutes. A BaseException, as KeyboardInterrupt is: no `except Exception` on its way
    may take it for a failure to recover from."""

    def __init__(self, sig: int):
        self.sig = sig
        super().__init__(f"{signal.Signals(sig).name} while starting: stopped before serving "
                         "(nothing half-measured is cached, no worker or shared-memory segment is left)")


class Launcher:
    def __init__(self, args: ServerArgs, cuda: CudaAccess | None = None):
        """`cuda` replaces torch.cuda (tests: a fake GPU whose tensors stay in host memory)."""
        self.args, self.cuda = args, cuda
        self.device = serving_device(args, cuda)  # before anything loads: a wrong --device fails here
        if args.tp_size > 1 and self.device.type == "cuda":
            raise ValueError(f"--tp-size {args.tp_size} on {self.device}: tensor-parallel workers run on CPUs only for "
                             "now (gloo); NCCL ranks across GPUs are not implemented")
        self.instance_id = new_instance_id()
        self.procs: dict[Role, mp.Process] = {}  # each worker's process (its rank 0 under --tp-size)
        self.followers: dict[Role, list[mp.Process]] = {}  # ranks 1.. of each worker under --tp-size
        self.rank_models = []  # the model's shard for each tensor-parallel rank (one: the whole model)
        self.incarnation = 0
        self.restarts = 0
        self.shared = self.tokenizer = self.state = self.allocator = None
        self.endpoints: Endpoints | None = None
        self.runtime_dir = None
        self.cores = args.allowed_cores()
        self.total_units = len(self.cores)  # SMs on a GPU: known once the model's device is
        self.roles = roles_for(args)
        self.estimator_profile: str | None = args.estimator_profile

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Load the model into shared memory, create the segments, start both workers (returns
        without waiting for them; see wait_ready)."""
        self.prepare()
        self.spawn_workers()

    def prepare(self) -> None:
        """Everything the workers need before they start: the model in shared memory, the unit
        count, the estimator profile, the segments and the socket directory."""
        t0 = time.monotonic()
        reclaim_stale_instances()
        log.info("worker threads: %s", bound_thread_spin_waits())  # before the profiler child and the workers start
        if self.device.type == "cuda":
            cuda_access(self.cuda).make_current(self.device)  # the GPU profiler says only "cuda"
        self.shared, self.tokenizer = load_shared_model(self.args, self.device, self.cuda)
        self.rank_models = shard_shared_model(self.shared, self.args.tp_size)
        self.shared = self.rank_models[0]  # the whole model's split tensors and pool are freed here
        log.info("loaded %s (%s, %.0f MB weights, %.0f MB KV pool of %d pages%s) on %s in %.1fs", self.shared.model_name,
                 self.shared.dtype, self.shared.weight_bytes() / 2**20, self.shared.kv_bytes() / 2**20,
                 self.shared.num_pages, f", each of {self.args.tp_size} tensor-parallel ranks" if self.args.tp_size > 1
                 else "", self.device, time.monotonic() - t0)
        if self.device.type == "cuda":
            self.total_units = cuda_access(self.cuda).sm_count(self.device)
        self._resolve_partition_backend()
        if self.args.uses_estimator and self.estimator_profile is None:
            self.estimator_profile = str(self._profile())
        self.runtime_dir = make_runtime_dir(self.instance_id)
        cleanup_at_exit_only()  # the server drains on SIGTERM (its segments must stay until it stops)
        self.state = StateBuffer.create(self.instance_id)
        self.allocator = SharedPageAllocator.create(self.instance_id, self.shared.num_pages, self.shared.page_size)

    def _resolve_partition_backend(self) -> None:
        """`--partition-backend auto`: the backend the doctor proved on this GPU, driver and MPS state."""
        if self.args.partition_backend != "auto":
            return
        choice = choose_for_device(self.device, self.cuda)
        if self.device.type == "cuda":
            log.log(logging.INFO if choice.proven else logging.WARNING, "partition backend %s: %s", choice.backend,
                    choice.reason)
        self.args = self.args.model_copy(update={"partition_backend": choice.backend})

    def worker_specs(self) -> list[WorkerSpec]:
        """What each worker of the current incarnation is started with."""
        prefill_units, decode_units = initial_units(self.args, self.total_units)
        if self.args.partition_backend == "mps-percentage":  # fixed for the workers' lives: a split, not overlap
            prefill_units, decode_units = fixed_split(prefill_units, decode_units, self.total_units)
        units = {Role.PREFILL: prefill_units, Role.DECODE: decode_units, Role.UNIFIED: self.total_units}
        return [WorkerSpec(role=role, instance_id=self.instance_id, incarnation=self.incarnation, args=self.args,
                           model=model, endpoints=self.endpoints, runtime_dir=str(self.runtime_dir),
                           cores=self.cores, launcher_pid=os.getpid(), initial_units=units[role],
                           estimator_profile=self.estimator_profile, total_units=self.total_units, tp_rank=model.tp_rank)
                for role in self.roles for model in self.rank_models]

    def next_incarnation(self) -> None:
        self.incarnation += 1
        self.endpoints = Endpoints.in_dir(self.runtime_dir, self.incarnation)
        self.state.clear_control(ControlFlags.SHUTDOWN)

    def spawn_workers(self) -> None:
        self.next_incarnation()
        ctx = mp.get_context("spawn")
        self.procs, self.followers = {}, {role: [] for role in self.roles}
        for spec in self.worker_specs():
            rank = f"-rank{spec.tp_rank}" if spec.tp_rank else ""
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"bullet-{spec.role}{rank}-{self.instance_id}",
                               daemon=False)
            # mps-percentage: the worker's SM cap must be in its environment before it initialises CUDA
            with environment(worker_environment(self.args.partition_backend, spec.initial_units, self.total_units)):
                proc.start()
            if spec.tp_rank:
                self.followers[spec.role].append(proc)
            else:
                self.procs[spec.role] = proc

    def _all_procs(self) -> list[tuple[Role, mp.Process]]:
        """Every process of every worker: rank 0 (the one that schedules) and its followers."""
        return [(role, p) for role, p in self.procs.items()] + \
            [(role, p) for role, ps in self.followers.items() for p in ps]

    async def wait_ready(self, timeout: float = 300.0, interrupted: Callable[[], int | None] = lambda: None) -> None:
        """Until both workers published READY in this incarnation; raises if one exits first, or
        `StartupInterrupted` once `interrupted()` names a signal."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (sig := interrupted()) is not None:
                raise StartupInterrupted(sig)
            dead = self.dead_workers()
            if dead:
                raise WorkerStartupError(", ".join(f"{r} worker exited with code {c} during startup" for r, c in dead))
            states = [self.state.read(r.block) for r in self.roles]
            if all(s.flags & WorkerFlags.READY and s.pid == self.procs[r].pid for r, s in zip(self.roles, states)):
                return
            await asyncio.sleep(0.05)
        raise WorkerStartupError(f"workers not ready after {timeout:.0f}s")

    def sentinels(self) -> list[int]:
        """A file descriptor per worker process that turns readable when the process ends."""
        return [p.sentinel for _, p in self._all_procs()]

    def hung_workers(self, timeout: float) -> list[tuple[Role, float]]:
        """Ready workers of this incarnation whose last heartbeat is older than `timeout` seconds."""
        if timeout <= 0 or self.state is None:
            return []
        now, hung = time.monotonic_ns(), []
        for role, proc in self.procs.items():
            if proc.exitcode is not None:
                continue
            state = self.state.read(role.block)
            if state.pid == proc.pid and state.flags & WorkerFlags.READY:
                silent = (now - state.heartbeat_ns) / 1e9
                if silent > timeout:
                    hung.append((role, silent))
        return hung

    def kill_worker(self, role: Role) -> None:
        """Every rank of `role`'s worker (one without the others cannot run a step)."""
        for r, proc in self._all_procs():
            if r is role and proc.exitcode is None:
                proc.kill()
                proc.join(2.0)

    def dead_workers(self) -> list[tuple[Role, int]]:
        """Workers with a process that exited (any rank: the rest cannot go on without it), with its code."""
        dead: dict[Role, int] = {}
        for role, p in self._all_procs():
            if p.exitcode is not None:
                dead.setdefault(role, p.exitcode)
        return list(dead.items())

    def worker_pids(self) -> dict[str, int]:
        pids = {role.value: p.pid for role, p in self.procs.items()}
        for role, procs in self.followers.items():
            pids.update({f"{role.value}.rank{i + 1}": p.pid for i, p in enumerate(procs)})
        return pids

    def terminate_workers(self, grace: float = 5.0) -> None:
        """SIGTERM (stop after the current step), then SIGKILL whatever is still alive."""
        self.state.set_control(ControlFlags.SHUTDOWN)
        procs = [p for _, p in self._all_procs()]
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(2.0)

    def restart_workers(self, failed_uids: list[int]) -> None:
        """After a worker died: stop the survivor, return the failed requests' pages, start a new
        incarnation of both (a clean slate: no request is half in one worker and half in the other)."""
        self.terminate_workers()
        for uid in failed_uids:
            self.allocator.free_owner(uid)
        self.drop_cache()
        self.restarts += 1
        self.spawn_workers()

    def drop_cache(self) -> None:
        """The prefix cache lived in the old prefill worker: its pages go back to the free list."""
        self.allocator.free_owner(CACHE_OWNER)
        self.allocator.set_cache_pages(0, 0)

    def _profile(self):
        """The estimator profile of this model on this device: cached, or measured now (minutes)."""
        args = self.args
        measured = []

        def announce(what: str):
            measured.append(what)
            log.info("the bullet policy needs %s: measuring (once; cached for later runs)", what)

        if self.device.type == "cuda":
            # mps-percentage cannot vary a share within one process: SM scaling is profiled on green contexts
            backend = "green-ctx" if args.partition_backend == "mps-percentage" else args.partition_backend
            factory = share_factory(backend, os.environ.get(LIBRARY_ENV))
            # decode timed as the workers will run it: CUDA-graph replays where the backend allows them (an
            # eager step is launch-bound — flat in SMs on an H200 — and 1.5-2x slower than a replay)
            graphs = decide_for_worker(args.partition_backend, self.device, self.cuda).enabled
            what = f"a GPU profile of this model under {args.partition_backend}"
            path = ensure_cuda_profile(args.model_path, args.load_format, self.shared.dtype, factory, backend,
                                       quick=True, decode_graphs=graphs, announce=lambda: announce(what))
        else:
            what = f"an estimator profile of this model on {len(self.cores)} cores"
            path = ensure_profile(args.model_path, args.load_format, self.shared.dtype, self.cores, quick=True,
                                  quantization=self.shared.quantization, announce=lambda: announce(what))
        if not measured:
            log.info("estimator profile: %s (measured earlier on this machine)", path)
        return path

    def stop(self) -> None:
        if self.state is None:
            remove_runtime_dir(self.runtime_dir)
            self.runtime_dir = None
            return
        try:
            self.terminate_workers()
        finally:
            for seg in (self.allocator, self.state):
                if seg is not None:
                    try:
                        seg.close()
                        seg.unlink()
                    except Exception:
                        pass
            cleanup_instance(self.instance_id)
            remove_runtime_dir(self.runtime_dir)
            self.state = self.allocator = self.runtime_dir = None
