"""The MoE-vs-dense benchmark on tiny sizes, through its real models and runner: the two configs
have the same active parameters but the router's, every (dtype, threads, step) has its timings and
ratios (the MoE's other forms too: the grouped path, without AMX tiles, the row form), a decode row touches exactly top-k
experts per layer, and the JSON and markdown are written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from artifact.benchmarks import bench_moe, common
from engines.model import cpu_gemv, moe

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "256",
        "--experts", "8", "--top-k", "2", "--moe-intermediate", "32", "--prompt", "16", "--batches", "1", "4",
        "--context", "8", "--repeats", "1", "--threads", "1", "--grouped", "--untiled", "--row-form", "--rowwise",
        "--name", "moe-tiny"]
# another build of the C kernel: this tree's own, loaded a second time as a module of its own
AGAINST = ["--against", str(Path(cpu_gemv._ext.__file__).parent.parent)] if cpu_gemv._ext is not None else []


def test_tiny_run_writes_every_step_and_its_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    threads, knobs = torch.get_num_threads(), tuple(getattr(moe, k) for k in bench_moe.KNOBS)
    own = cpu_gemv._ext
    try:
        rows = bench_moe.main(TINY + AGAINST)
    finally:
        torch.set_num_threads(threads)  # the benchmark sets torch's threads for this process
    assert tuple(getattr(moe, k) for k in bench_moe.KNOBS) == knobs and 0 not in knobs  # the other sides put them back
    assert cpu_gemv._ext is own  # and the other build's side its kernel
    data = json.loads((tmp_path / "moe-tiny.json").read_text())
    assert data["results"] == json.loads(json.dumps(rows))
    assert data["torch"] == torch.__version__ and data["threads"] == [1] and isinstance(data["cpu_flags"], list)
    cfg = data["configs"]
    assert cfg["moe"]["num_experts"] == 8 and cfg["dense"]["num_experts"] == 0
    assert cfg["dense"]["intermediate_size"] == 2 * 32
    shares = data["moe_params"]  # the same active parameters, but for the router (2 layers x 64 x 8)
    assert shares["router_params"] == 2 * 64 * 8
    assert shares["active_params"] - shares["router_params"] == data["dense_active_params"]
    assert [(r["dtype"], r["threads"], r["step"]) for r in rows] == [
        (d, 1, s) for d in ("float32", "bfloat16") for s in ("prefill_16", "decode_b1", "decode_b4")]
    for r in rows:
        assert r["moe_ms"] > 0 and r["dense_ms"] > 0 and r["moe_rows_ms"] > 0 and r["moe_grouped_ms"] > 0
        assert r["moe_untiled_ms"] > 0 and r["moe_untiled_ratio"] == r["moe_untiled_ms"] / r["dense_ms"]
        assert r["moe_grouped_ratio"] == r["moe_grouped_ms"] / r["dense_ms"]
        assert (r["moe_against_ms"] > 0) if AGAINST else "moe_against_ms" not in r
        assert r["ratio"] == r["moe_ms"] / r["dense_ms"] and r["goal_met"] == (r["ratio"] <= bench_moe.GOAL)
        assert len(r["samples_ms"]["moe"]) == len(r["samples_ms"]["dense"]) == 1
        assert 2 <= r["experts_touched_per_layer"] <= 8 and r["bytes_ratio"] > 1
    b1 = [r for r in rows if r["step"] == "decode_b1"]
    assert all(r["experts_touched_per_layer"] == 2 for r in b1)  # one row: its top-2
    assert all(r["bytes_ratio"] < next(q for q in rows if q["step"] == "prefill_16")["bytes_ratio"] for r in b1)
    table = (tmp_path / "moe-tiny.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and "row form only ms" in table[0] and "grouped path ms" in table[0]
    assert "without AMX tiles ms" in table[0]


def test_balanced_routing_draws_the_picks_and_puts_the_router_back(tmp_path, monkeypatch):
    """`--balanced-routing`: every layer's picks are the seeded draws' top-k (the same in every call),
    whatever the router says; the engine's router is back afterwards."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    real, threads = moe.route, torch.get_num_threads()
    base = TINY[:TINY.index("--grouped")] + ["--dtype", "float32", "--batches", "4", "--name", "moe-balanced"]
    try:
        rows = bench_moe.main(base + ["--balanced-routing"])
    finally:
        torch.set_num_threads(threads)
    assert moe.route is real
    draws = torch.randn((16, 8), generator=torch.Generator().manual_seed(0))  # 16 prompt tokens, 8 experts, top-2
    prefill = next(r for r in rows if r["step"] == "prefill_16")
    assert prefill["experts_touched_per_layer"] == draws.topk(2, dim=-1).indices.unique().numel()
    decode = next(r for r in rows if r["step"] == "decode_b4")
    assert decode["experts_touched_per_layer"] == draws[:4].topk(2, dim=-1).indices.unique().numel()
