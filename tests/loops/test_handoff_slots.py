"""`--max-running-requests` counts a request on its way from prefill to decode: prefill holds its slot
from the hand-off until decode publishes that it arrived (`handoffs_seen`), however many times decode
publishes meanwhile — a message slower than two decode publishes used to free the slot early, and a
capped server (max 1 running) then started a waiting prompt beside the one still in flight (seen once in
CI under load: the high-priority request finished before the one running). A decode that restarts
counts from zero and never receives what was sent to the one before it; a restarted prefill
counts from the decode it finds."""

from __future__ import annotations

from bullet.sim.board import StateBoard
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from tests.loops.test_decision_trace import Finished, ManualClock, ScriptedExecutor, _core, _finish
from tests.loops.test_decision_trace import est  # noqa: F401  (fixture)


def prefill_core(tmp_path, est, max_running: int):
    clock = ManualClock()
    executor = ScriptedExecutor(Role.PREFILL, None, None, clock, _finish(est))
    core = _core(Role.PREFILL, clock, StateBoard(clock), executor, Finished(), tmp_path, "static", est, "100ms")
    core.max_running = max_running
    return core


def test_a_hand_off_holds_its_slot_until_decode_says_it_arrived(tmp_path, est):
    core = prefill_core(tmp_path, est, max_running=2)
    assert core.free_slots(WorkerState(pid=7)) == 2
    core.handed_total += 1  # prefill handed a request over
    for beat in range(1, 50):  # decode publishes again and again before the message reaches it
        assert core.free_slots(WorkerState(pid=7, heartbeat_count=beat)) == 1
    assert core.free_slots(WorkerState(pid=7, batch_size=1, handoffs_seen=1)) == 1  # arrived: its batch holds it
    assert core.free_slots(WorkerState(pid=7, handoffs_seen=1)) == 2  # finished


def test_a_restarted_decode_frees_what_was_sent_to_the_one_before(tmp_path, est):
    core = prefill_core(tmp_path, est, max_running=4)
    assert core.free_slots(WorkerState(pid=7)) == 4  # seen before anything is handed over, as a server starts
    core.handed_total += 3
    assert core.free_slots(WorkerState(pid=7, batch_size=1, handoffs_seen=1)) == 1  # one decoding, two on the way
    assert core.free_slots(WorkerState(pid=8)) == 4  # decode restarted: those two are lost (the launcher fails them)
    core.handed_total += 1
    assert core.free_slots(WorkerState(pid=8)) == 3  # sent to the new one, not there yet
    assert core.free_slots(WorkerState(pid=8, batch_size=1, handoffs_seen=1)) == 3


def test_a_restarted_prefill_counts_from_the_decode_it_finds(tmp_path, est):
    core = prefill_core(tmp_path, est, max_running=4)  # a new prefill process: nothing handed over yet
    assert core.free_slots(WorkerState(pid=7, batch_size=2, handoffs_seen=50)) == 2
    core.handed_total += 1
    assert core.free_slots(WorkerState(pid=7, batch_size=2, handoffs_seen=50)) == 1
    assert core.free_slots(WorkerState(pid=7, batch_size=3, handoffs_seen=51)) == 1
