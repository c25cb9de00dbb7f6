"""One loop core, two drivers: a core driven the way a worker process drives it (`WorkerDriver`:
block on the socket, run each step synchronously) and the way the simulator drives it (`SimDriver`:
callbacks on virtual time, steps charged by the simulated device) makes the same decisions, at the
same times, given the same arrivals and the same step costs.

The worker side runs on a manual clock: its inbox delivers scripted messages at their times and its
executor advances the clock by each step's cost — the estimator's latency of that step, which is
exactly what the simulated device charges a step that runs alone (no noise, no contention)."""

from __future__ import annotations

import pytest

from bullet.config import ServerArgs
from bullet.loops.base import LoopEnv
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline, load_timeline
from bullet.policies.intensity import ridge_token_limit
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.sim.board import StateBoard
from bullet.sim.config import SimConfig, device_estimator, policy_estimator
from bullet.sim.device import SimulatedDevice
from bullet.sim.driver import SimDriver
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.executor import SimExecutor, hybrid_work
from bullet.sim.partition import SimulatedPartition
from bullet.types.finish import FinishChecker
from bullet.types.messages import GenerateRequest, Handoff
from bullet.types.request import Request
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from bullet.workers.driver import WorkerDriver
from bullet.workers.outbox import request_from_generate, request_from_handoff
from engines.sampling_params import SamplingParams

PAGES = 4096


@pytest.fixture(scope="module")
def est():
    return device_estimator(SimConfig())


class ManualClock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


class ScriptedInbox:
    """A worker's socket on a manual clock: each message becomes readable at its scripted time."""

    def __init__(self, clock: ManualClock, arrivals: list[tuple[float, object]]):
        self.clock, self.pending = clock, sorted(arrivals, key=lambda a: a[0])

    def receive(self, timeout_s: float) -> list:
        now = self.clock.t
        if (not self.pending or self.pending[0][0] > now) and timeout_s > 0:
            nxt = self.pending[0][0] if self.pending else float("inf")
            self.clock.t = min(nxt, now + timeout_s)
        ready = [m for t, m in self.pending if t <= self.clock.t]
        self.pending = [(t, m) for t, m in self.pending if t > self.clock.t]
        return ready


class ScriptedExecutor(SimExecutor):
    """Runs each step at once, advancing the manual clock by the latency the device would charge."""

    def _run(self, work, sampled, on_done) -> None:
        seconds = self.device._alone(work, self.partition.current_units)
        self.clock.t += seconds
        for req in sampled:
            self.emit_token(req)
        on_done(seconds)


class Finished:
    """Outbox: counts requests that left this core (finished, or handed to decode)."""

    def __init__(self):
        self.done: list[Request] = []

    def handed_off(self, req):
        self.done.append(req)

    def tokens(self, reqs):
        self.done.extend(r for r in reqs if r.finished)

    def finished(self, req):
        self.done.append(req)

    def recompute(self, req):
        raise AssertionError("the pool of these runs never runs out")


def _args(policy: str, tpot: str, radix_cache: bool) -> ServerArgs:
    # the prefix cache is off unless a test asks: prefill and decode run here without each other, so
    # nothing would send decode's pages back to the cache's owner — nor tell prefill that requests it
    # handed over finished, hence no cap on running requests either
    return ServerArgs(policy=policy, ttft_slo="1.5ms/token", tpot_slo=tpot, max_total_tokens=PAGES * 16,
                      partition_backend="none", disable_radix_cache=not radix_cache, max_running_requests=1 << 20)


def _core(role, clock, board, executor, outbox, timeline_dir, policy, est, tpot, radix_cache=False):
    args = _args(policy, tpot, radix_cache)
    partition = SimulatedPartition(role.partition_side, est.hardware)
    executor.partition = partition
    env = LoopEnv(role=role, clock=clock, state=board, allocator=LocalPageAllocator(PAGES, 16), partition=partition,
                  timeline=Timeline(str(timeline_dir), role.value), executor=executor, outbox=outbox)
    predictor = policy_estimator(SimConfig(), est) if policy == "bullet" else None
    limit = ridge_token_limit(est.model, est.hardware, est.dtype) if policy == "bullet" else None
    return build_core(env, args, est.model.num_hidden_layers, predictor, limit)


def _finish(est):
    return FinishChecker(None, set(est.model.eos_token_ids), est.model.max_position_embeddings)


def run_worker_side(role, policy, messages, peer: WorkerState | None, est, tmp, tpot, radix_cache=False):
    clock = ManualClock()
    board = StateBoard(clock)
    if peer is not None:
        board.publish(role.peer, peer)
    device = SimulatedDevice(est, EventLoop(VirtualClock()))
    executor = ScriptedExecutor(role, device, None, clock, _finish(est))
    outbox = Finished()
    core = _core(role, clock, board, executor, outbox, tmp / "worker", policy, est, tpot, radix_cache)
    inbox = ScriptedInbox(clock, messages)
    driver = WorkerDriver(core, inbox, lambda: len(outbox.done) == len(messages) and core.idle)
    driver.run()
    core.env.timeline.flush()
    if core.cache is not None:
        rows = load_timeline(tmp / "worker")
        rows.append({"cache": core.cache.counters()})
        return rows, outbox.done
    return load_timeline(tmp / "worker"), outbox.done


def run_sim_side(role, policy, messages, peer: WorkerState | None, est, tmp, tpot, radix_cache=False):
    clock = VirtualClock()
    loop = EventLoop(clock)
    board = StateBoard(clock)
    if peer is not None:
        board.publish(role.peer, peer)
    device = SimulatedDevice(est, loop)
    executor = SimExecutor(role, device, None, clock, _finish(est))
    outbox = Finished()
    core = _core(role, clock, board, executor, outbox, tmp / "sim", policy, est, tpot, radix_cache)
    driver = SimDriver(core, loop, board)
    executor.on_step_end = driver.step_ended
    for t, msg in messages:
        req = request_from_handoff(msg) if isinstance(msg, Handoff) else request_from_generate(msg)
        loop.at(t, driver.deliver, req)
    loop.run()
    core.env.timeline.flush()
    if core.cache is not None:
        rows = load_timeline(tmp / "sim")
        rows.append({"cache": core.cache.counters()})  # the same hits and evictions on both sides
        return rows, outbox.done
    return load_timeline(tmp / "sim"), outbox.done


def decisions(rows: list[dict]) -> list[dict]:
    return [{k: (round(v, 9) if isinstance(v, float) else v) for k, v in r.items() if k != "sched_us"} for r in rows]


def _prompts(n: int, seed: int):
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(25.0)
        out.append((t, rng.randint(8, 1800), rng.randint(2, 40)))
    return out


def generate_messages(n: int, seed: int):
    return [(t, GenerateRequest(rid=f"r{i}", uid=i + 1, input_ids=[0] * p, arrival=t,
                                params=SamplingParams(max_new_tokens=o, ignore_eos=True, temperature=0)))
            for i, (t, p, o) in enumerate(_prompts(n, seed))]


def handoff_messages(n: int, seed: int):
    return [(t, Handoff(rid=f"r{i}", uid=i + 1, prompt_ids=[0] * p, output_ids=[0], page_table=[], arrival=t - 0.05,
                        first_token_time=t, params=SamplingParams(max_new_tokens=o, ignore_eos=True, temperature=0)))
            for i, (t, p, o) in enumerate(_prompts(n, seed))]


def _same(role, policy, messages, peer, est, tmp_path, tpot="60ms", radix_cache=False):
    real, real_done = run_worker_side(role, policy, messages, peer, est, tmp_path, tpot, radix_cache)
    sim, sim_done = run_sim_side(role, policy, messages, peer, est, tmp_path, tpot, radix_cache)
    assert len(real_done) == len(sim_done) == len(messages)
    assert len(real) > len(messages)  # many decisions, not a trivial trace
    assert decisions(real) == decisions(sim)
    assert [r.uid for r in real_done] == [r.uid for r in sim_done]
    return real


@pytest.mark.parametrize("policy", ["bullet", "static"])
def test_prefill_core_decides_the_same_under_both_drivers(est, tmp_path, policy):
    # decode is busy and its TPOT prediction is broken: the bullet policy shrinks, yields, hands back
    peer = WorkerState(batch_size=160, tokens_in_flight=160 * 1900, tpot_pred_p90_ms=240.0, pause_budget_ms=0.0,
                       compute_units=54)
    rows = _same(Role.PREFILL, policy, generate_messages(40, seed=3), peer, est, tmp_path)
    if policy == "bullet":
        assert len({r["reason"] for r in rows}) >= 2 and any(not r["run"] for r in rows)  # yields happened


def test_decode_core_decides_the_same_under_both_drivers(est, tmp_path):
    # prefill holds every unit mid-batch: decode pauses while its budget lasts, then shares a unit
    peer = WorkerState(batch_size=2, remaining_layers=8, tokens_in_flight=4000, compute_units=108)
    rows = _same(Role.DECODE, "bullet", handoff_messages(30, seed=5), peer, est, tmp_path, tpot="500ms")
    assert any(not r["run"] for r in rows) and any(r["run"] for r in rows)


def test_unified_core_decides_the_same_under_both_drivers(est, tmp_path):
    rows = _same(Role.UNIFIED, "chunked:512", generate_messages(40, seed=7), None, est, tmp_path)
    assert max(r["batch"] for r in rows) > 1


def test_unified_core_with_the_prefix_cache_decides_the_same_under_both_drivers(est, tmp_path):
    # every prompt is [0] * n: each one finds the longest earlier one's full pages cached
    rows = _same(Role.UNIFIED, "chunked:512", generate_messages(40, seed=7), None, est, tmp_path, radix_cache=True)
    assert rows[-1]["cache"]["cache_hit_tokens"] > 0


def test_the_hybrid_work_the_device_charges_follows_the_plan():
    from bullet.loops.unified import hybrid_items
    from bullet.policies.hybrid import Scheduled

    decode = Request(rid="d", prompt_ids=[1] * 10, params=SamplingParams(), output_ids=[5])
    decode.num_cached = 10
    chunk = Request(rid="c", prompt_ids=[1] * 300, params=SamplingParams())
    chunk.num_cached = 100
    work = hybrid_work(hybrid_items([Scheduled(decode, 1), Scheduled(chunk, 64)]))
    assert (work.batch, work.context, work.chunks) == (1, 11, ((64, 100),))
