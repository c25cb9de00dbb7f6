"""Priority scheduling (`--enable-priority-scheduling`, a request's `priority`): under every policy a
waiting request with a higher priority is admitted and prefilled before one with a lower priority,
and equal priorities keep arrival order. The loop cores run here as a worker runs them — the real
core, policy and queue, fed `GenerateRequest` messages — on a manual clock whose steps cost what
the simulated H200 charges, so the order is exact, not a timing."""

from __future__ import annotations

from collections import deque

import pytest

from bullet.config import ServerArgs
from bullet.loops.base import LoopEnv
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline
from bullet.policies.hybrid import HybridScheduler
from bullet.policies.intensity import ridge_token_limit
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.sim.board import StateBoard
from bullet.sim.config import SimConfig, device_estimator, policy_estimator
from bullet.sim.device import SimulatedDevice
from bullet.sim.events import EventLoop, VirtualClock
from bullet.sim.partition import SimulatedPartition
from bullet.types.messages import GenerateRequest, Handoff, Recompute, decode, encode
from bullet.types.request import Request, enqueue, priority_first
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from bullet.workers.driver import WorkerDriver
from bullet.workers.outbox import MessageOutbox, request_from_generate, request_from_handoff, request_from_recompute
from engines.sampling_params import SamplingParams
from tests.loops.test_decision_trace import Finished, ManualClock, ScriptedExecutor, ScriptedInbox, _finish

PAGES = 4096


def _req(rid: str, priority: int = 0) -> Request:
    return Request(rid=rid, prompt_ids=[1], params=SamplingParams(), priority=priority)


def test_the_queue_is_by_priority_then_arrival():
    q: deque = deque()
    for rid, p in [("a", 0), ("b", 0), ("c", 5), ("d", 1), ("e", 5), ("f", -1)]:
        enqueue(q, _req(rid, p))
    assert [r.rid for r in q] == ["c", "e", "d", "a", "b", "f"]
    enqueue(q, _req("g", 1), front=True)  # a preempted request: ahead of its equals, behind higher ones
    assert [r.rid for r in q] == ["c", "e", "g", "d", "a", "b", "f"]
    same: list = []
    for rid in "xyz":
        enqueue(same, _req(rid))
    assert [r.rid for r in same] == list("xyz")  # all 0: first come, first served, as before


def test_a_policy_order_stays_under_the_priority_order():
    reqs = [_req("short-low"), _req("long-high", 2), _req("mid-low"), _req("mid-high", 2)]
    assert [r.rid for r in priority_first(reqs)] == ["long-high", "mid-high", "short-low", "mid-low"]


def test_priority_crosses_the_process_boundary():
    params = SamplingParams(max_new_tokens=3)
    msg = decode(encode(GenerateRequest(rid="r", uid=1, input_ids=[1, 2], params=params, arrival=0.0, priority=9)))
    req = request_from_generate(msg)
    assert req.priority == 9

    class Sent:
        def __init__(self):
            self.msgs = []

        def send_handoff(self, m):
            self.msgs.append(m)

        send_recompute = send_handoff

        def send_outputs(self, outs):
            pass

    io = Sent()
    outbox = MessageOutbox(io, "prefill")
    req.first_token_time, req.output_ids = 0.1, [5]
    outbox.handed_off(req)
    outbox.recompute(req)
    handoff, recompute = (decode(encode(m)) for m in io.msgs)
    assert isinstance(handoff, Handoff) and isinstance(recompute, Recompute)
    assert request_from_handoff(handoff).priority == request_from_recompute(recompute).priority == 9


# -- the real cores and policies -----------------------------------------------------------------

@pytest.fixture(scope="module")
def est():
    return device_estimator(SimConfig())


def _run(policy: str, messages, est, tmp_path) -> list[str]:
    """The rids in the order the worker core finished prefilling them (a prefill worker hands each
    to decode; the chunked worker, with max_new_tokens 1, finishes it)."""
    args = ServerArgs(policy=policy, max_total_tokens=PAGES * 16, partition_backend="none",
                      disable_radix_cache=True, max_running_requests=1 << 20, enable_priority_scheduling=True)
    role = Role.UNIFIED if policy.startswith(("chunked", "sglang")) else Role.PREFILL
    clock = ManualClock()
    board = StateBoard(clock)
    if role is Role.PREFILL:
        board.publish(role.peer, WorkerState())  # decode idle
    partition = SimulatedPartition(role.partition_side, est.hardware)
    executor = ScriptedExecutor(role, SimulatedDevice(est, EventLoop(VirtualClock())), None, clock, _finish(est))
    executor.partition = partition
    outbox = Finished()
    env = LoopEnv(role=role, clock=clock, state=board, allocator=LocalPageAllocator(PAGES, 16), partition=partition,
                  timeline=Timeline(str(tmp_path), role.value), executor=executor, outbox=outbox)
    predictor = policy_estimator(SimConfig(), est) if args.uses_estimator else None
    limit = ridge_token_limit(est.model, est.hardware, est.dtype) if args.uses_estimator else None
    core = build_core(env, args, est.model.num_hidden_layers, predictor, limit)
    WorkerDriver(core, ScriptedInbox(clock, messages), lambda: len(outbox.done) == len(messages) and core.idle).run()
    return [r.rid for r in outbox.done]


def _busy_then(low: int, high: int):
    """A long prompt starts; while it prefills, 'low' arrives, then 'high' — longer, so that a
    shortest-first order alone would take 'low' first, and too long to share a prefill batch with
    it (2000 + 3000 tokens, of at most 4096)."""
    def msg(t, rid, uid, priority, tokens):
        return t, GenerateRequest(rid=rid, uid=uid, input_ids=[0] * tokens, arrival=t, priority=priority,
                                  params=SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0))
    return [msg(0.0, "busy", 1, 0, 3000), msg(0.0005, "low", 2, low, 2000), msg(0.001, "high", 3, high, 3000)]


POLICIES = ["static", "bullet", "partition-only", "scheduler-only", "chunked:64", "sglang:64"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_higher_priority_is_prefilled_first(policy, est, tmp_path):
    assert _run(policy, _busy_then(low=0, high=5), est, tmp_path / "p") == ["busy", "high", "low"]


@pytest.mark.parametrize("policy", ["static", "bullet", "chunked:64"])
def test_equal_priorities_keep_arrival_order(policy, est, tmp_path):
    assert _run(policy, _busy_then(low=3, high=3), est, tmp_path / "p") == ["busy", "low", "high"]


def test_the_chunked_scheduler_resumes_a_preempted_request_behind_higher_priorities():
    alloc = LocalPageAllocator(64, 16)
    sched = HybridScheduler(alloc, token_budget=4096, max_running=8)
    running = _req("running", 0)
    sched.add(running)
    sched.schedule()
    sched.add(_req("waiting-high", 4))
    assert sched._preempt_newest(keep=None)
    assert [r.rid for r in sched.waiting] == ["waiting-high", "running"]


def test_a_lower_priority_does_not_preempt_ahead_of_a_higher_one():
    """Bullet's layer-boundary preemption lets a short prompt that would miss its TTFT run ahead of
    the batch in flight — but not ahead of a waiting request of higher priority (which can wait)."""
    from tests.policies.fakes import inflight, prefill_view, req
    from tests.policies.test_bullet_policies import K, policy

    batch = inflight([req("long", 2000, 0.0)], layers_done=K)
    short = req("short", 50, 0.04)  # misses its 150 ms target behind the long batch: it would preempt
    assert policy(ttft="3ms/token").decide(prefill_view(0.05, [short], inflight=batch)).admit == [short]
    queue: list = []
    for r, p in ((req("short", 50, 0.04), 0), (req("patient", 50, 0.045), 1)):
        r.priority = p
        enqueue(queue, r)
    patient = queue[0]
    d = policy(ttft="3ms/token").decide(prefill_view(0.05, queue, inflight=batch))
    assert patient.rid == "patient" and "short" not in [r.rid for r in d.admit]
