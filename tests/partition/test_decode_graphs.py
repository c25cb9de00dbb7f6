"""Decode CUDA graphs without a GPU: the bucketing and padding, and the graph body itself — run on the
CPU through a stand-in `GraphApi` that re-runs the captured body at every replay — against the
eager decode step of the same runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engines.cuda_graphs import DecodeGraphs
from engines.decode_padding import DecodeShape, batch_bucket, context_bucket, default_batch_buckets, pad_decode
from engines.runner import SeqChunk
from tests.partition.tiny_model import PAGE_SIZE, prefill, tiny_runner


class RerunGraphs:
    """Captures by remembering the body; a replay runs it again on whatever the static tables hold
    — what a CUDA graph does, minus the GPU. Counts captures and replays, checks the body is not
    captured twice for one graph."""

    def __init__(self):
        self.bodies, self.released = [], 0

    def capture(self, body):
        api = self
        body()  # the warm-up run, as TorchCudaGraphs does
        api.bodies.append(body)

        class Graph:
            def replay(self):
                return body()

            def release(self):
                api.released += 1

        return Graph()


# ---- buckets and padding ----------------------------------------------------------------------

def test_batch_buckets_follow_the_usual_spacing_and_end_at_the_largest_batch():
    assert default_batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_batch_buckets(100)[-3:] == (80, 96, 100)
    assert default_batch_buckets(1) == (1,)
    assert [batch_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        batch_bucket(0, (1, 2))


@given(st.integers(1, 200_000))
def test_context_buckets_cover_the_context_and_pad_at_most_a_third(n):
    b = context_bucket(n, 256)
    assert b >= n and b % 256 == 0
    assert b - n < 256 or (b - n) / b <= 1 / 3
    assert context_bucket(b, 256) == b  # a bucket is its own bucket: no graph is captured twice


def test_padding_sends_extra_rows_to_the_scratch_slot_and_masks_extra_context():
    shape = DecodeShape(batch=4, context=12)
    padded = pad_decode([5, 6], [6, 2], [[3, 7], [1]], shape, page_size=4, scratch_slot=99)
    assert padded.real == 2
    assert padded.token_ids.tolist() == [5, 6, 0, 0] and padded.positions.tolist() == [6, 2, 0, 0]
    # row 0: positions 0..6 on pages 3 (slots 12-15) and 7 (slots 28-30); its new token at position 6
    assert padded.kv_slots[0, :7].tolist() == [12, 13, 14, 15, 28, 29, 30]
    assert padded.slot_mapping.tolist() == [30, 6, 99, 99]
    assert padded.kv_valid.sum(axis=1).tolist() == [7, 3, 1, 1]
    assert padded.kv_slots[2:, 0].tolist() == [99, 99]  # padding attends only to the scratch slot
    assert not padded.kv_valid[:, 7:].any()


def test_padding_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([1, 2, 3], [0, 0, 0], [[0]] * 3, DecodeShape(2, 8), 4, 0)
    with pytest.raises(ValueError, match="more than the bucket"):
        pad_decode([1], [8], [[0, 1, 2]], DecodeShape(1, 8), 4, 0)
    with pytest.raises(ValueError, match="covers 4 tokens"):
        pad_decode([1], [4], [[0]], DecodeShape(1, 8), 4, 0)


# ---- the graph body against the eager step ----------------------------------------------------------

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28], [8]]


@pytest.fixture
def setup():
    runner = tiny_runner(pages=64)
    tables = prefill(runner, PROMPTS)
    scratch = 63 * PAGE_SIZE  # the last page: owned by no prompt
    return runner, tables, scratch


def decode_chunks(tables, last_tokens, lengths):
    return [SeqChunk([t], n, table) for t, n, table in zip(last_tokens, lengths, tables)]


def test_replays_match_the_eager_step_and_leave_other_kv_untouched(setup):
    runner, tables, scratch = setup
    graphs = DecodeGraphs(runner, scratch, RerunGraphs(), max_batch=8, context_step=8)
    lengths = [len(p) for p in PROMPTS]
    tokens = [7, 11, 13]  # three of four requests decode: a batch of 3 padded to 4
    chunks = decode_chunks(tables[:3], tokens, lengths[:3])
    assert graphs.shape_for(chunks) == DecodeShape(4, 16)
    kv_before = runner.kv.tensor.clone()
    eager = runner.forward(chunks).last_logits
    kv_eager = runner.kv.tensor.clone()
    runner.kv.tensor.copy_(kv_before)
    replayed = graphs.forward(chunks).last_logits
    assert replayed.shape == eager.shape
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    # the requests' new K/V are the eager step's; padding wrote only the scratch page
    kv_graph = runner.kv.tensor
    # the pool is [layers, K/V, KV heads, slots, head_dim]: slots are dim 3
    scratch_page = slice(scratch, scratch + PAGE_SIZE)
    torch.testing.assert_close(kv_graph[:, :, :, :scratch], kv_eager[:, :, :, :scratch], rtol=1e-6, atol=1e-6)
    assert not torch.equal(kv_graph[:, :, :, scratch_page], kv_before[:, :, :, scratch_page])


def test_one_capture_per_bucket_then_replays(setup):
    runner, tables, scratch = setup
    api = RerunGraphs()
    graphs = DecodeGraphs(runner, scratch, api, max_batch=8, context_step=8)
    lengths = [len(p) for p in PROMPTS]
    for step in range(3):  # the 4 requests grow by one token per step, within one context bucket
        chunks = decode_chunks(tables, [1 + step] * 4, [n + step for n in lengths])
        graphs.forward(chunks)
    assert (graphs.captures, graphs.replays) == (1, 3)
    graphs.forward(decode_chunks(tables[:1], [2], [lengths[0]]))  # batch 1: a second bucket
    assert graphs.captures == 2 and len(api.bodies) == 2


def test_graphs_per_share_are_captured_per_key_and_lru_evicted(setup):
    runner, tables, scratch = setup
    api = RerunGraphs()
    graphs = DecodeGraphs(runner, scratch, api, max_batch=8, context_step=8, max_graphs=2)
    chunks = decode_chunks(tables[:2], [1, 2], [5, 2])
    for key in ("share-16", "share-32", "share-16"):
        graphs.forward(chunks, key)
    assert graphs.captures == 2 and api.released == 0
    graphs.forward(chunks, "share-64")  # a third share: the least recently used (32) goes
    assert graphs.captures == 3 and api.released == 1
    assert [k for _, k in graphs.captured] == ["share-16", "share-64"]


def test_steps_without_a_bucket_are_left_to_the_eager_path(setup):
    runner, tables, scratch = setup
    graphs = DecodeGraphs(runner, scratch, RerunGraphs(), max_batch=2, context_step=8, max_graph_slots=64)
    assert graphs.shape_for([SeqChunk([1, 2], 0, tables[0])]) is None  # a prompt chunk
    assert graphs.shape_for([SeqChunk([1], 4, tables[0], "all")]) is None  # prompt logprobs
    assert graphs.shape_for(decode_chunks(tables[:3], [1, 1, 1], [5, 2, 11])) is None  # 3 rows > bucket 2
    assert graphs.shape_for(decode_chunks(tables[:2], [1, 1], [5, 2])) == DecodeShape(2, 8)
    long = [SeqChunk([1], 40, list(range(11)))]  # context bucket 48 x batch 1 ... fits 64 slots
    assert graphs.shape_for(long) == DecodeShape(1, 48)
    assert graphs.shape_for(long * 2) is None  # 2 x 48 slots > max_graph_slots
    with pytest.raises(ValueError, match="no graph bucket"):
        graphs.forward(long * 2)


def test_rope_tables_are_grown_before_any_capture(setup):
    """A captured graph keeps reading the RoPE tables it saw: they must never be replaced later."""
    runner, tables, scratch = setup
    graphs = DecodeGraphs(runner, scratch, RerunGraphs(), max_batch=4, context_step=8)
    cos = runner.model.rope._cos
    assert cos.shape[0] >= min(runner.max_context, runner.kv.num_slots)
    graphs.forward(decode_chunks(tables[:1], [3], [len(PROMPTS[0])]))
    runner.forward([SeqChunk([4], 200, list(range(51)))])  # a long eager step grows nothing
    assert runner.model.rope._cos is cos


def test_scratch_slot_must_lie_in_the_pool():
    runner = tiny_runner(pages=4)
    with pytest.raises(ValueError, match="outside the KV pool"):
        DecodeGraphs(runner, 4 * PAGE_SIZE, RerunGraphs(), max_batch=2)


def test_padded_tables_equal_the_eager_runners_for_the_real_rows(setup):
    runner, tables, _ = setup
    lengths = [len(p) for p in PROMPTS]
    chunks = decode_chunks(tables, [1, 2, 3, 4], lengths)
    _, ctx = runner._context(chunks)
    padded = pad_decode([1, 2, 3, 4], lengths, tables, DecodeShape(8, 16), PAGE_SIZE, 0)
    width = ctx.kv_slots.shape[1]
    np.testing.assert_array_equal(padded.kv_slots[:4, :width][padded.kv_valid[:4, :width]],
                                  ctx.kv_slots.numpy()[ctx.kv_valid.view(4, width).numpy()])
    np.testing.assert_array_equal(padded.slot_mapping[:4], ctx.slot_mapping.numpy())
    np.testing.assert_array_equal(padded.positions[:4], ctx.positions.numpy())
