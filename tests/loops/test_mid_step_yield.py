"""`--decode-yield-at layer` (the default): a decode step that took every unit while prefill was idle gives prefill
the units it claims at the next layer boundary, not when the step ends — driven here through the
real decode core and policy, with an executor that runs each decode step layer by layer and a prompt
that arrives in the middle of one."""

from __future__ import annotations

from bullet.config import ServerArgs
from bullet.loops.base import LoopEnv
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline, load_timeline
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.sim.board import StateBoard
from bullet.sim.config import SimConfig, policy_estimator
from bullet.sim.device import SimulatedDevice
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.partition import SimulatedPartition
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from bullet.workers.driver import WorkerDriver
from tests.loops.test_decision_trace import est  # noqa: F401  (fixture)
from tests.loops.test_decision_trace import (Finished, ManualClock, ScriptedExecutor, ScriptedInbox, _finish,
                                             handoff_messages)

PAGES, LAYERS = 4096, 32
ARRIVE_STEP, ARRIVE_AFTER, PREFILL_UNITS = 3, 10, 54


class LayeredExecutor(ScriptedExecutor):
    """Calls the core's `between_layers` hook after every layer but the last of a decode step, as the model executor
    does on a CPU; in step ARRIVE_STEP, after layer ARRIVE_AFTER, prefill starts on PREFILL_UNITS."""

    def __init__(self, *args, board: StateBoard):
        super().__init__(*args)
        self.board, self.steps, self.units = board, 0, {}

    def run_decode(self, batch, on_done, between_layers=None):
        self.steps += 1
        seen = []
        for layer in range(1, LAYERS):
            if self.steps == ARRIVE_STEP and layer == ARRIVE_AFTER:
                started = WorkerState(batch_size=1, remaining_layers=28, tokens_in_flight=900, compute_units=PREFILL_UNITS)
                self.board.publish(Role.DECODE.peer, started)
            if between_layers is not None:
                between_layers(layer)
            seen.append(self.partition.current_units)
        self.units[self.steps] = seen
        super().run_decode(batch, on_done)


def decode_core(tmp_path, est, make_executor, tpot_slo: str = "100ms", **server_args):
    """The bullet decode core on a manual clock beside a state board, as a worker builds it;
    `make_executor(device, clock, board)` gives its executor. Returns (clock, board, executor, env, core)."""
    clock = ManualClock()
    board = StateBoard(clock)
    executor = make_executor(SimulatedDevice(est, EventLoop(VirtualClock())), clock, board)
    partition = SimulatedPartition(Role.DECODE.partition_side, est.hardware)
    executor.partition = partition
    args = ServerArgs(policy="bullet", ttft_slo="1.5ms/token", tpot_slo=tpot_slo, max_total_tokens=PAGES * 16,
                      partition_backend="none", disable_radix_cache=True, max_running_requests=1 << 20, **server_args)
    env = LoopEnv(role=Role.DECODE, clock=clock, state=board, allocator=LocalPageAllocator(PAGES, 16),
                  partition=partition, timeline=Timeline(str(tmp_path), "decode"), executor=executor, outbox=Finished())
    return clock, board, executor, env, build_core(env, args, LAYERS, policy_estimator(SimConfig(), est), None)


def serve(tmp_path, est, yield_at: str):
    clock, board, executor, env, core = decode_core(
        tmp_path, est, lambda device, clock, board: LayeredExecutor(Role.DECODE, device, None, clock, _finish(est),
                                                                    board=board),
        decode_yield_at=yield_at)
    messages = handoff_messages(4, seed=1)
    driver = WorkerDriver(core, ScriptedInbox(clock, messages), lambda: len(env.outbox.done) == 4 and core.idle)
    driver.run()
    env.timeline.flush()
    return executor, core, load_timeline(tmp_path)


def test_decode_gives_units_to_an_arriving_prompt_at_the_next_layer(tmp_path, est):
    executor, core, rows = serve(tmp_path, est, "layer")
    total = executor.partition.total_units
    first = executor.units[1]
    assert first[0] == total  # prefill idle: decode took every unit
    arrived = executor.units[ARRIVE_STEP]
    assert arrived[:ARRIVE_AFTER - 1] == [total] * (ARRIVE_AFTER - 1)
    assert arrived[ARRIVE_AFTER - 1:] == [total - PREFILL_UNITS] * (LAYERS - ARRIVE_AFTER)
    assert core.gave_way == 1
    runs = [r for r in rows if r.get("run")]
    gave = [r for r in runs if "gave units to prefill" in r["reason"]]
    assert len(gave) == 1 and f"after layer {ARRIVE_AFTER}" in gave[0]["reason"]
    assert gave[0]["units"] == total - PREFILL_UNITS
    # the next step decides on the new state as any step does: the complement of prefill's share
    after = runs[runs.index(gave[0]) + 1]
    assert after["units"] == total - PREFILL_UNITS and "complement" in after["reason"]


def test_with_yield_at_step_a_step_keeps_its_units_to_its_end(tmp_path, est):
    executor, core, rows = serve(tmp_path, est, "step")
    total = executor.partition.total_units
    assert executor.units[ARRIVE_STEP] == [total] * (LAYERS - 1)
    assert core.gave_way == 0 and not any("gave units" in r.get("reason", "") for r in rows)
