"""A worker's decode graphs, on the CPU: captured at start-up for every share its decode policy may pick
(on each share's own stream), replayed while serving without a single capture, eager where no graph
was captured — for the decode worker and for the unified worker of `chunked`/`sglang`, whose
decode-only hybrid steps replay while its mixed steps run eagerly. Streams are the recording fake,
green contexts the fake driver, graphs the re-running fake, the model the tiny paged Llama."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from bullet.config import ServerArgs
from bullet.loops.base import LoopEnv
from bullet.loops.clock import MonotonicClock
from bullet.loops.factory import build_core
from bullet.loops.timeline import Timeline
from bullet.partition.decode_graphs import SCRATCH_OWNER, build_graphed_decode, plan_capture, reserve_scratch_page
from bullet.partition.graph_policy import EAGER, PER_SHARE, SHARED, GraphDecision
from bullet.partition.launch_stream import open_worker_partition
from bullet.policies.views import InflightPrefill
from bullet.shm.page_allocator import LocalPageAllocator
from bullet.types.finish import FinishChecker
from bullet.types.request import Request
from bullet.types.roles import Role
from bullet.types.worker_state import WorkerState
from bullet.workers.executor import ModelExecutor
from engines.model.paged_attention import TorchPagedKernels
from engines.runner import SeqChunk
from engines.sampling_params import SamplingParams
from tests.partition.fake_cuda import GPU, FakeCuda, RecordingStreams
from tests.partition.graph_fakes import RerunGraphs
from tests.partition.test_green_ctx import FakeDriver
from tests.partition.tiny_model import PAGE_SIZE, prefill, tiny_runner

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]]
SHARES = [8, 16, 24, 32]  # the green-context pool of the fake 32-SM GPU
BUCKETS = (1, 2, 4, 8)  # max_batch 8


class StreamGraphs(RerunGraphs):
    """Also records the stream current at each capture."""

    def __init__(self, streams: RecordingStreams):
        super().__init__()
        self.streams, self.capture_streams = streams, []

    def capture(self, body):
        self.capture_streams.append(self.streams.current_handle())
        return super().capture(body)


@pytest.fixture
def worker():
    """A decode worker's pieces: green contexts on a fake 32-SM GPU (a pool of 4 shares, decode on 16),
    the tiny paged model with three prompts prefilled, a local page allocator."""
    api = RecordingStreams()
    backend, stream = open_worker_partition("green-ctx", "decode", GPU, {"driver": FakeDriver(32, 8, 8)},
                                            FakeCuda(streams=api))
    backend.apply(16)
    runner = tiny_runner(pages=64, paged=True)
    allocator = LocalPageAllocator(64, PAGE_SIZE)
    tables = prefill(runner, PROMPTS)
    allocator.alloc(sum(len(t) for t in tables), owner=1)  # the prompts' pages
    chunks = [SeqChunk([5], len(p), t) for p, t in zip(PROMPTS, tables)]
    yield SimpleNamespace(api=api, backend=backend, stream=stream, runner=runner, allocator=allocator, chunks=chunks)
    backend.close()


def build(w, mode, shares=None, max_graphs=256):
    graphs = StreamGraphs(w.api)
    decode = build_graphed_decode(w.runner, w.stream, GraphDecision(mode, "test"), w.allocator, max_batch=8,
                                  graph_api_factory=lambda: graphs, shares=shares, max_graphs=max_graphs)
    return decode, graphs


def pool_handle(w, units):
    return w.backend.pool_streams()[units]


def serve(w, decode, units):
    w.backend.apply(units)
    with w.stream.step():
        return decode(w.chunks)


def test_per_share_graphs_are_all_captured_at_start_up_each_on_its_shares_stream(worker):
    w = worker
    decode, api = build(w, PER_SHARE)
    graphs = decode.graphs
    expected = {(b, (pool_handle(w, u), u)) for u in SHARES for b in BUCKETS}
    assert {(shape.batch, key) for shape, key in graphs.captured} == expected
    assert graphs.captures == len(expected) == 16
    # the batch-8 graph of share 8 was captured on share 8's green-context stream, and so on
    assert api.capture_streams == [pool_handle(w, u) for u in SHARES for _ in BUCKETS]
    assert w.backend.current_units == 16  # the share in force before is back
    for units in (8, 32, 16, 8):  # serving: every step a replay on its share's graph, no capture
        serve(w, decode, units)
    assert (graphs.captures, graphs.replays, decode.graph_steps, decode.eager_steps) == (16, 4, 4, 0)


def test_a_fixed_split_captures_its_one_share_and_other_shares_decode_eagerly(worker, caplog):
    w = worker
    decode, _ = build(w, PER_SHARE, shares=[w.backend.current_units])
    assert {key for _, key in decode.graphs.captured} == {(pool_handle(w, 16), 16)}
    serve(w, decode, 16)
    with caplog.at_level(logging.WARNING, logger="bullet.partition.graphs"):
        serve(w, decode, 24)
        serve(w, decode, 24)
    assert (decode.graph_steps, decode.eager_steps, decode.missed, decode.graphs.captures) == (1, 2, 2, 4)
    assert caplog.text.count("no decode graph captured") == 1  # said once, not per step


def test_the_capture_plan_fits_max_graphs():
    assert plan_capture([8, 16], BUCKETS, 8) == plan_capture([8, 16, 8], BUCKETS, 8)  # duplicates count once
    assert plan_capture([8, 16], BUCKETS, 8).buckets == BUCKETS and not plan_capture([8, 16], BUCKETS, 8).note
    thinned = plan_capture([8, 16, 24], BUCKETS, 7)  # 2 buckets per share fit
    assert thinned.buckets == (1, 8) and thinned.shares == (8, 16, 24) and "exceed max_graphs=7" in thinned.note
    few = plan_capture([8, 16, 24], BUCKETS, 2)  # not even one bucket per share: the first shares get one
    assert few.shares == (8, 16) and few.buckets == (8,) and few.graphs == 2
    assert plan_capture([], BUCKETS, 3).buckets == (1, 4, 8)  # shared mode: one set


def test_too_many_graphs_keep_fewer_buckets_and_say_so(worker, caplog):
    w = worker
    with caplog.at_level(logging.WARNING, logger="bullet.partition.graphs"):
        decode, _ = build(w, PER_SHARE, max_graphs=10)
    assert "exceed max_graphs=10" in caplog.text
    graphs = decode.graphs
    assert graphs.batch_buckets == (1, 8) and graphs.captures == 8
    serve(w, decode, 32)  # 3 rows: padded to the batch-8 graph
    assert decode.graph_steps == 1 and graphs.captures == 8 and graphs.evictions == 0


def test_capture_shares_narrows_and_widens_the_set_held(worker):
    """The hook a policy that changes its shares calls between steps: exactly these shares' graphs."""
    w = worker
    decode, _ = build(w, PER_SHARE)
    graphs = decode.graphs
    plan = decode.capture_shares([8, 24])
    assert plan.shares == (8, 24) and graphs.captures == 16  # held already: nothing captured
    assert {key[1] for _, key in graphs.captured} == {8, 24}
    decode.capture_shares([8, 24, 32])
    assert graphs.captures == 20 and {key[1] for _, key in graphs.captured} == {8, 24, 32}
    serve(w, decode, 16)  # released: eager
    assert decode.missed == 1 and w.backend.current_units == 16


def test_shared_graphs_serve_every_share_and_eager_has_none(worker):
    w = worker
    decode, api = build(w, SHARED)
    assert [key for _, key in decode.graphs.captured] == [None] * 4
    assert set(api.capture_streams) == {pool_handle(w, 16)}  # on the share in force
    for units in (8, 32):
        serve(w, decode, units)
    assert decode.graphs.captures == 4 and decode.graph_steps == 2
    eager, _ = build(w, EAGER)
    assert eager.graphs is None and eager.capture_shares() is None
    serve(w, eager, 16)
    assert eager.eager_steps == 1


def test_kernels_that_read_the_host_turn_graphs_off_with_a_log_line(worker, caplog):
    w = worker
    cuda_runner = SimpleNamespace(paged=True, kernels=TorchPagedKernels(), device=torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="bullet.partition.graphs"):
        decode = build_graphed_decode(cuda_runner, w.stream, GraphDecision(SHARED, "test"), w.allocator, max_batch=8)
    assert decode.graphs is None and decode.decision.mode == EAGER
    assert "decode graphs: off" in caplog.text and "triton" in caplog.text
    assert w.allocator.num_free() == 64 - sum(len(c.page_table) for c in w.chunks)  # no scratch page taken


def test_steps_without_a_bucket_fall_back_to_eager(worker):
    w = worker
    decode, _ = build(w, SHARED)
    out = decode([SeqChunk([1, 2], 0, w.chunks[0].page_table)])  # a prompt chunk is no decode step
    assert decode.eager_steps == 1 and decode.graph_steps == 0 and decode.missed == 0
    assert out.last_logits.shape[0] == 1


def test_graph_and_eager_workers_decode_the_same_tokens(worker):
    w = worker
    kv = w.runner.kv.tensor.clone()
    decode, _ = build(w, PER_SHARE)
    graph = serve(w, decode, 24).last_logits.argmax(-1)
    w.runner.kv.tensor.copy_(kv)
    eager = w.runner.forward(w.chunks).last_logits.argmax(-1)
    assert graph.tolist() == eager.tolist()


def test_the_scratch_page_is_reserved_once_per_instance(worker):
    w = worker
    free = w.allocator.num_free()
    build(w, SHARED)
    assert w.allocator.num_free() == free - 1

    class Shared(LocalPageAllocator):  # the shared allocator can list an owner's pages
        def pages_of(self, owner):
            return [p for p, o in enumerate(self._owner) if o == owner]

    shared = Shared(8, PAGE_SIZE)
    first = reserve_scratch_page(shared)
    assert reserve_scratch_page(shared) == first  # a restarted worker reuses it
    assert shared.num_free() == 7 and shared.pages_of(SCRATCH_OWNER) == [first]


def requests(prompts, max_new_tokens=6):
    return [Request(rid=str(i), prompt_ids=list(p), params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens,
                                                                          ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_a_decode_step_replays_even_where_the_policy_yields_between_layers(worker):
    """On a GPU a decode step is one replay: the between-layers hook of the SLO-aware policies
    (a CPU worker's mid-step yield) must not force it onto the layer-by-layer runner."""
    w = worker
    decode, _ = build(w, SHARED)
    executor = ModelExecutor(w.runner, FinishChecker(None, set(), 512), w.stream, decode)
    calls = []
    reqs = requests([[5, 6, 7, 8, 9], [10, 11]])
    for r, t in zip(reqs, [[40, 41], [42]]):
        r.page_table = t
    executor.run_prefill(InflightPrefill(reqs, 0, 2, 0.0), 2, reqs, lambda s: None)
    for r in reqs:
        r.num_cached = len(r.prompt_ids)
    executor.run_decode(reqs, lambda s: None, calls.append)
    assert decode.graph_steps == 1 and calls == []
    assert all(len(r.output_ids) == 2 for r in reqs)


# ---- the unified worker (`chunked`, `sglang`) ---------------------------------------------------------

class _NoPeer:
    def publish(self, role, state):
        pass

    def read(self, role):
        return WorkerState()


class _Discard:
    """Outbox of a worker whose outputs the test reads off the requests themselves."""

    def __getattr__(self, name):
        return lambda *args: None


class HybridSteps(ModelExecutor):
    """Records whether each hybrid step held only decodes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.decode_only = []

    def run_hybrid(self, items, on_done):
        self.decode_only.append(all(i.num_tokens == 1 and i.logits == "last" for i in items))
        super().run_hybrid(items, on_done)


def run_unified(policy: str, gpu: bool):
    """Serve three prompts on a unified worker to the end; returns (tokens, executor, decode)."""
    runner = tiny_runner(pages=64, paged=True)
    allocator = LocalPageAllocator(64, PAGE_SIZE)
    api = RecordingStreams()
    partition, stream = open_worker_partition("none", "prefill", GPU if gpu else torch.device("cpu"),
                                              {"total_units": 132 if gpu else 2}, FakeCuda(streams=api))
    decode = build_graphed_decode(runner, stream, GraphDecision(SHARED, "test"), allocator, max_batch=8,
                                  graph_api_factory=RerunGraphs) if gpu else None
    executor = HybridSteps(runner, FinishChecker(None, set(), 512), stream if gpu else None, decode)
    args = ServerArgs(policy=policy, max_running_requests=8, disable_radix_cache=True)
    env = LoopEnv(role=Role.UNIFIED, clock=MonotonicClock(), state=_NoPeer(), allocator=allocator,
                  partition=partition, timeline=Timeline(None, "unified"), executor=executor, outbox=_Discard())
    core = build_core(env, args, runner.model.num_layers)
    reqs = requests(PROMPTS)
    for r in reqs:
        core.add(r)
    captured = decode.graphs.captures if gpu else 0
    for _ in range(100):
        if core.idle:
            break
        core.iterate()
    assert core.idle and all(r.finished for r in reqs)
    if gpu:
        assert decode.graphs.captures == captured  # all at start-up, none while serving
    return [r.output_ids for r in reqs], executor, decode


@pytest.mark.parametrize("policy", ["chunked:8", "sglang:8"])
def test_a_unified_worker_replays_its_decode_only_steps_and_runs_mixed_steps_eagerly(policy):
    tokens, executor, decode = run_unified(policy, gpu=True)
    steps = executor.decode_only
    assert steps.count(False) >= 2 and steps.count(True) >= 4  # prompt chunks (11 tokens > budget 8), then decodes
    assert decode.graph_steps == steps.count(True) and decode.eager_steps == 0
    assert decode.graphs.replays == decode.graph_steps
    eager_tokens, _, _ = run_unified(policy, gpu=False)
    assert tokens == eager_tokens and all(len(t) == 6 for t in tokens)
