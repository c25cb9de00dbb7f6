"""`python -m artifact.served_breakdown` on a small cpu_comparison directory written here: the misses
it counts per system, rate and prompt length, and the core shares it reads from the timelines."""

from __future__ import annotations

import json

import pytest

from artifact.served_breakdown import breakdown, main, markdown

SLO = {"ttft_s_per_token": 0.01, "tpot_s": 0.2}  # a 10-token prompt must see its first token within 0.1 s


def bench_file(path, rows):
    """rows: (prompt tokens, TTFT s, inter-token latencies, error) as bench_serving writes them."""
    result = {"input_lens": [r[0] for r in rows], "output_lens": [len(r[2]) + 1 for r in rows],
              "ttfts": [r[1] for r in rows], "itls": [r[2] for r in rows], "errors": [r[3] for r in rows]}
    path.write_text(json.dumps({"completed": len(rows)}) + "\n" + json.dumps(result) + "\n")


@pytest.fixture
def run_dir(tmp_path):
    systems = {"bullet": {"per_rate": {"2.0": {}}}, "sglang:1024": {"per_rate": {"2.0": {}}}}
    (tmp_path / "results.json").write_text(json.dumps({"slo": SLO, "systems": systems}))
    bench_file(tmp_path / "bench-bullet-2.0-0.jsonl", [
        (10, 0.05, [0.1, 0.1], ""),    # meets both
        (10, 0.30, [0.1], ""),         # TTFT missed, 8-15 tokens
        (100, 0.50, [0.3, 0.3], ""),   # TPOT missed only (target 1 s)
    ])
    bench_file(tmp_path / "bench-bullet-2.0-1.jsonl", [(3, 0.0, [], "connection reset")])  # failed: misses both
    bench_file(tmp_path / "bench-sglang-1024-2.0-0.jsonl", [(10, 0.05, [0.1], "")])
    timeline = tmp_path / "timeline" / "bullet"
    timeline.mkdir(parents=True)
    prefill = [{"role": "prefill", "run": True, "units": 1, "obs_ms": 300.0},
               {"role": "prefill", "run": True, "units": 2, "obs_ms": 100.0},
               {"role": "prefill", "run": False, "units": 0}]
    decode = [{"role": "decode", "run": True, "units": 2, "prefill_units": 0, "obs_ms": 600.0},
              {"role": "decode", "run": True, "units": 1, "prefill_units": 1, "obs_ms": 200.0}]
    (timeline / "prefill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefill))
    (timeline / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decode))
    return tmp_path


def test_misses_are_counted_per_prompt_length_across_repeats(run_dir):
    data = breakdown(run_dir)
    bullet = data["systems"]["bullet"]["per_rate"]["2.0"]
    assert (bullet["requests"], bullet["ttft_missed"], bullet["tpot_missed"]) == (4, 2, 2)
    assert bullet["by_prompt"]["8-15"] == {"requests": 2, "ttft_missed": 1, "mean_ttft_s": pytest.approx(0.175)}
    assert bullet["by_prompt"]["2-3"]["ttft_missed"] == 1 and bullet["by_prompt"]["64-127"]["ttft_missed"] == 0
    sglang = data["systems"]["sglang:1024"]
    assert sglang["per_rate"]["2.0"]["ttft_missed"] == 0 and sglang["timeline"] is None  # one process, no split


def test_timeline_shares_say_where_prefill_ran_and_when_decode_had_the_cores(run_dir):
    t = breakdown(run_dir)["systems"]["bullet"]["timeline"]
    assert t["prefill_busy_s"] == pytest.approx(0.4)
    assert t["prefill_share_by_units"] == {1: pytest.approx(0.75), 2: pytest.approx(0.25)}
    assert t["decode_share_by_units"] == {1: pytest.approx(0.25), 2: pytest.approx(0.75)}
    assert t["decode_prefill_idle"] == pytest.approx(0.75)
    text = markdown(breakdown(run_dir))
    assert "| bullet | 2 | 2/4 | 2/4 |" in text and "1: 75 % / 2: 25 %" in text


def test_the_command_writes_its_tables_and_refuses_other_directories(run_dir, tmp_path, capsys):
    assert main([str(run_dir), "--out", str(run_dir / "breakdown.md")]) == 0
    assert (run_dir / "breakdown.md").read_text() == capsys.readouterr().out
    assert json.loads((run_dir / "breakdown.json").read_text())["systems"]["bullet"]["timeline"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    # results.json copied without its per-request records: an error that says so, not a table of 0/0 rows
    for f in run_dir.glob("bench-sglang*.jsonl"):
        f.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([str(run_dir)])
    assert "no bench-sglang-1024-2.0-*.jsonl for sglang:1024" in capsys.readouterr().err
