"""When decode runs as CUDA graphs: the decision from the doctor's recorded verdicts, the record
itself, and a decode worker's forward switching between graph replays (keyed per share where the
verdict says so) and the eager runner — on the CPU, with the stand-ins of the other tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bullet.partition import cuda_driver
from bullet.partition.decode_graphs import SCRATCH_OWNER, build_graphed_decode, reserve_scratch_page
from bullet.partition.graph_policy import (
    EAGER,
    OVERRIDE_ENV,
    PER_SHARE,
    SHARED,
    GraphDecision,
    ReplayVerdict,
    decide_decode_graphs,
    decide_for_worker,
    read_replay_verdict,
    record_replay_verdict,
)
from bullet.partition.launch_stream import open_worker_partition
from bullet.shm.page_allocator import LocalPageAllocator
from engines.runner import SeqChunk
from tests.partition.test_decode_graphs import PROMPTS, RerunGraphs
from tests.partition.test_launch_stream import GPU, RecordingStreams
from tests.partition.test_libsmctrl import FakeLibSmCtrl
from tests.partition.tiny_model import PAGE_SIZE, prefill, tiny_runner

FOLLOWS = ReplayVerdict(direct=True, replay_same_partition=True, replay_after_repartition=True)
KEEPS_CAPTURE = ReplayVerdict(direct=True, replay_same_partition=True, replay_after_repartition=False)
ESCAPES = ReplayVerdict(direct=True, replay_same_partition=False, replay_after_repartition=False)
BROKEN = ReplayVerdict(direct=False, replay_same_partition=False)


@pytest.mark.parametrize("backend, verdict, override, mode", [
    ("libsmctrl", FOLLOWS, None, SHARED),
    ("libsmctrl", KEEPS_CAPTURE, None, PER_SHARE),
    ("libsmctrl", ESCAPES, None, EAGER),        # MuxWise's report: masks do not reach replays
    ("libsmctrl", ESCAPES, "on", EAGER),        # "on" never overrides a measured escape
    ("libsmctrl", BROKEN, None, EAGER),
    ("libsmctrl", None, None, EAGER),           # nothing measured: eager, and the reason says to run the doctor
    ("libsmctrl", None, "on", PER_SHARE),
    ("green-ctx", None, None, PER_SHARE),       # documented behaviour until the doctor says otherwise
    ("green-ctx", ReplayVerdict(True, False), None, EAGER),
    ("green-ctx", ReplayVerdict(True, True), None, PER_SHARE),
    ("none", None, None, SHARED),
    ("none", None, "off", EAGER),
    ("libsmctrl", FOLLOWS, "off", EAGER),
])
def test_decision_table(backend, verdict, override, mode):
    decision = decide_decode_graphs(backend, "cuda", verdict, override)
    assert decision.mode == mode, decision.reason
    assert decision.enabled == (mode != EAGER)


def test_no_graphs_on_a_cpu_and_reasons_say_what_to_do():
    assert decide_decode_graphs("cpu", "cpu", None).mode == EAGER
    assert "run `bullet doctor`" in decide_decode_graphs("libsmctrl", "cuda", None).reason
    with pytest.raises(ValueError, match=OVERRIDE_ENV):
        decide_decode_graphs("none", "cuda", None, "maybe")


def test_verdicts_are_recorded_per_gpu_and_driver(tmp_path):
    path = tmp_path / "verdicts.json"
    record_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, KEEPS_CAPTURE, path)
    record_replay_verdict("green-ctx", "NVIDIA H100 80GB HBM3", 12080, ReplayVerdict(True, True), path)
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) == KEEPS_CAPTURE
    assert read_replay_verdict("green-ctx", "NVIDIA H100 80GB HBM3", 12080, path).replay_same_partition
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12090, path) is None  # driver changed
    assert read_replay_verdict("libsmctrl", "NVIDIA A100-SXM4-80GB", 12080, path) is None
    record_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, ESCAPES, path)  # re-measured
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) == ESCAPES
    path.write_text("{not json")
    assert read_replay_verdict("libsmctrl", "NVIDIA H100 80GB HBM3", 12080, path) is None


def test_a_worker_reads_the_record_of_its_gpu(tmp_path, monkeypatch):
    import bullet.partition.graph_policy as policy

    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(policy, "current_device_identity", lambda device=None: ("GPU-X", 12060))
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert decide_for_worker("libsmctrl", GPU).mode == EAGER
    record_replay_verdict("libsmctrl", "GPU-X", 12060, FOLLOWS)
    assert decide_for_worker("libsmctrl", GPU).mode == SHARED
    monkeypatch.setenv(OVERRIDE_ENV, "off")
    assert decide_for_worker("libsmctrl", GPU).mode == EAGER


# ---- the decode worker's forward ------------------------------------------------------------------

@pytest.fixture(scope="module")
def smctrl(build_c):
    return FakeLibSmCtrl(build_c("fake_libsmctrl.c", "libsmctrl_graph_test.so"))


@pytest.fixture
def decode_worker(smctrl, monkeypatch):
    """A decode worker's pieces on the CPU: libsmctrl (fake) on a recorded stream, a tiny model with
    four prompts prefilled, the local page allocator standing in for the shared one."""
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: None)
    smctrl.set_tpcs(54)
    api = RecordingStreams()
    backend, stream = open_worker_partition("libsmctrl", "decode", GPU, {"library": smctrl.path}, api=api)
    runner = tiny_runner(pages=64)
    allocator = LocalPageAllocator(64, PAGE_SIZE)
    tables = prefill(runner, PROMPTS, first_page=0)
    allocator.alloc(sum(len(t) for t in tables), owner=1)  # the prompts' pages
    chunks = [SeqChunk([5], len(p), t) for p, t in zip(PROMPTS, tables)]
    return SimpleNamespace(backend=backend, stream=stream, runner=runner, allocator=allocator, chunks=chunks)


def build(w, mode):
    return build_graphed_decode(w.runner, w.stream, GraphDecision(mode, "test"), w.allocator, max_batch=8,
                                graph_api_factory=RerunGraphs)


def test_per_share_graphs_are_keyed_by_the_share_in_force(decode_worker):
    w = decode_worker
    decode = build(w, PER_SHARE)
    for units in (20, 20, 40, 20):
        w.backend.apply(units)
        with w.stream.step():
            decode(w.chunks)
    keys = [key for _, key in decode.graphs.captured]
    handle = w.stream.handle()
    assert keys == [(handle, 40), (handle, 20)]  # one graph per share (LRU order), replayed when it returns
    assert (decode.graphs.captures, decode.graphs.replays, decode.graph_steps) == (2, 4, 4)


def test_shared_graphs_ignore_the_share_and_eager_uses_none(decode_worker):
    w = decode_worker
    shared = build(w, SHARED)
    for units in (20, 40):
        w.backend.apply(units)
        shared(w.chunks)
    assert shared.graphs.captures == 1 and shared.graphs.captured[0][1] is None
    eager = build(w, EAGER)
    assert eager.graphs is None
    eager(w.chunks)
    assert eager.eager_steps == 1


def test_steps_without_a_bucket_fall_back_to_eager(decode_worker):
    w = decode_worker
    decode = build(w, SHARED)
    out = decode([SeqChunk([1, 2], 0, w.chunks[0].page_table)])  # a prompt chunk is no decode step
    assert decode.eager_steps == 1 and decode.graph_steps == 0 and out.last_logits.shape[0] == 1


def test_graph_and_eager_workers_decode_the_same_tokens(decode_worker):
    w = decode_worker
    kv = w.runner.kv.tensor.clone()
    graph = build(w, PER_SHARE)(w.chunks).last_logits.argmax(-1)
    w.runner.kv.tensor.copy_(kv)
    eager = w.runner.forward(w.chunks).last_logits.argmax(-1)
    assert graph.tolist() == eager.tolist()


def test_the_scratch_page_is_reserved_once_per_instance(decode_worker):
    w = decode_worker
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
