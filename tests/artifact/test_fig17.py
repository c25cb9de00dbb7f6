"""`python -m artifact.fig17` on a tiny load: it writes the simulated curve, the table set against
the paper's quoted numbers, and the figure."""

from __future__ import annotations

import json

from artifact.fig17 import PAPER, main


def test_fig17_writes_a_simulated_curve_set_against_the_paper(tmp_path):
    main(["--workloads", "sharegpt", "--systems", "bullet", "--duration", "6", "--seeds", "1", "--no-sweep",
          "--jobs", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["simulated"] is True and data["setup"]["tp_size"] == 8
    assert data["setup"]["link"]["bus_bandwidth"] == 20e9  # the paper's Table 3 server by default
    curve = data["curves"]["sharegpt"]["bullet"]
    assert sorted(curve, key=float) == ["1", "2", "3", "4", "5"]
    assert all(point["mean_norm_latency_s"] > 0 for point in curve.values())
    report = (tmp_path / "results.md").read_text()
    assert report.startswith("# SIMULATED Bullet Fig. 17")
    quoted = PAPER[("sharegpt", 3.0)]["bullet"]
    assert f"| sharegpt | 3 | bullet | {quoted * 1e3:.0f} | {curve['3']['mean_norm_latency_s'] * 1e3:.1f} |" in report
    assert (tmp_path / "fig17.png").stat().st_size > 10_000
