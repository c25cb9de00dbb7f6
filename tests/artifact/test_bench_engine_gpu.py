"""The engine micro-benchmark of the device run, end to end on the CPU with its tiny sizes (graphs
on through the stand-in that re-runs the captured body), and how it judges the issue's goals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from artifact.benchmarks.bench_engine import model_shape
from artifact.benchmarks.bench_engine_gpu import decode_bytes, goals, prefill_flops
from engines.weights.resolve import dummy_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_cpu_run_measures_every_step_against_its_floor(tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, "-m", "artifact.benchmarks.bench_engine_gpu", "--device", "cpu",
                           "--model-path", "smollm2-135m", "--load-format", "dummy", "--dtype", "float32",
                           "--threads", "1", "--repeats", "1", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["rates"]["copy_gbs"] > 0 and data["rates"]["gemm_tflops"] > 0
    assert data["prefill"]["tokens"] == 32 and data["prefill"]["of_gemm"] > 0
    fresh = data["new_lengths"]  # each backend choice on lengths of its own, none run before
    assert set(fresh) == {"runner's backends", "torch's choice"}
    assert not set(fresh["runner's backends"]["lengths"]) & set(fresh["torch's choice"]["lengths"])
    assert all(r["first_ms"] > 0 and r["again_ms"] > 0 for r in fresh.values())
    rows = [(r["batch"], r["context"], r["graphs"]) for r in data["decode"]]
    assert rows == [(1, 32, "off"), (1, 32, "on"), (2, 32, "off"), (2, 32, "on"), (4, 16, "off"), (4, 16, "on")]
    assert all(r["ms"] > 0 and r["over_floor"] > 0 and r["floor_ms"] > 0 for r in data["decode"])
    mixed, = data["mixed"]  # a prompt chunk beside decode rows, split and as one extend
    assert (mixed["prompt"], mixed["batch"], mixed["context"]) == (16, 4, 16)
    assert mixed["split_ms"] > 0 and mixed["one_extend_ms"] > 0 and "mixed 16 + 4x16" in proc.stdout
    stages = [r["step"] for r in data["fused"]]  # fused stages against torch lines, per step
    assert stages == ["prefill 32", "prefill 32", "decode 1x32 graphs on", "decode 2x32 graphs on", "decode 4x16 graphs on"]
    assert all(r["fused_ms"] > 0 and r["torch_lines_ms"] > 0 for r in data["fused"])
    assert data["goals"] == []  # the goals are for their own sizes (8B on a GPU), not these
    assert "re-run" in data["graphs_note"] and "x floor" in proc.stdout


def test_the_floor_and_the_work_are_the_issues_own_numbers():
    # Llama-3.1-8B bf16: ~15 GB of weights, a 1x1024 step reads ~134 MB of KV more: ~3.6 ms at 4.2 TB/s
    # (the issue's 3.7 ms); 128x512 reads 128 x 513 tokens of KV; 2048 tokens of prefill are ~30 TFLOP
    s = model_shape(dummy_config("llama-3.1-8b"))
    assert decode_bytes(s, 1, 1024, 2) / 4.2e12 * 1e3 == pytest.approx(3.6, abs=0.1)
    kv_token = 32 * 2 * 1024 * 2
    assert decode_bytes(s, 128, 512, 2) - decode_bytes(s, 1, 1024, 2) == (128 * 513 - 1025) * kv_token
    assert prefill_flops(s, 2048) / 1e12 == pytest.approx(29.7, abs=0.3)


def test_goals_are_judged_for_their_sizes_only():
    result = {"prefill": {"tokens": 2048, "of_gemm": 0.65},
              "decode": [{"batch": 1, "context": 1024, "graphs": "on", "over_floor": 1.4},
                         {"batch": 1, "context": 1024, "graphs": "off", "over_floor": 7.0},
                         {"batch": 32, "context": 1024, "graphs": "on", "over_floor": 2.5},
                         {"batch": 128, "context": 512, "graphs": "on", "error": "no graph bucket"},
                         {"batch": 8, "context": 100, "graphs": "on", "over_floor": 1.0}]}
    got = {g["goal"]: g["met"] for g in goals(result)}
    assert got == {"decode 1x1024, graphs on": True, "decode 32x1024, graphs on": False,
                   "decode 128x512, graphs on": False, "prefill 2048 tokens": False}
