"""Decode CUDA graphs without a GPU: the buckets and packed inputs, and the graph body itself — run on
the CPU through stand-in `GraphApi`s that re-run the captured body at every replay (one of them
failing on any host read a real capture forbids) — against the eager decode step of the same
paged runner."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engines.cuda_graphs import DecodeGraphs, graph_blocker
from engines.decode_padding import DecodeInputs, DecodeShape, batch_bucket, default_batch_buckets, thin_buckets
from engines.model.paged_attention import TorchPagedKernels
from engines.runner import SeqChunk
from tests.partition.graph_fakes import GatherPagedKernels, HostRead, HostReadGuard, RerunGraphs, StrictGraphs
from tests.partition.tiny_model import PAGE_SIZE, prefill, tiny_runner

# ---- buckets and packed inputs ----------------------------------------------------------------------


def test_batch_buckets_follow_the_usual_spacing_and_end_at_the_largest_batch():
    assert default_batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_buckets(100)[-3:] == (80, 96, 100)
    assert default_batch_buckets(1) == (1,)
    assert [batch_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        batch_bucket(0, (1, 2))


@given(st.integers(1, 600), st.integers(1, 40))
def test_thinned_buckets_are_a_spread_subset_that_keeps_the_largest(max_batch, keep):
    buckets = default_batch_buckets(max_batch)
    kept = thin_buckets(buckets, keep)
    assert set(kept) <= set(buckets) and kept[-1] == buckets[-1]
    assert len(kept) == min(keep, len(buckets)) or keep == 1 and kept == buckets[-1:]
    assert list(kept) == sorted(kept)


def test_inputs_send_padding_rows_to_the_scratch_page_and_store_pages_by_column():
    inputs = DecodeInputs(max_batch=4, width=6, page_size=4, scratch_slot=96, num_slots=100, device="cpu")
    count = inputs.fill([5, 6], [6, 2], [[3, 7, 9], [1]], batch=4)
    ids, positions, slots, lens, pages = (t.numpy() for t in _host_views(inputs, 4))
    assert ids.tolist() == [5, 6, 0, 0] and positions.tolist() == [6, 2, 0, 0]
    # row 0: position 6 lies on its second page (7), offset 2; row 1 on page 1, offset 2
    assert slots.tolist() == [30, 6, 96, 96] and lens.tolist() == [7, 3, 1, 1]
    assert pages[:2, 0].tolist() == [3, 7] and pages[0, 1] == 1  # only the pages the context covers
    assert pages[0, 2:].tolist() == [24, 24]  # padding rows: the scratch page
    assert count == inputs.rows * (4 + 2)  # the step uses two pages per row at most: only those are copied
    inputs.upload(count)
    assert torch.equal(inputs.device_buf[:count], inputs.host_buf[:count])


def _host_views(inputs: DecodeInputs, batch: int):
    r, h = inputs.rows, inputs.host_buf
    return h[:batch], h[r:r + batch], h[2 * r:2 * r + batch], h[3 * r:3 * r + batch], \
        h[4 * r:].view(inputs.width, r)[:, :batch]


def test_a_smaller_step_never_leaves_a_padding_row_on_an_earlier_requests_page():
    inputs = DecodeInputs(max_batch=4, width=4, page_size=4, scratch_slot=40, num_slots=64, device="cpu")
    inputs.fill([1, 2, 3, 4], [0, 0, 0, 0], [[1], [2], [3], [4]], batch=4)
    inputs.fill([1], [0], [[1]], batch=4)
    _, _, slots, lens, pages = _host_views(inputs, 4)
    assert pages[0].tolist() == [1, 10, 10, 10] and slots.tolist() == [4, 40, 40, 40] and lens.tolist() == [1, 1, 1, 1]


def test_inputs_refuse_what_does_not_fit():
    inputs = DecodeInputs(max_batch=2, width=2, page_size=4, scratch_slot=0, num_slots=64, device="cpu")
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill([1, 2, 3], [0, 0, 0], [[0]] * 3, batch=2)
    with pytest.raises(ValueError, match="tables hold 2"):
        inputs.fill([1], [8], [[0, 1, 2]], batch=1)
    with pytest.raises(ValueError, match="covers 4 tokens"):
        inputs.fill([1], [4], [[0]], batch=1)


# ---- the graph body against the eager step ----------------------------------------------------------

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28], [8]]
SCRATCH = 63 * PAGE_SIZE  # the last page: owned by no prompt


def _triton_kernels():
    """The GPU's kernels, interpreted on the CPU (tests/conftest.py turns the interpreter on)."""
    ta = pytest.importorskip("engines.model.triton_attention", reason="the Triton kernels need triton")
    if not torch.cuda.is_available() and not ta.INTERPRETED:
        pytest.skip("triton was imported without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")
    return ta.TritonPagedKernels()


# (kernels, GraphApi): the interpreter reads tensors on the host itself, so triton runs un-strict here
KERNELS = {"reference": (TorchPagedKernels, RerunGraphs), "host-read-free": (GatherPagedKernels, StrictGraphs),
           "triton": (_triton_kernels, RerunGraphs)}


@pytest.fixture(params=sorted(KERNELS))
def setup(request):
    """A paged tiny runner with the four prompts prefilled, and a `GraphApi`: the torch reference
    kernels under the re-running fake, host-read-free kernels under the strict one, the Triton
    kernels (where triton imports) under the re-running fake."""
    kernels, api = KERNELS[request.param]
    runner = tiny_runner(pages=64, paged=True, kernels=kernels())
    tables = prefill(runner, PROMPTS)
    return runner, tables, api


def decode_chunks(tables, last_tokens, lengths):
    return [SeqChunk([t], n, table) for t, n, table in zip(last_tokens, lengths, tables)]


def eager_and_replayed(runner, graphs, chunks, key=None):
    """(eager logits, replayed logits, pool after eager, pool before, pool after the replay)."""
    before = runner.kv.tensor.clone()
    eager = runner.forward(chunks).last_logits
    after_eager = runner.kv.tensor.clone()
    runner.kv.tensor.copy_(before)
    replayed = graphs.forward(chunks, key).last_logits.clone()
    return eager, replayed, after_eager, before, runner.kv.tensor.clone()


def written_slots(before, after) -> set[int]:
    # the pool is [layers, K/V, KV heads, slots, head_dim]: slots are dim 3
    return set((before != after).any(dim=(0, 1, 2, 4)).nonzero().flatten().tolist())


def test_a_padded_replay_is_the_eager_step_and_writes_only_its_rows_and_the_scratch_slot(setup):
    runner, tables, api = setup
    graphs = DecodeGraphs(runner, SCRATCH, api(), max_batch=8)
    lengths = [len(p) for p in PROMPTS]
    chunks = decode_chunks(tables[:3], [7, 11, 13], lengths[:3])  # a batch of 3 padded to 4
    assert graphs.shape_for(chunks) == DecodeShape(4, 64 * PAGE_SIZE)
    eager, replayed, kv_eager, before, kv_graph = eager_and_replayed(runner, graphs, chunks)
    assert replayed.shape == eager.shape == (3, runner.model.config.vocab_size)
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    rows = {t[n // PAGE_SIZE] * PAGE_SIZE + n % PAGE_SIZE for t, n in zip(tables, lengths[:3])}
    assert written_slots(before, kv_eager) == rows
    assert written_slots(before, kv_graph) == rows | {SCRATCH}  # padding wrote the scratch slot, nothing else
    torch.testing.assert_close(kv_graph[:, :, :, sorted(rows)], kv_eager[:, :, :, sorted(rows)], rtol=1e-6, atol=1e-6)


def test_one_graph_per_batch_bucket_serves_every_context_length(setup):
    runner, tables, api = setup
    long_prompt = list(range(1, 60))
    long_table = prefill(runner, [long_prompt], first_page=40)[0]  # 59 tokens on pages 40..56
    graphs = DecodeGraphs(runner, SCRATCH, api(), max_batch=8)
    tables = tables + [long_table]
    lengths = [len(p) for p in PROMPTS] + [len(long_prompt)]
    for step in range(6):  # contexts grow across page boundaries; a 59-token row joins at step 3
        rows = 5 if step >= 3 else 4
        chunks = decode_chunks(tables[:rows], [1 + step] * rows, [n + step for n in lengths[:rows]])
        eager, replayed, *_ = eager_and_replayed(runner, graphs, chunks)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        runner.forward(chunks)  # the eager step's K/V stay: the next step attends to them
    assert graphs.captures == 2 and graphs.replays == 6  # buckets 4 and 8, whatever the contexts
    assert [shape.batch for shape, _ in graphs.captured] == [4, 8]


def test_the_strict_capture_catches_host_reads():
    """The guard is not vacuous: the torch reference kernels (`.tolist()`) and RoPE's growing
    lookup (`int(positions.max())`) fail under it — which is why the graph body looks RoPE up
    without the check and CUDA graphs need the Triton kernels."""
    runner = tiny_runner(pages=64, paged=True, kernels=TorchPagedKernels())  # not the CPU kernel, where built
    graphs = DecodeGraphs(runner, SCRATCH, StrictGraphs(), max_batch=2)
    with pytest.raises(HostRead, match="tolist"):
        graphs.capture([2])
    with HostReadGuard(), pytest.raises(HostRead, match="__int__"):
        runner.model.rope.tables(torch.tensor([3, 5]))


def test_graphs_per_share_are_captured_per_key(setup):
    runner, tables, api = setup
    graphs = DecodeGraphs(runner, SCRATCH, api(), max_batch=8)
    chunks = decode_chunks(tables[:2], [1, 2], [5, 2])
    for key in ("share-16", "share-32", "share-16", None):
        graphs.forward(chunks, key)
    assert graphs.captures == 3 and [k for _, k in graphs.captured] == ["share-32", "share-16", None]
    assert graphs.capture([1, 2, 4], "share-16") == 2  # bucket 2 was there: buckets 1 and 4 are new
    assert graphs.has(DecodeShape(4, 0), "share-16") and not graphs.has(4, "share-32")


def test_capture_ahead_stays_within_max_graphs_and_serving_on_demand_evicts_lru(caplog):
    runner = tiny_runner(pages=64, paged=True)
    tables = prefill(runner, PROMPTS)
    api = RerunGraphs()
    graphs = DecodeGraphs(runner, SCRATCH, api, max_batch=4, max_graphs=3)
    assert graphs.capture([1, 2, 4], "a") == 3  # the largest first: 4, 2, 1 in LRU order
    with pytest.raises(ValueError, match="exceed max_graphs"):
        graphs.capture([1], "b")
    assert graphs.captures == 3 and len(graphs.captured) == 3
    with pytest.raises(ValueError, match="not buckets"):
        graphs.capture([3])
    with pytest.raises(ValueError, match="no graph captured"):
        graphs.forward(decode_chunks(tables[:1], [1], [5]), "b", capture=False)
    assert graphs.captures == 3  # nothing captured
    chunks = decode_chunks(tables[:1], [1], [5])
    graphs.forward(chunks, "a")  # held: a replay
    with caplog.at_level(logging.WARNING, logger="engines.cuda_graphs"):
        graphs.forward(chunks, "b")  # on demand: the least recently used ("a", 4) goes
        assert graphs.evictions == 1 and api.released == 1 and not graphs.has(4, "a")
        assert "again after its eviction" not in caplog.text
        graphs.forward(decode_chunks(tables[:3], [1, 1, 1], [5, 2, 11]), "a")  # recaptured: said so
    assert graphs.evictions == 2 and "again after its eviction" in caplog.text


def test_steps_without_a_bucket_are_left_to_the_eager_path():
    runner = tiny_runner(pages=64, paged=True)
    tables = prefill(runner, PROMPTS)
    graphs = DecodeGraphs(runner, SCRATCH, RerunGraphs(), max_batch=2)
    assert graphs.shape_for([SeqChunk([1, 2], 0, tables[0])]) is None  # a prompt chunk
    assert graphs.shape_for([SeqChunk([1], 4, tables[0], "all")]) is None  # prompt logprobs
    assert graphs.shape_for(decode_chunks(tables[:3], [1, 1, 1], [5, 2, 11])) is None  # 3 rows > bucket 2
    assert graphs.shape_for(decode_chunks(tables[:2], [1, 1], [5, 2])) == DecodeShape(2, 256)
    too_long = [SeqChunk([1], runner.max_context, list(range(200)))]
    assert graphs.shape_for(too_long) is None
    with pytest.raises(ValueError, match="no graph bucket"):
        graphs.forward(too_long)


def test_rope_tables_are_grown_before_any_capture():
    """A captured graph keeps reading the RoPE tables it saw: they must never be replaced later."""
    runner = tiny_runner(pages=64, paged=True)
    tables = prefill(runner, PROMPTS)
    graphs = DecodeGraphs(runner, SCRATCH, RerunGraphs(), max_batch=4)
    cos = runner.model.rope._cos
    assert cos.shape[0] >= min(runner.max_context, runner.kv.num_slots)
    graphs.forward(decode_chunks(tables[:1], [3], [len(PROMPTS[0])]))
    runner.forward([SeqChunk([4], 200, list(range(51)))])  # a long eager step grows nothing
    assert runner.model.rope._cos is cos


def test_the_scratch_slot_must_begin_a_page_of_the_pool():
    runner = tiny_runner(pages=4, paged=True)
    with pytest.raises(ValueError, match="outside the KV pool"):
        DecodeGraphs(runner, 4 * PAGE_SIZE, RerunGraphs(), max_batch=2)
    with pytest.raises(ValueError, match="first slot of a page"):
        DecodeGraphs(runner, 3 * PAGE_SIZE + 1, RerunGraphs(), max_batch=2)


def test_graphs_need_a_paged_runner_and_on_cuda_the_triton_kernels():
    with pytest.raises(ValueError, match="not paged"):
        DecodeGraphs(tiny_runner(pages=8), 0, RerunGraphs(), max_batch=2)
    cuda = torch.device("cuda")
    assert "triton kernels" in graph_blocker(SimpleNamespace(paged=True, kernels=TorchPagedKernels(), device=cuda))
    assert graph_blocker(SimpleNamespace(paged=True, kernels=SimpleNamespace(name="triton"), device=cuda)) is None
    assert graph_blocker(tiny_runner(pages=8, paged=True)) is None  # the CPU stand-ins run any kernels


def test_the_inputs_hold_the_eager_runners_tables_for_the_real_rows():
    runner = tiny_runner(pages=64, paged=True)
    tables = prefill(runner, PROMPTS)
    lengths = [len(p) for p in PROMPTS]
    _, ctx = runner._context(decode_chunks(tables, [1, 2, 3, 4], lengths))
    inputs = DecodeInputs(8, 16, PAGE_SIZE, SCRATCH, runner.kv.num_slots, "cpu")
    inputs.upload(inputs.fill([1, 2, 3, 4], lengths, tables, batch=8))
    ids, positions, slots, lens, pages = inputs.views(8)
    np.testing.assert_array_equal(positions[:4].long(), ctx.positions)
    np.testing.assert_array_equal(slots[:4].long(), ctx.slot_mapping)
    np.testing.assert_array_equal(lens[:4], ctx.paged.seq_lens)
    width = ctx.paged.page_table.shape[1]
    for row, n in enumerate(lengths):
        used = -(-(n + 1) // PAGE_SIZE)
        assert pages[:used, row].tolist() == ctx.paged.page_table[row, :used].tolist()
    assert width <= inputs.width
