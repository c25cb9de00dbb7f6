"""Tensor parallelism in the estimator: the link's collectives (ring all-reduce arithmetic), one
rank's shard of a model, and a rank's step time = its shard's kernels + its collectives."""

from __future__ import annotations

import json

import pytest

from engines.model_config import ModelConfig
from estimator import Estimator, ExecutionState, HardwareSpec
from estimator.interconnect import LINKS, Interconnect
from estimator.tensor_parallel import TensorParallel, shard_model

A100 = HardwareSpec.builtin("a100")
L70 = ModelConfig.builtin("llama-3.1-70b")
L8 = ModelConfig.builtin("llama-3.1-8b")
LINK = Interconnect(name="test link", bus_bandwidth=10e9, latency_s=25e-6, bandwidth_inflection=4)


def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes_at_busbw_plus_latency():
    nbytes = 64 * 8192 * 2  # 64 tokens of a 8192-wide hidden state in bf16
    assert LINK.all_reduce_time(nbytes, 8, units=108) == pytest.approx(25e-6 + 2 * 7 / 8 * nbytes / 10e9, rel=1e-12)
    assert LINK.all_reduce_time(nbytes, 2, units=108) == pytest.approx(25e-6 + nbytes / 10e9, rel=1e-12)
    # below N_w units the collective cannot drive the link: half the units, half the rate
    assert LINK.all_reduce_time(nbytes, 8, units=2) == pytest.approx(25e-6 + 2 * 7 / 8 * nbytes / 5e9, rel=1e-12)
    assert LINK.all_gather_time(nbytes, 8, units=108) == pytest.approx(25e-6 + 7 / 8 * nbytes / 10e9, rel=1e-12)
    assert LINK.all_reduce_time(nbytes, 1, units=108) == 0.0 and LINK.all_gather_time(nbytes, 1, 108) == 0.0


def test_a_layer_pays_two_all_reduces_and_a_step_an_embedding_all_reduce_and_a_logits_gather():
    tp = TensorParallel.of(L70, 8, LINK)
    rows = 37
    hidden = rows * 8192 * 2
    assert tp.layer_time(rows, 108) == pytest.approx(2 * (25e-6 + 1.75 * hidden / 10e9), rel=1e-12)
    logits = 5 * 128256 * 2
    assert tp.head_time(rows, 5, 108) == pytest.approx(25e-6 + 1.75 * hidden / 10e9 + 25e-6 + 0.875 * logits / 10e9,
                                                       rel=1e-12)


def test_builtin_links_are_labelled_spec_or_paper_and_their_assumptions_say_not_measured():
    assert A100.interconnect == LINKS["nvlink3"]
    assert HardwareSpec.builtin("h200").interconnect == LINKS["nvlink4"]
    for link in LINKS.values():
        assert link.source and link.assumptions
        assert any("not measured" in a for a in link.assumptions)
    assert LINKS["nvlink3"].bus_bandwidth < 300e9 < LINKS["nvlink4"].bus_bandwidth
    assert LINKS["bullet-a100"].bus_bandwidth == 20e9 and "Table 3" in LINKS["bullet-a100"].source


def test_a_device_without_a_link_dumps_as_before_links_existed(tmp_path):
    bare = A100.model_copy(update={"interconnect": None})
    assert "interconnect" not in bare.model_dump() and "interconnect" in A100.model_dump()
    bare.to_json(tmp_path / "hw.json")
    assert HardwareSpec.from_json(tmp_path / "hw.json") == bare
    A100.to_json(tmp_path / "a100.json")
    assert HardwareSpec.from_json(tmp_path / "a100.json") == A100
    assert json.loads((tmp_path / "a100.json").read_text())["interconnect"]["name"].startswith("NVLink3")


def test_70b_shards_megatron_style_with_kv_heads_replicated_past_their_count():
    shard = shard_model(L70, 8)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.intermediate_size, shard.vocab_size,
            shard.hidden_size, shard.num_hidden_layers) == (8, 1, 3584, 16032, 8192, 80)
    assert shard_model(L70, 16).num_key_value_heads == 1  # 8 KV heads on 16 ranks: one each, each held twice
    assert shard_model(L70, 1) is L70
    # one rank holds about an eighth of the weights (norms whole on every rank)
    assert L70.num_parameters() / 8 < shard.num_parameters() < L70.num_parameters() / 8 * 1.001
    with pytest.raises(ValueError, match="64 attention heads do not split over 3"):
        shard_model(L70, 3)
    with pytest.raises(ValueError, match=">= 1"):
        shard_model(L70, 0)


def test_one_rank_prices_exactly_as_one_device():
    plain = Estimator(L8, A100)
    one = Estimator(shard_model(L8, 1), A100, tensor_parallel=TensorParallel.of(L8, 1, LINK))
    for units in (20, 54, 108):
        assert one.decode_time(48, 48 * 900, units) == plain.decode_time(48, 48 * 900, units)
        assert one.prefill_time([700, 90], units) == plain.prefill_time([700, 90], units)
        assert one.hybrid_step_time([(512, 300)], 16, 16 * 800, units) == plain.hybrid_step_time([(512, 300)], 16,
                                                                                                  16 * 800, units)


def test_70b_on_8_ranks_is_an_eighth_of_the_compute_plus_its_collectives():
    tp = TensorParallel.of(L70, 8, LINKS["nvlink3"])
    rank = Estimator(shard_model(L70, 8), A100, tensor_parallel=tp)
    kernels_only = Estimator(shard_model(L70, 8), A100)
    whole = Estimator(L70, A100)  # priced as if one A100 held it (it does not: the simulator refuses that)
    for batch, context in ((1, 1000), (64, 64 * 1500)):
        t1, t8, k8 = (e.decode_time(batch, context, 108) for e in (whole, rank, kernels_only))
        comm = 80 * tp.layer_time(batch, 108) + tp.head_time(batch, batch, 108)
        assert t8 == pytest.approx(k8 + comm, rel=1e-9)
        # an eighth of the work, plus the launches every rank pays whole and the replicated norms
        assert t1 / 8 < k8 < t1 / 8 * 1.5
        assert t8 < t1 / 3  # sensible scaling: 8 ranks well over 3x faster even with the collectives
    t1, t8, k8 = (e.prefill_time([2048], 108) for e in (whole, rank, kernels_only))
    # a long prompt is compute-bound: close to 8x (the shard's smaller grids lose some to wave quantization)
    assert t1 / 8 < k8 < t1 / 8 * 1.25 and k8 < t8 < t1 / 5
    # a slower link costs more, on the same kernels
    slow = Estimator(shard_model(L70, 8), A100, tensor_parallel=TensorParallel.of(L70, 8, LINKS["bullet-a100"]))
    assert slow.prefill_time([2048], 108) > t8


def test_the_kernel_by_kernel_breakdown_carries_the_collectives():
    rank = Estimator(shard_model(L70, 8), A100, tensor_parallel=TensorParallel.of(L70, 8, LINK))
    rows = rank.breakdown(ExecutionState(decode_ctx_lens=(1200,) * 16), 54)
    names = [r[0] for r in rows]
    assert names[-1] == "tp_head_collectives" and names[-5] == "tp_all_reduce"
    layer = sum(t for *_, t in rows[:-4])
    slow = layer * 80 + sum(t for *_, t in rows[-4:])
    assert slow == pytest.approx(rank.decode_time(16, 16 * 1200, 54), rel=1e-9)
