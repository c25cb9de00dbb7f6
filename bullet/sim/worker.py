"""What every simulated worker shares: the environment it runs in (the counterpart of the real
`WorkerContext`), waking up on virtual time, publishing its state, emitting tokens.

A real worker loop is `while running: receive messages; step(); publish()`, blocking in `receive`
while idle and inside `step` while the device computes. A simulated worker runs the same body as
a callback: when it starts a device step it is *busy* and the step's end calls it again; when it
has nothing it can start it waits for a wake-up — a message (arrival, hand-off), its peer's next
publish, or a poll timer where the real loop polls (a paused decode, every 1 ms)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.finish import FinishChecker
from bullet.page_allocator import LocalPageAllocator
from bullet.request import Request
from bullet.schedulers.timeline import Timeline
from bullet.sim.board import StateBoard
from bullet.sim.device import SimulatedDevice
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.metrics import RequestLog
from bullet.sim.partition import SimulatedPartition
from bullet.state_buffer import WorkerFlags, WorkerState
from bullet.config import ServerArgs
from estimator.hardware import HardwareSpec

SIM_TOKEN_ID = 0  # the token every simulated step "samples": not an EOS id of any shipped model
_LOW128 = (1 << 128) - 1
_LOW64 = (1 << 64) - 1


@dataclass
class SimEnv:
    args: ServerArgs
    hardware: HardwareSpec
    num_layers: int
    clock: VirtualClock
    loop: EventLoop
    device: SimulatedDevice
    board: StateBoard
    allocator: LocalPageAllocator
    finish: FinishChecker
    log: RequestLog


class SimWorker:
    role = "?"
    state_role = "?"  # the state-buffer block it publishes (the unified worker uses prefill's)

    def __init__(self, env: SimEnv, partition_role: str):
        self.env = env
        self.partition = SimulatedPartition(partition_role, env.hardware)
        self.timeline = Timeline(env.args.timeline_dir, self.role)
        self.busy = False  # a device step is running; its end runs the loop body again
        self.flags = WorkerFlags.READY
        self.steps = 0
        self._wake_at: float | None = None
        self._wake_generation = 0

    @property
    def now(self) -> float:
        return self.env.clock.now()

    # -- waking up ------------------------------------------------------------------------------
    def wake(self, delay: float = 0.0) -> None:
        """Run the loop body after `delay` (unless busy, or an earlier wake-up is pending)."""
        if self.busy:
            return
        when = self.now + delay
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_generation += 1
        self._wake_at = when
        self.env.loop.at(when, self._on_wake, self._wake_generation)

    def _on_wake(self, generation: int) -> None:
        if generation != self._wake_generation or self.busy:
            return
        self._wake_at = None
        self.iterate()

    def iterate(self) -> None:
        """One pass of the loop body: step, and publish unless a device step is now running."""
        raise NotImplementedError

    def run_on_device(self, work, on_done) -> None:
        self.busy = True
        self._wake_generation += 1  # a pending wake-up is superseded by the step's end
        self._wake_at = None

        def done(elapsed: float) -> None:
            self.busy = False
            on_done(elapsed)

        self.env.device.start(self.role, work, self.partition.current_units, done)

    def apply_units(self, units: int) -> None:
        if units != self.partition.current_units:
            self.partition.apply(units)

    # -- the state buffer -------------------------------------------------------------------------
    def publish_state(self, idle: bool = False, **fields) -> None:
        """`WorkerContext.publish`: an idle worker reports no units; the unit set is the partition's
        (ids >= 128 do not fit the layout's mask and are left out, as in the real runtime; the count
        has them all)."""
        state = WorkerState(step=self.steps, flags=int(self.flags), **fields)
        if not idle:
            mask = self.partition.unit_mask() & _LOW128
            state.unit_mask_lo, state.unit_mask_hi = mask & _LOW64, mask >> 64
            state.compute_units = self.partition.current_units
        self.env.board.publish(self.state_role, state, heartbeat_ns=int(self.now * 1e9))

    def read_peer(self) -> WorkerState:
        return self.env.board.read("decode" if self.state_role == "prefill" else "prefill")

    # -- requests ---------------------------------------------------------------------------------
    def emit_token(self, req: Request) -> bool:
        """`token_step.sample_next` for one request: append a token, stamp the first one, check
        the finish rules; True when the request is now finished."""
        req.output_ids.append(SIM_TOKEN_ID)
        now = self.now
        if req.first_token_time is None:
            req.first_token_time = now
        reason = self.env.finish.check(req)
        if reason is None:
            return False
        req.finish(reason)
        req.finish_time = now  # Request.finish stamps wall-clock time; this is virtual time
        return True

    def free_pages(self, req: Request) -> None:
        """The loops call `allocator.free_owner(uid)`; freeing the request's own page list is the
        same for the single-owner pages here, without scanning the whole pool."""
        if req.page_table:
            self.env.allocator.free(req.page_table, req.uid)
            req.page_table = []

    def retire(self, req: Request, aborted: bool = False) -> None:
        if not req.finished:
            req.finish({"type": "abort", "message": "dropped"} if aborted else {"type": "length"})
            req.finish_time = self.now
        self.free_pages(req)
        self.env.log.finished(req, aborted=aborted)

    def without_first_token(self) -> list[Request]:
        """Requests this worker holds that have not produced their first token."""
        return []

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        self.timeline.flush()
