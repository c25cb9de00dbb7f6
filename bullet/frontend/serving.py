"""A running server without HTTP: the launcher, the client of the workers and the supervisor
that watches the workers. The HTTP app and the tests drive this object."""

from __future__ import annotations

import asyncio
import logging
import time

from bullet.config import ServerArgs
from bullet.frontend.client import RuntimeClient
from bullet.launcher.launcher import Launcher, StartupInterrupted
from bullet.types.worker_state import heartbeat_interval_s
from engines.host import release_free_heap

log = logging.getLogger("bullet.serving")
TRIM_INTERVAL_S = 10.0


class WorkerExits:
    """Wakes the supervisor the moment a worker process ends: the event loop watches each process's
    sentinel (readable once the process exited), so a crash is handled without polling for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.event, self.fds = loop, asyncio.Event(), set()

    def watch(self, sentinels: list[int]) -> None:
        self.clear()
        for fd in sentinels:
            self.loop.add_reader(fd, self._exited, fd)
            self.fds.add(fd)

    def _exited(self, fd: int) -> None:
        self.loop.remove_reader(fd)  # stays readable: watched any longer, it would wake the loop forever
        self.fds.discard(fd)
        self.event.set()

    def clear(self) -> None:
        """Stop watching (before the processes are replaced or closed: a sentinel's fd may be reused)."""
        for fd in self.fds:
            self.loop.remove_reader(fd)
        self.fds.clear()

    async def wait(self, timeout: float) -> None:
        """Until a watched process exits or `timeout` seconds pass."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self.event.clear()


class ServingRuntime:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.launcher = Launcher(args)
        self.client: RuntimeClient | None = None
        self.status = "starting"  # starting | serving | restarting | draining | failed | stopped
        self.last_failure: str | None = None
        self.failures: list[dict] = []
        self._supervisor: asyncio.Task | None = None
        self.on_fatal = None  # called once the workers cannot be restarted any more
        # why start() failed, when the reason is the user's to fix or a stop signal
        self.startup_error: BaseException | None = None
        self.started_at = time.time()
        self.interrupted: int | None = None  # the stop signal that came while starting
        self._interruptible = False  # the start-up's blocking part runs: a signal may raise into it

    @property
    def tokenizer(self):
        return self.launcher.tokenizer

    @property
    def model(self):
        return self.launcher.shared

    def interrupt_start(self, sig: int) -> None:
        """From the stop-signal handler while starting: the blocking part of the start-up (the model
        load, a first launch's profile, the workers' spawn: tens of seconds to minutes) is left at
        once by raising into it, and the wait for the workers stops at its next look."""
        self.interrupted = sig
        if self._interruptible:
            self._interruptible = False
            raise StartupInterrupted(sig)

    async def start(self) -> None:
        try:
            if self.interrupted is not None:  # the signal came before the start-up did
                raise StartupInterrupted(self.interrupted)
            self._interruptible = True
            self.launcher.start()
            self._interruptible = False
        except BaseException:
            self._interruptible = False
            self.launcher.stop()  # whatever the start-up made: segments, the socket directory, workers
            raise
        shared = self.launcher.shared
        self.client = RuntimeClient(shared.config.vocab_size, shared.config.max_position_embeddings,
                                    shared.num_pages * shared.page_size,
                                    has_decode_worker="decode" in self.launcher.roles)
        await self.client.start(self.launcher.endpoints)
        try:
            await self.launcher.wait_ready(interrupted=lambda: self.interrupted)
        except BaseException:
            await self.stop()
            raise
        self.status = "serving"
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def stop(self) -> None:
        if self._supervisor:
            self._supervisor.cancel()
            if self._supervisor is not asyncio.current_task():  # it stops watching before the processes go
                await asyncio.gather(self._supervisor, return_exceptions=True)
        if self.client:
            self.client.fail_all("the server is shutting down")
            await self.client.close()
        self.launcher.stop()
        self.status = "stopped"

    @property
    def model_source(self) -> str | None:
        return self.model.source if self.model else None

    def internal_state(self) -> dict:
        """For /server_info: what each worker last published, the pool, the supervisor's record."""
        info = {"status": self.status, "instance_id": self.launcher.instance_id,
                "incarnation": self.launcher.incarnation, "worker_restarts": self.launcher.restarts,
                "worker_pids": self.launcher.worker_pids(), "failures": self.failures[-5:],
                "inflight_requests": len(self.client.inflight) if self.client else 0,
                "runtime_dir": str(self.launcher.runtime_dir) if self.launcher.runtime_dir else None}
        if self.launcher.state is not None:
            for role in ("prefill", "decode"):  # the chunked baseline reports in the prefill block
                ws = self.launcher.state.read(role)
                info[role] = {"pid": ws.pid, "step": ws.step, "flags": ws.flags, "batch_size": ws.batch_size,
                              "queued_requests": ws.queued_requests, "compute_units": ws.compute_units,
                              "units": ws.units(), "step_ms": ws.step_obs_ms}
        if self.launcher.shared is not None:
            info["weight_bytes"] = self.launcher.shared.weight_bytes()
            info["kv_bytes"] = self.launcher.shared.kv_bytes()
        if self.launcher.allocator is not None:
            info["kv_pages_free"] = self.launcher.allocator.num_free()
            info["kv_pages_total"] = self.launcher.allocator.total_pages
            # the prefix cache's pages, and how many no request uses (free + evictable == total when idle)
            info["kv_pages_cached"], info["kv_pages_evictable"] = self.launcher.allocator.cache_pages()
            info["page_size"] = self.launcher.allocator.page_size
        return info

    @property
    def healthy(self) -> bool:
        return self.status == "serving"

    async def drain(self, timeout: float) -> int:
        """Stop admitting (new requests get 503), let the requests in flight finish for up to
        `timeout` seconds, then end the rest with an error; returns how many were cut off."""
        if self.status == "serving":
            self.status = "draining"
        deadline = time.monotonic() + timeout
        while self.client is not None and self.client.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = len(self.client.inflight) if self.client is not None else 0
        if left:
            log.warning("shutting down: %d request(s) did not finish within %.0fs", left, timeout)
            self.client.fail_all(f"the server shut down before this request finished ({timeout:g}s to drain)")
        return left

    async def _supervise(self) -> None:
        exits = WorkerExits(asyncio.get_running_loop())
        exits.watch(self.launcher.sentinels())
        try:
            await self._supervise_with(exits)
        finally:
            exits.clear()

    async def _supervise_with(self, exits: WorkerExits) -> None:
        last_trim = time.monotonic()
        while True:
            # a worker that exits wakes this at once (`WorkerExits`): only the hung-worker watchdog needs a clock
            await exits.wait(heartbeat_interval_s(self.args.heartbeat_timeout))
            if time.monotonic() - last_trim > TRIM_INTERVAL_S:  # hand freed request buffers back to the OS
                last_trim = time.monotonic()
                await asyncio.to_thread(release_free_heap)
            hung = {}
            for role, silent in self.launcher.hung_workers(self.args.heartbeat_timeout):
                log.error("the %s worker published no heartbeat for %.1fs: killing it", role, silent)
                self.launcher.kill_worker(role)
                hung[role] = silent
            dead = self.launcher.dead_workers()
            if not dead:
                continue
            what = ", ".join(f"the {role} worker stopped responding (no heartbeat for {hung[role]:.1f}s) and was killed"
                             if role in hung else f"the {role} worker died (exit code {code})" for role, code in dead)
            log.error("%s; failing %d in-flight requests", what, len(self.client.inflight))
            self.last_failure = what
            self.failures.append({"time": time.time(), "what": what, "inflight": len(self.client.inflight)})
            uids = self.client.fail_all(f"request failed: {what}")
            if self.launcher.restarts >= self.args.max_worker_restarts:
                self.status = "failed"
                log.error("giving up after %d restarts", self.launcher.restarts)
                self.launcher.terminate_workers()
                for uid in uids:
                    self.launcher.allocator.free_owner(uid)
                self.launcher.drop_cache()
                if self.on_fatal is not None:
                    self.on_fatal(what)
                return
            self.status = "restarting"
            exits.clear()
            self.launcher.restart_workers(uids)
            exits.watch(self.launcher.sentinels())
            self.client.connect_workers(self.launcher.endpoints)
            try:
                await self.launcher.wait_ready()
                self.status = "serving"
                log.info("workers restarted (incarnation %d)", self.launcher.incarnation)
            except Exception as exc:  # the next loop iteration sees the dead worker again
                log.error("restart failed: %s", exc)
