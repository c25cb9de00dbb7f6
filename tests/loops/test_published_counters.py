"""The decision and repartition counts a worker publishes (and /metrics exports as
`bullet:decisions_total`, `bullet:repartitions_total`) are exact: a prefill core under the bullet
policy, driven by the simulator against a busy decode peer, publishes as many decisions as its policy
took and as many repartitions as its partition applied — and that policy does repartition."""

from __future__ import annotations

from bullet.sim.board import StateBoard
from bullet.sim.device import SimulatedDevice
from bullet.sim.driver import SimDriver
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.executor import SimExecutor
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from bullet.workers.outbox import request_from_generate
from tests.loops.test_decision_trace import Finished, _core, _finish, est, generate_messages  # noqa: F401


def test_published_decisions_and_repartitions_are_the_counts(est, tmp_path):
    clock = VirtualClock()
    loop = EventLoop(clock)
    board = StateBoard(clock)
    board.publish(Role.DECODE, WorkerState(batch_size=160, tokens_in_flight=160 * 1900, tpot_pred_p90_ms=240.0,
                                           compute_units=54))
    executor = SimExecutor(Role.PREFILL, SimulatedDevice(est, loop), None, clock, _finish(est))
    messages = generate_messages(40, seed=3)
    core = _core(Role.PREFILL, clock, board, executor, Finished(), tmp_path, "bullet", est, "60ms")
    counted = {"decide": 0, "apply": 0}
    decide, apply = core.policy.decide, core.env.partition.apply

    def counting_decide(view):
        counted["decide"] += 1
        return decide(view)

    def counting_apply(units):
        counted["apply"] += 1
        return apply(units)

    core.policy.decide, core.env.partition.apply = counting_decide, counting_apply
    driver = SimDriver(core, loop, board)
    executor.on_step_end = driver.step_ended
    for t, msg in messages:
        loop.at(t, driver.deliver, request_from_generate(msg))
    loop.run()
    core.publish()
    published = board.read(Role.PREFILL)
    assert published.decisions == counted["decide"] > len(messages)
    assert published.repartitions == counted["apply"] >= 2
