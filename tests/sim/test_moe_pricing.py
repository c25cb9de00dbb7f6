"""The estimator prices a mixture-of-experts step by what it activates: FLOPs of the top-k experts per
token, weight bytes of the experts the batch touches (uniform routing: E(1 - (1 - k/E)^B)); FP8
weights a byte each. Qwen3-30B-A3B and Qwen3-235B-A22B by name: the larger does not fit on one H200
in any precision, and the simulator says so and what it would take."""

from __future__ import annotations

import random

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.config import device_estimator, weight_bytes
from engines.model_config import ModelConfig
from estimator import Estimator
from estimator.hardware import HardwareSpec
from estimator.ops import ExecutionState, expected_experts, layer_token_ops
from estimator.reference.profiles import SHIPPED_PROFILE


def test_expected_experts_is_uniform_routings_mean():
    assert expected_experts(1, 128, 8) == pytest.approx(8)
    assert expected_experts(10_000, 128, 8) == pytest.approx(128)
    rng = random.Random(0)
    for rows in (3, 16, 64):
        trials = [len({e for _ in range(rows) for e in rng.sample(range(128), 8)}) for _ in range(400)]
        assert sum(trials) / len(trials) == pytest.approx(expected_experts(rows, 128, 8), rel=0.02)


@pytest.mark.parametrize("name, total, active", [("qwen3-235b-a22b", 235.09e9, 22.19e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)])
def test_builtin_moe_shapes(name, total, active):
    cfg = ModelConfig.builtin(name)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.norm_topk_prob and cfg.qk_norm
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_layers) == (128, 8, tuple(range(cfg.num_hidden_layers)))
    assert cfg.num_parameters() == pytest.approx(total, rel=1e-3)
    assert cfg.num_parameters(active=True) == pytest.approx(active, rel=1e-3)


def test_a_moe_layer_costs_its_active_experts():
    cfg = ModelConfig.builtin("qwen3-30b-a3b")
    h, w, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
    ops = {op.name: op for op in layer_token_ops(cfg)}
    assert "gate_up_proj" not in ops and {"router", "expert_gate_up", "expert_act", "expert_down"} <= ops.keys()
    gemms = ("qkv_proj", "o_proj", "router", "expert_gate_up", "expert_down")
    per_layer_active = (cfg.num_parameters(active=True) - 2 * cfg.vocab_size * h - h) / cfg.num_hidden_layers
    norms = 2 * h + 2 * cfg.head_dim
    assert sum(ops[n].flops_per_row for n in gemms) == 2 * (per_layer_active - norms)
    expert = 3 * h * w * 2  # bf16 bytes of one expert's three matrices
    experts_read = ops["expert_gate_up"].bytes_per_expert + ops["expert_down"].bytes_per_expert
    assert experts_read == expert
    for rows, touched in ((1, k), (16, expected_experts(16, e, k)), (4096, e)):
        moe_bytes = sum(ops[n].bytes_at(rows) - ops[n].bytes_per_row * rows for n in ("expert_gate_up", "expert_down"))
        assert moe_bytes == pytest.approx(touched * expert, rel=1e-6)
    # FP8 weights: the projections' bytes halve, the router's and activations' do not
    fp8 = {op.name: op for op in layer_token_ops(cfg, 2, weight_bytes=1)}
    assert fp8["expert_down"].bytes_per_expert * 2 == ops["expert_down"].bytes_per_expert
    assert fp8["qkv_proj"].bytes_fixed * 2 == ops["qkv_proj"].bytes_fixed
    assert fp8["router"] == ops["router"] and fp8["expert_down"].bytes_per_row == ops["expert_down"].bytes_per_row


def test_fast_paths_equal_kernel_by_kernel_and_decode_reads_active_weights():
    cfg, hw = ModelConfig.builtin("qwen3-30b-a3b"), HardwareSpec.builtin("h200")
    for weights in (None, "fp8"):
        est = Estimator(cfg, hw, weight_dtype=weights)
        for batch in (1, 8, 200):
            rows = est.breakdown(ExecutionState(decode_ctx_lens=(512,) * batch), 132)
            slow = sum(t for _, _, t in rows[:-3]) * cfg.num_hidden_layers + sum(t for _, _, t in rows[-3:])
            assert est.decode_time(batch, 512 * batch, 132) == pytest.approx(slow, rel=1e-9)
    # one token reads its active weights (~6.7 GB in bf16), not the 61 GB of all experts
    bf16, fp8 = Estimator(cfg, hw), Estimator(cfg, hw, weight_dtype="fp8")
    floor = cfg.num_parameters(active=True) * 2 / hw.peak_bandwidth
    assert floor < bf16.decode_time(1, 512, 132) < 2 * floor
    assert bf16.decode_time(1, 512, 132) < bf16.decode_time(64, 64 * 512, 132) < cfg.num_parameters() * 2 / hw.peak_bandwidth * 1.2
    assert fp8.decode_time(1, 512, 132) < 0.8 * bf16.decode_time(1, 512, 132)
    # a mean layer of dense and sparse MLPs: each counted by its share of the layers
    mixed = cfg.model_copy(update={"moe_layers": tuple(range(0, 48, 2))})
    counts = {op.name: op.count for op in layer_token_ops(mixed)}
    assert counts["expert_gate_up"] == counts["gate_up_proj"] == 0.5


def test_235b_does_not_fit_one_h200_and_30b_simulates_in_either_precision():
    model = ModelConfig.builtin("qwen3-235b-a22b")
    assert weight_bytes(model) / 1e9 == pytest.approx(470.2, abs=0.1)
    assert weight_bytes(model, quantization="fp8") / 1e9 == pytest.approx(236.4, abs=0.1)
    with pytest.raises(ValueError, match=r"does not fit on one H200.*470 GB in bf16.*need 4 such devices.*FP8 weights "
                                         r"would take 236 GB, still more than one device"):
        Simulation(SimConfig(model="qwen3-235b-a22b", hardware="h200"), [(0.0, 64, 4)])
    with pytest.raises(ValueError, match=r"236 GB in FP8 \(projections\) \+ bf16.*need 2 such devices"):
        Simulation(SimConfig(model="qwen3-235b-a22b", hardware="h200", quantization="fp8"), [(0.0, 64, 4)])
    # sized by hand, the pool no longer depends on the weights: one device priced as if it held them
    assert len(Simulation(SimConfig(model="qwen3-235b-a22b", hardware="h200", kv_memory_gb=20),
                          [(0.0, 256, 8)]).run().records) == 1
    trace = [(0.0, 512, 16), (0.05, 256, 16), (0.1, 1024, 8)]
    tpot = {}
    for quantization in ("none", "fp8"):
        config = SimConfig(model="qwen3-30b-a3b", hardware="h200", quantization=quantization, noise=0.0)
        assert device_estimator(config).weight_dtype == ("fp8" if quantization == "fp8" else None)
        result = Simulation(config, trace).run()
        assert len(result.records) == 3
        tpot[quantization] = device_estimator(config).decode_time(3, 3 * 600, 132)
    assert tpot["fp8"] < tpot["none"]
    with pytest.raises(ValueError, match="simulates a built-in --hardware only"):
        device_estimator(SimConfig(model="qwen3-30b-a3b", quantization="fp8", estimator_profile=str(SHIPPED_PROFILE)))
