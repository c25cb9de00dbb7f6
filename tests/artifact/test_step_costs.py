"""`artifact.step_costs`: lines through a served run's steps, from hand-built timelines whose costs
are known."""

from __future__ import annotations

import json
import random

import pytest

from artifact.step_costs import main, step_costs


def write(path, rows, junk=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + (['{"t": 1, "run": tr'] if junk else [])  # a line cut off at shutdown
    path.write_text("\n".join(lines) + "\n")


def test_known_costs_come_back(tmp_path):
    g = random.Random(0)
    unified = []
    for i in range(60):  # decode steps: 7 ms + 0.07 ms per 1k context tokens
        ctx = g.randint(1000, 120000)
        unified.append({"run": True, "chunks": [], "decode_batch": 50, "context": ctx, "obs_ms": 7 + 0.07 * ctx / 1e3,
                        "units": 132})
    for i in range(40):  # mixed steps of a full 1024-token budget: 35 ms + 0.35 ms per decode row
        rows = g.randint(1, 120)
        tokens = g.randint(930, 1024)
        unified.append({"run": True, "chunks": [[tokens - 100, 0], [100, 500]], "decode_batch": rows,
                        "context": 1000 * rows, "obs_ms": 35 + 0.35 * rows, "units": 132})
    unified.append({"run": True, "chunks": [[1024, 0]], "decode_batch": 3, "context": 10, "obs_ms": 700.0})  # a set-up
    unified.append({"run": True, "chunks": [[300, 0]], "decode_batch": 3, "context": 10, "obs_ms": 12.0})  # a short chunk
    unified.append({"run": False, "chunks": [], "decode_batch": 0, "context": 0})  # a decision that ran nothing
    write(tmp_path / "chunked-1024" / "unified.jsonl", unified, junk=True)
    prefill = [{"run": True, "layers": 4, "tokens": n, "obs_ms": 4 * (0.6 if n < 256 else 1.2)} for n in (16, 40, 100, 300, 700)]
    decode = [{"run": True, "batch": 8, "context": 1000 * k, "units": u, "obs_ms": (13 if u == 16 else 9) + 0.4 * k}
              for u in (16, 32) for k in range(1, 31)] + [{"run": True, "batch": 2, "context": 5, "units": 64, "obs_ms": 5.0}]
    write(tmp_path / "bullet" / "prefill.jsonl", prefill)
    write(tmp_path / "bullet" / "decode.jsonl", decode)

    costs = step_costs(tmp_path)
    chunked = costs["chunked-1024"]["unified"]
    d = chunked["decode on 132 units: ms = a + b x 1k context tokens"]
    assert d["a_ms"] == pytest.approx(7.0) and d["b_ms"] == pytest.approx(0.07) and d["steps"] == 60
    (name, m), = [(k, v) for k, v in chunked.items() if k.startswith("mixed")]
    assert name.startswith("mixed, 922-1024 new tokens")  # the budget's band: the 300-token step is out
    assert m["a_ms"] == pytest.approx(35.0) and m["b_ms"] == pytest.approx(0.35) and m["steps"] == 40  # set-up left out
    bins = costs["bullet"]["prefill"]["prefill layer groups: median ms per layer, by tokens"]
    assert bins == {"1-63": {"ms_per_layer": 0.6, "steps": 2}, "64-255": {"ms_per_layer": 0.6, "steps": 1},
                    "256-1023": {"ms_per_layer": 1.2, "steps": 2}}
    shares = costs["bullet"]["decode"]
    assert set(shares) == {f"decode on {u} units: ms = a + b x 1k context tokens" for u in (16, 32)}  # 64: one step
    assert shares["decode on 16 units: ms = a + b x 1k context tokens"]["a_ms"] == pytest.approx(13.0)


def test_the_command_prints_the_table_and_refuses_what_is_not_a_timeline(tmp_path, capsys):
    write(tmp_path / "t" / "static" / "decode.jsonl",
          [{"run": True, "batch": 4, "context": 1000 * k, "units": 88, "obs_ms": 8 + 0.2 * k} for k in range(1, 6)])
    assert main([str(tmp_path / "t"), "--json", str(tmp_path / "c.json")]) == 0
    assert "| static | decode | 5 | decode on 88 units" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["static"]["decode"]
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "missing")])
    assert exit_.value.code == 2
