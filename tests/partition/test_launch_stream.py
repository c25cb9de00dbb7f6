"""A worker's steps run on the stream its partition restricts — checked without a GPU.

CUDA streams are replaced by a recording `StreamApi` (the only thing `WorkerStream` touches), the
libsmctrl library by the fake compiled from `fake_libsmctrl.c` (it reports the stream handle its
mask call received), and green contexts by the fake driver of `test_green_ctx.py`. The model is a
real tiny Llama on the CPU and the executor the real `ModelExecutor`: a torch dispatch mode records,
for every operator of every step — layers, KV writes, sampling — which stream was current."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bullet.partition import cuda_driver
from bullet.partition.launch_stream import WorkerStream, open_worker_partition
from bullet.policies.views import InflightPrefill
from bullet.types.finish import FinishChecker
from bullet.types.request import Request
from bullet.workers.executor import ModelExecutor
from engines.sampling_params import SamplingParams
from tests.partition.fake_cuda import GPU, LEGACY_DEFAULT_STREAM, FakeCuda, RecordingStreams
from tests.partition.test_gpu_helper import cuda_include, fake_cuda, helper  # noqa: F401 (fixtures)
from tests.partition.test_green_ctx import FakeDriver
from tests.partition.test_libsmctrl import FakeLibSmCtrl
from tests.partition.tiny_model import PAGE_SIZE, tiny_runner

class StreamAudit(TorchDispatchMode):
    """Every aten operator run inside, with the stream that was current when it ran."""

    def __init__(self, api: RecordingStreams):
        super().__init__()
        self.api, self.ops = api, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, self.api.current_handle()))
        return func(*args, **(kwargs or {}))

    def streams(self) -> set[int]:
        return {handle for _, handle in self.ops}

    def names(self) -> set[str]:
        return {name for name, _ in self.ops}


@pytest.fixture(scope="module")
def smctrl(build_c):
    return FakeLibSmCtrl(build_c("fake_libsmctrl.c", "libsmctrl_stream_test.so"))


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    monkeypatch.setattr(cuda_driver, "cuda_driver_version", lambda: None)


def requests(prompts, sampled=()):
    """One request per prompt, greedy unless its index is in `sampled`; disjoint page tables."""
    reqs, page = [], 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0 if i in sampled else 0, max_new_tokens=8, ignore_eos=True)
        pages = -(-(len(prompt) + 8) // PAGE_SIZE)
        reqs.append(Request(rid=str(i), prompt_ids=list(prompt), params=params,
                            page_table=list(range(page, page + pages))))
        page += pages
    return reqs


def run_prefill_then_decode(executor, reqs, audit, between=lambda: None):
    """A layer-wise prefill in two steps, then two decode steps; `between` runs between steps
    (where a worker repartitions). Returns the step times the executor reported."""
    seconds = []
    batch = InflightPrefill(reqs, 0, executor.runner.model.num_layers, 0.0)
    with audit:
        executor.run_prefill(batch, 1, None, seconds.append)
    batch.layers_done = 1
    between()
    with audit:
        executor.run_prefill(batch, 1, reqs, seconds.append)
    for req in reqs:
        req.num_cached = len(req.prompt_ids)
    for _ in range(2):
        between()
        with audit:
            executor.run_decode(reqs, seconds.append)
    return seconds


def test_libsmctrl_masks_the_workers_own_stream_and_every_kernel_runs_on_it(smctrl):
    smctrl.set_tpcs(66)  # H100: the 128-bit call
    api = RecordingStreams()
    backend, stream = open_worker_partition("libsmctrl", "decode", GPU, {"library": smctrl.path}, FakeCuda(streams=api))
    backend.apply(32)
    kind, masked, _ = smctrl.last()
    assert kind == "stream_ext"
    assert masked == stream.handle() == api.created[0].handle != LEGACY_DEFAULT_STREAM
    runner = tiny_runner()
    executor = ModelExecutor(runner, FinishChecker(None, set(), 512), stream)
    reqs = requests([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], sampled={0, 1})
    audit = StreamAudit(api)

    def repartition():  # the policy changes the share between steps: same stream, new mask
        backend.apply(backend.current_units + 2)
        assert smctrl.last()[1] == masked

    seconds = run_prefill_then_decode(executor, reqs, audit, repartition)
    assert audit.streams() == {masked}, "an operator ran outside the masked stream"
    # the audit saw the model, the paged KV write and sampling (greedy and multinomial)
    assert {"embedding", "linear", "index_copy_", "scaled_dot_product_attention", "argmax",
            "multinomial"} <= audit.names()
    assert len(seconds) == 4 and all(s > 0 for s in seconds)
    # each step waited for its stream before its time was read, and again on leaving it
    assert api.synchronized.count(masked) >= 8
    assert all(len(r.output_ids) == 3 for r in reqs)  # one token from prefill, two from decode


def test_before_this_worker_masked_the_default_stream():
    """What the libsmctrl backend refuses: a fresh worker's current stream is the default one."""
    from bullet.partition import PartitionUnavailable, make_backend

    with pytest.raises(PartitionUnavailable, match="default stream"):
        make_backend("libsmctrl", "decode", stream=LEGACY_DEFAULT_STREAM, library="/nonexistent")


def test_green_context_repartition_switches_the_step_stream():
    drv = FakeDriver(132, min_partition=8, alignment=8)
    api = RecordingStreams()
    backend, stream = open_worker_partition("green-ctx", "prefill", GPU, {"driver": drv}, FakeCuda(streams=api))
    assert api.created == []  # the pool's streams are the only ones
    runner = tiny_runner()
    executor = ModelExecutor(runner, FinishChecker(None, set(), 512), stream)
    shares = iter([20, 68, 36])  # prefill's shares: its first groups and the 4-SM remainder
    seen = []
    audit = StreamAudit(api)

    def repartition():
        backend.apply(next(shares))
        seen.append((stream.handle(), backend.current_units))

    backend.apply(12)
    seen.append((stream.handle(), 12))
    run_prefill_then_decode(executor, requests([[1, 2, 3], [4, 5, 6, 7]]), audit, repartition)
    handles = [h for h, _ in seen]
    assert len(set(handles)) == 4  # a different pool stream for every share
    for handle, units in seen:
        # prefill's green context holds its first groups (SMs 0..) and the remainder (128-131)
        assert drv.streams[handle] == set(range(units - 4)) | set(range(128, 132))
    # the four steps ran, in order, on the four shares' streams — and on nothing else
    launched = [h for i, (_, h) in enumerate(audit.ops) if i == 0 or audit.ops[i - 1][1] != h]
    assert launched == handles
    assert stream.share_key() == (handles[-1], 36)


def test_a_cpu_worker_has_no_stream(monkeypatch):
    _, stream = open_worker_partition("none", "decode", torch.device("cpu"), {"total_units": 4})
    assert not stream.on_gpu and stream.current() is None and stream.handle() is None
    with stream.step() as s:
        assert s is None
    stream.synchronize()  # nothing to wait for


def test_unpartitioned_gpu_worker_still_runs_on_its_own_stream(monkeypatch):
    api = RecordingStreams()
    backend, stream = open_worker_partition("none", "decode", GPU, {"total_units": 132, "unit_kind": "SM"},
                                            FakeCuda(streams=api))
    with stream.step():
        assert api.current_handle() == api.created[0].handle != LEGACY_DEFAULT_STREAM
    assert backend.total_units == 132


def test_a_backend_without_a_stream_and_no_own_stream_is_an_error():
    drv = FakeDriver(132, 8, 8)
    api = RecordingStreams()
    backend, _ = open_worker_partition("green-ctx", "decode", GPU, {"driver": drv}, FakeCuda(streams=api))
    broken = WorkerStream(SimpleNamespace(name="x", launch_stream=lambda: None, current_units=1), api)
    with pytest.raises(RuntimeError, match="names no stream"):
        broken.current()
    backend.close()


STEP_STREAMS_THROUGH_THE_HELPER = r"""
import ctypes, json, sys
import torch
from bullet.partition.gpu_helper import GpuPartitionHelper
from bullet.partition.launch_stream import open_worker_partition
from tests.partition.fake_cuda import FakeCuda, RecordingStreams
helper, fake = GpuPartitionHelper(sys.argv[1]), ctypes.CDLL(sys.argv[2])
fake.fake_stream_sms.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint]
api = RecordingStreams()
backend, stream = open_worker_partition("green-ctx", "decode", torch.device("cuda", 0), {"driver": helper},
                                        FakeCuda(streams=api))
out = []
for units in (24, 64, 132, 8):
    backend.apply(units)
    with stream.step():
        handle = api.current_handle()
    buf = (ctypes.c_uint * 256)()
    n = fake.fake_stream_sms(handle, buf, 256)
    out.append([units, handle, list(buf[:n]), sorted(backend.unit_set())])
backend.close()
print(json.dumps(out))
"""


def test_green_context_step_streams_are_the_drivers_green_streams(helper, fake_cuda):
    """Through the real C helper and the fake libcuda: the stream a step makes current is a
    green-context stream whose SMs are exactly the share the backend reports."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "BULLET_LIBCUDA": str(fake_cuda()), "FAKE_CUDA_SMS": "132", "FAKE_CUDA_MIN": "8",
           "FAKE_CUDA_ALIGN": "8", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", STEP_STREAMS_THROUGH_THE_HELPER, str(helper), str(fake_cuda())],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)
    assert len({handle for _, handle, _, _ in steps}) == 4
    for units, _, sms, unit_set in steps:
        expected = list(range(132)) if units == 132 else list(range(128 - units, 128))  # decode: the last groups
        assert sms == expected and unit_set == expected


def test_the_profilers_share_control_masks_each_roles_own_stream(smctrl):
    """`PartitionShares` (what `bullet profile --device cuda` hands the estimator): inside
    `use(role, units)` the current stream is that role's masked stream, with that role's mask."""
    import functools
    import pickle

    from bullet.partition.share_control import PartitionShares
    from bullet.partition.tpc_mask import enabled_tpcs

    smctrl.set_tpcs(54)
    api = RecordingStreams()
    shares = PartitionShares("libsmctrl", cuda=FakeCuda(streams=api), library=smctrl.path)
    assert shares.total_units == 108 and shares.feasible("decode") == list(range(2, 109, 2))
    prefill_stream, decode_stream = (shares.stream_of(r).handle() for r in ("prefill", "decode"))
    assert prefill_stream != decode_stream and LEGACY_DEFAULT_STREAM not in (prefill_stream, decode_stream)
    with shares.use("decode", 20):
        assert api.current_handle() == decode_stream
        _, masked, mask = smctrl.last()
        assert masked == decode_stream and enabled_tpcs(mask, 54) == list(range(44, 54))
    with shares.use("prefill", 88):
        assert api.current_handle() == prefill_stream
        _, masked, mask = smctrl.last()
        assert masked == prefill_stream and enabled_tpcs(mask, 54) == list(range(44))
    assert api.current_handle() == LEGACY_DEFAULT_STREAM  # nothing left current after a block
    assert api.synchronized[-1] == prefill_stream  # the block waited for its kernels
    shares.close()
    # the co-running process rebuilds it from a pickled factory
    factory = pickle.loads(pickle.dumps(functools.partial(PartitionShares, "libsmctrl", library=smctrl.path)))
    assert factory.func is PartitionShares and factory.args == ("libsmctrl",)
    unpartitioned = PartitionShares("none", cuda=FakeCuda(), total_units=132, unit_kind="SM")
    assert unpartitioned.feasible("prefill") == [132]  # restricts nothing: only the whole device


def test_decode_graphs_are_captured_and_replayed_on_the_masked_stream(smctrl):
    from bullet.partition.decode_graphs import build_graphed_decode
    from bullet.partition.graph_policy import PER_SHARE, GraphDecision
    from bullet.shm.page_allocator import LocalPageAllocator
    from tests.partition.graph_fakes import RerunGraphs

    smctrl.set_tpcs(54)
    api = RecordingStreams()
    backend, stream = open_worker_partition("libsmctrl", "decode", GPU, {"library": smctrl.path}, FakeCuda(streams=api))
    backend.apply(40)
    runner = tiny_runner(pages=64, paged=True)
    allocator = LocalPageAllocator(64, PAGE_SIZE)
    reqs = requests([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]])
    allocator.alloc(sum(len(r.page_table) for r in reqs), owner=1)
    audit = StreamAudit(api)
    with audit:  # captured at build, on the masked stream (buckets 1, 2 and 4 for the share in force)
        decode = build_graphed_decode(runner, stream, GraphDecision(PER_SHARE, "test"), allocator, max_batch=4,
                                      graph_api_factory=RerunGraphs, shares=[40])
    assert decode.graphs.captures == 3 and audit.streams() == {stream.handle()}
    executor = ModelExecutor(runner, FinishChecker(None, set(), 512), stream, decode)
    audit = StreamAudit(api)
    run_prefill_then_decode(executor, reqs, audit)
    assert decode.graph_steps == 2 and decode.graphs.captures == 3  # replays only
    assert audit.streams() == {smctrl.last()[1]} == {stream.handle()}


def test_each_share_makes_every_pool_stream_current_in_turn_and_restores_the_share():
    """The hook a graph owner captures per-share graphs through at start-up."""
    drv = FakeDriver(132, min_partition=8, alignment=8)
    api = RecordingStreams()
    backend, stream = open_worker_partition("green-ctx", "decode", GPU, {"driver": drv, "pool": "coarse"},
                                            FakeCuda(streams=api))
    backend.apply(64)
    keys, current = [], []
    for key in stream.each_share():
        keys.append(key)
        current.append(api.current_handle())
    assert [units for _, units in keys] == [8, 16, 32, 64, 96, 112, 120, 132]
    assert [handle for handle, _ in keys] == current  # inside, the share's own stream is current
    assert len(set(current)) == 8 and all(drv.streams[h] for h in current)
    assert backend.current_units == 64 and api.current_handle() == LEGACY_DEFAULT_STREAM
    assert [units for _, units in stream.each_share([16, 112])] == [16, 112]
