"""The prefix-cache comparison driver (`python -m artifact.prefix_comparison`): its smoke mode runs the
simulated part of both workloads in seconds and writes a report in which the cache serves prompt
tokens only when it is on, and cuts TTFT; the served part is skipped with its reason."""

from __future__ import annotations

import json

from artifact.prefix_comparison import main, ratios
from artifact.prefix_runs import mean_interval


def test_smoke_mode_simulates_both_workloads(tmp_path):
    main(["--mode", "smoke", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert "served" not in result and "smoke" in result["served_skipped"]
    for workload in ("shared-prefix", "multi-turn"):
        rows = result["sim"][workload]
        assert {(r["system"], r["cache"]) for r in rows} == {("bullet", "off"), ("bullet", "on"),
                                                          ("chunked:256", "off"), ("chunked:256", "on")}
        for r in rows:
            assert r["requests"] > 0 and 0.0 <= r["attainment"] <= 1.0
            assert (r["hit %"] > 50.0) if r["cache"] == "on" else r["hit %"] == 0.0
        by = {(r["system"], r["cache"]): r for r in rows}
        for system in ("bullet", "chunked:256"):  # a prefix served from the cache is not recomputed
            assert by[(system, "on")]["mean TTFT ms"] < by[(system, "off")]["mean TTFT ms"]
    turns = {r["system"] + r["cache"]: r["later-turn TTFT ms"] for r in result["sim"]["multi-turn"]}
    assert turns["bulleton"] < turns["bulletoff"]
    report = (tmp_path / "results.md").read_text()
    assert "### shared-prefix" in report and "### multi-turn" in report and "Skipped:" in report
    assert "cache off ÷ on: bullet:" in report


def test_ratios_and_intervals():
    rows = [{"system": "a", "cache": "off", "mean TTFT ms": {"value": 30.0, "low": 20.0, "high": 40.0}},
            {"system": "a", "cache": "on", "mean TTFT ms": {"value": 10.0, "low": 5.0, "high": 15.0}},
            {"system": "b", "cache": "on", "mean TTFT ms": 4.0}]  # no "off" row: no ratio
    assert ratios(rows) == ["a: 3.0×"]
    iv = mean_interval([1.0, 2.0, 3.0, 4.0, 100.0])
    assert iv["low"] < iv["value"] < iv["high"] and iv["value"] == 22.0
    assert mean_interval([5.0] * 10) == {"value": 5.0, "low": 5.0, "high": 5.0}
