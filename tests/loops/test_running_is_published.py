"""Prefill reads from the state buffer whether decode runs a step: it takes the units of a decode it
believes paused or idle, and labels its own step as run alone or beside decode by it (the online
correction learns the two apart). So decode says it runs before each step that follows a pause or an
idle spell, not at the step's end — driven through the real decode core and policy on a manual clock,
with a prefill burst that makes decode pause and then ends."""

from __future__ import annotations

from bullet.loops.timeline import load_timeline
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.views import PrefillDecision, ran_beside
from bullet.sim.board import StateBoard
from bullet.types.roles import Role
from bullet.types.slo import SLO
from bullet.types.worker_state import WorkerFlags, WorkerState
from bullet.workers.driver import WorkerDriver
from tests.loops.test_decision_trace import est  # noqa: F401  (fixture)
from tests.loops.test_decision_trace import ScriptedExecutor, ScriptedInbox, _finish, handoff_messages
from tests.loops.test_mid_step_yield import decode_core
from tests.policies.fakes import FakePredictor, decode_state, prefill_view, req

BURST_STEP, BURST_S = 3, 0.02


class WatchingExecutor(ScriptedExecutor):
    """Records decode's published state as each of its steps starts; during step BURST_STEP, prefill takes
    every unit for a burst (decode's next decision pauses)."""

    def __init__(self, *args, board: StateBoard):
        super().__init__(*args)
        self.board, self.seen, self.burst_at = board, [], None

    def run_decode(self, batch, on_done, between_layers=None):
        self.seen.append(self.board.read(Role.DECODE))
        bursts = len(self.seen) == BURST_STEP
        if bursts:  # the burst begins while this step runs
            total = self.partition.total_units
            self.board.publish(Role.PREFILL, WorkerState(batch_size=1, remaining_layers=8, tokens_in_flight=900,
                                                         compute_units=total, claimed_units=total))
        super().run_decode(batch, on_done)
        if bursts:
            self.burst_at = self.clock.t


class BurstEnds(ScriptedInbox):
    """The inbox, and prefill's burst ending BURST_S after it began (prefill idle again)."""

    def __init__(self, clock, messages, executor: WatchingExecutor, board: StateBoard):
        super().__init__(clock, messages)
        self.executor, self.board = executor, board

    def receive(self, timeout_s: float) -> list:
        ready = super().receive(timeout_s)
        began = self.executor.burst_at
        if began is not None and self.clock.t >= began + BURST_S:
            self.board.publish(Role.PREFILL, WorkerState())
            self.executor.burst_at = None
        return ready


def test_decode_says_it_runs_before_a_step_after_idling_or_pausing(tmp_path, est):
    clock, board, executor, env, core = decode_core(
        tmp_path, est, lambda device, clock, board: WatchingExecutor(Role.DECODE, device, None, clock, _finish(est),
                                                                     board=board),
        tpot_slo="200ms")
    messages = handoff_messages(4, seed=1)
    driver = WorkerDriver(core, BurstEnds(clock, messages, executor, board),
                          lambda: len(env.outbox.done) == 4 and core.idle)
    driver.run()
    assert core.pauses >= 1 and len(executor.seen) > BURST_STEP + 1  # it idled first, paused, and ran again
    for state in executor.seen:  # what prefill read while each step ran
        assert state.compute_units > 0 and state.batch_size > 0 and not state.flags & WorkerFlags.PAUSED
    env.timeline.flush()  # each step's row says what it is learnt as running beside: only the one the burst began in
    steps = [r for r in load_timeline(tmp_path) if r.get("run")]
    assert [r["beside"] for r in steps] == [0] * (BURST_STEP - 1) + [900] + [0] * (len(steps) - BURST_STEP)
    assert steps[BURST_STEP - 1]["prefill_units"] == 0  # the decision saw prefill idle


def test_a_step_ran_beside_the_peer_if_it_stepped_or_holds_units_at_the_end():
    running = WorkerState(step=5, batch_size=8, compute_units=40)
    paused = WorkerState(step=5, batch_size=8, compute_units=40, flags=int(WorkerFlags.PAUSED))
    idle = WorkerState(step=5)
    assert ran_beside(running, running) and ran_beside(idle, running)  # it started during ours
    assert not ran_beside(running, paused) and not ran_beside(idle, idle)  # it paused for ours; it never ran
    assert ran_beside(idle, WorkerState(step=6))  # it ran a whole step inside ours, idle again at the end
    assert ran_beside(running, None) and not ran_beside(paused, None)  # no state at the end: the decision's


def test_prefill_learns_its_step_as_alone_when_decode_paused_for_it():
    est = FakePredictor()
    policy = BulletPrefillPolicy(est, SLO.parse("10s", "100ms"), list(range(1, 9)), 4, 32, 8192, lambda u: 8192)
    view = prefill_view(1.0, [req("a", 500, 0.9)], peer=decode_state(batch=10, context=5000))
    decision = PrefillDecision(admit=[], num_layers=4, units=8, lengths=[500])
    paused = decode_state(batch=10, context=5000)
    paused.flags = int(WorkerFlags.PAUSED)
    policy.observe(decision, 0.01, view, paused)
    ran = decode_state(batch=12, context=6000)
    ran.step, ran.compute_units = 1, 2
    policy.observe(decision, 0.01, view, ran)
    assert [kw["co_decode_batch"] for _, _, kw in est.observed] == [0, 12]
