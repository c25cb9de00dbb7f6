"""The device run's models-and-formats benchmark, end to end on the CPU with its tiny stand-ins, its
floors (the bytes a step reads, experts counted as picked) and how it judges issue 41's goals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from artifact.benchmarks import bench_models_gpu as bm
from artifact.gpu_check import report
from engines.model.build import build_model, float_shapes
from engines.quant import fp8

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_cpu_run_measures_every_section(tmp_path):
    out = tmp_path / "models.json"
    proc = subprocess.run([sys.executable, "-m", "artifact.benchmarks.bench_models_gpu", "--device", "cpu",
                           "--threads", "1", "--repeats", "1", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["complete"] and data["errors"] == [] and data["rates"]["copy_gbs"] > 0
    gemm = data["fp8_gemm"]
    assert [r["proj"] for r in gemm["rows"]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert all(r["float_ms"] > 0 and r["scaled_mm_ms"] > 0 and r["fp8_linear_ms"] > 0 for r in gemm["rows"])
    assert gemm["block_linear_x_float"] is None and "does not run" in gemm["block_note"]  # a CPU has no such GEMM
    got = {(m["model"], m["quantization"]): m for m in data["models"]}
    assert set(got) == {("tiny-qwen3", "none"), ("tiny-qwen3-moe", "none"), ("tiny-llama", "fp8")}
    for m in got.values():
        assert m["prefill"]["ms"] > 0 and [(d["batch"], d["context"]) for d in m["decode"]] == [(1, 32), (4, 32)]
        assert all(d["eager_ms"] > 0 and d["floor_ms"] > 0 and d["graphs_ms"] > 0 for d in m["decode"])
    moe = got[("tiny-qwen3-moe", "none")]["decode"]
    # 8 experts, top 2: one token picks exactly 2 a layer; 4 tokens between 2 and 8
    assert moe[0]["experts_touched_per_layer"] == 2 and 2 <= moe[1]["experts_touched_per_layer"] <= 8
    assert moe[0]["expert_gb_of_all"] == pytest.approx(2 / 8)
    assert moe[0]["experts_uniform_per_layer"] == pytest.approx(2.0)
    # FP8 projections: a byte a weight (plus scales) against float32's four
    dense_fp32 = got[("tiny-qwen3", "none")]["decode"][0]["weight_gb"]
    assert got[("tiny-llama", "fp8")]["decode"][0]["weight_gb"] < dense_fp32
    assert data["goals"] == []  # the goals are for the 8B / 30B-A3B shapes, not the stand-ins
    assert "models and formats on cpu" in proc.stdout


def test_the_floor_reads_projections_as_stored_and_only_the_picked_experts():
    config = bm.tiny_config("tiny-qwen3-moe")
    state = {n: torch.randn(s) * 0.02 for n, s in float_shapes(config).items()}
    model = build_model(config, state, torch.device("cpu"))
    every = bm.weight_bytes(model, None)
    experts = config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size * 4 * config.num_hidden_layers
    assert every["experts"] == every["all_experts"] == experts
    h = config.hidden_size
    attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    router = h * config.num_experts
    head = config.vocab_size * h
    assert every["dense"] == ((attention + router) * config.num_hidden_layers + head) * 4
    counter = bm.ExpertCounter(model)
    x = torch.randn(3, h)
    for layer in model.layers:
        layer.mlp(x)
    counter.close()
    assert set(counter.touched) == {f"layers.{i}.moe.experts" for i in range(config.num_hidden_layers)}
    picked = bm.weight_bytes(model, counter.touched)
    assert picked["experts"] == pytest.approx(experts * sum(counter.touched.values())
                                              / (config.num_experts * config.num_hidden_layers))


def test_fp8_projections_read_a_byte_a_weight_and_their_scales():
    config = bm.tiny_config("tiny-llama")
    state = {n: torch.randn(s) * 0.02 for n, s in float_shapes(config).items()}
    model = build_model(config, fp8.quantize_state(config, dict(state)), torch.device("cpu"))
    fp8_bytes = bm.weight_bytes(model, None)["dense"]
    float_bytes = bm.weight_bytes(build_model(config, state, torch.device("cpu")), None)["dense"]
    head = config.vocab_size * config.hidden_size * 4  # stays float
    n_rows = sum(n for _, n, _ in bm.projection_shapes(config)) * config.num_hidden_layers
    assert fp8_bytes == pytest.approx((float_bytes - head) / 4 + n_rows * 4 + head)


def test_goals_are_judged_for_their_model_and_dtype_only():
    gemm = {"tokens": 2048, "dtype": "bfloat16", "scaled_mm_x_float": 1.7}
    moe = {"model": "qwen3-30b-a3b", "quantization": "none",
           "decode": [{"batch": 1, "context": 1024, "over_floor": 2.2}, {"batch": 32, "context": 1024, "error": "x"}]}
    payload = {"config": {"gemm_model": "llama-3.1-8b"}, "fp8_gemm": gemm,
               "models": [moe, dict(moe, quantization="fp8"), dict(moe, model="qwen3-32b")]}
    verdicts = [(g["goal"], g["met"]) for g in bm.goals(payload)]
    assert verdicts == [("FP8 GEMM at llama-3.1-8b shapes (2048 rows)", True),
                        ("qwen3-30b-a3b decode 1x1024, graphs on", True),
                        ("qwen3-30b-a3b decode 32x1024, graphs on", False)]
    assert not bm.goals(dict(payload, fp8_gemm=dict(gemm, scaled_mm_x_float=1.5)))[0]["met"]
    assert not bm.goals(dict(payload, fp8_gemm=dict(gemm, dtype="float32")))[0]["met"]  # a CPU's rates judge nothing
    assert bm.goals(dict(payload, config={"gemm_model": "tiny-llama"}))[0]["goal"].startswith("qwen3-30b-a3b")


def test_the_report_carries_the_models_section_and_its_goals(tmp_path):
    models = {"config": {"device": "NVIDIA H200", "dtype": "bfloat16", "gemm_model": "llama-3.1-8b"},
              "rates": {"copy_gbs": 4200.0}, "complete": True,
              "fp8_gemm": {"dtype": "bfloat16", "rows": [{"proj": "down_proj", "m": 2048, "n": 4096, "k": 14336,
                                                         "float_tflops": 700.0, "scaled_mm_tflops": 1200.0,
                                                         "scaled_mm_x_float": 1.71, "fp8_linear_tflops": 1000.0,
                                                         "fp8_linear_x_float": 1.43}]},
              "models": [{"model": "qwen3-30b-a3b", "quantization": "none", "prefill": {"tokens": 2048, "ms": 60.0},
                          "decode": [{"batch": 32, "context": 1024, "eager_ms": 30.0, "graphs_ms": 12.0, "floor_ms": 6.0,
                                      "over_floor": 2.0, "experts_touched_per_layer": 110.0,
                                      "experts_uniform_per_layer": 111.7}]}],
              "errors": [{"model": "llama-3.1-8b:fp8", "error": "RuntimeError: no kernel"}],
              "goals": [{"goal": "FP8 GEMM at llama-3.1-8b shapes (2048 rows)", "measured": 1.71,
                         "target": ">= 1.6x bfloat16", "met": True, "unit": "x"}]}
    results = {"run": {"device": "cuda"}, "machine": {},
               "steps": {"models": {"status": "pass", "summary": "1 of 1 goals met", "models": models}}}
    report.write(results, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "## Other models and formats" in text and "1200.0 (1.71x)" in text
    assert "| qwen3-30b-a3b | decode 32x1024 | 30.00 / 12.00 | 6.00 | 2.00x | 110.0 (111.7 uniform) |" in text
    assert "llama-3.1-8b:fp8 failed" in text
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["goals"][0]["goal"] == "FP8 GEMM at llama-3.1-8b shapes (2048 rows)"
