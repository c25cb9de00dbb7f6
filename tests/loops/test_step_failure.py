"""A step that raises fails the requests in that step — with an error the client sees, and their
pages back in the pool — and the worker's loop goes on serving everyone else."""

from __future__ import annotations

from bullet.sim.board import StateBoard
from bullet.sim.device import SimulatedDevice
from bullet.sim.events import EventLoop, VirtualClock
from bullet.types.finish import Abort
from bullet.types.roles import Role
from bullet.workers.driver import WorkerDriver
from tests.loops.test_decision_trace import (Finished, ManualClock, ScriptedExecutor, ScriptedInbox, _core, _finish,
                                             est, generate_messages, handoff_messages)  # noqa: F401 (fixture)


class FailsOn(ScriptedExecutor):
    """Raises in the first step that contains request `uid` (as a sampler or kernel error would)."""

    def __init__(self, *args, uid: int):
        super().__init__(*args)
        self.uid, self.raised = uid, 0

    def _run(self, work, sampled, on_done) -> None:
        if not self.raised and any(r.uid == self.uid for r in self.batch):
            self.raised += 1
            raise RuntimeError("Overflow when unpacking long long")
        super()._run(work, sampled, on_done)

    def run_prefill(self, batch, layers, finishing, on_done):
        self.batch = batch.requests
        super().run_prefill(batch, layers, finishing, on_done)

    def run_decode(self, batch, on_done, between_layers=None):
        self.batch = batch
        super().run_decode(batch, on_done, between_layers)

    def run_hybrid(self, items, on_done):
        self.batch = [i.req for i in items]
        super().run_hybrid(items, on_done)


def _serve(role, policy, messages, est, tmp_path, bad_uid):
    clock = ManualClock()
    board = StateBoard(clock)
    executor = FailsOn(role, SimulatedDevice(est, EventLoop(VirtualClock())), None, clock, _finish(est), uid=bad_uid)
    outbox = Finished()
    core = _core(role, clock, board, executor, outbox, tmp_path, policy, est, "500ms")
    driver = WorkerDriver(core, ScriptedInbox(clock, messages), lambda: len(outbox.done) == len(messages) and core.idle)
    driver.run()
    return driver, core, outbox


def test_a_failing_decode_step_fails_its_batch_and_decode_goes_on(est, tmp_path):
    messages = handoff_messages(12, seed=1)
    driver, core, outbox = _serve(Role.DECODE, "static", messages, est, tmp_path, bad_uid=3)
    failed = [r for r in outbox.done if isinstance(r.finish_reason, Abort)]
    assert driver.failed_steps == 1 and any(r.uid == 3 for r in failed)
    assert all("internal error" in r.finish_reason.message for r in failed)
    ok = [r for r in outbox.done if not isinstance(r.finish_reason, Abort)]
    assert len(ok) + len(failed) == 12 and len(ok) > 0  # requests arriving later were served
    assert core.env.allocator.num_free() == core.env.allocator.total_pages


def test_a_failing_prefill_batch_fails_only_that_batch(est, tmp_path):
    messages = generate_messages(10, seed=2)
    driver, core, outbox = _serve(Role.PREFILL, "static", messages, est, tmp_path, bad_uid=5)
    failed = [r for r in outbox.done if isinstance(r.finish_reason, Abort)]
    assert driver.failed_steps == 1 and {r.uid for r in failed} >= {5} and len(failed) < 10
    handed_off = sum(len(r.page_table) for r in outbox.done if r not in failed)  # decode holds those now
    assert core.inflight is None and core.env.allocator.num_free() == core.env.allocator.total_pages - handed_off


def test_a_failing_hybrid_step_fails_its_batch_and_the_rest_finish(est, tmp_path):
    messages = generate_messages(10, seed=3)
    driver, core, outbox = _serve(Role.UNIFIED, "chunked:256", messages, est, tmp_path, bad_uid=4)
    failed = [r for r in outbox.done if isinstance(r.finish_reason, Abort)]
    assert driver.failed_steps == 1 and any(r.uid == 4 for r in failed) and len(failed) < 10
    assert core.env.allocator.num_free() == core.env.allocator.total_pages
