"""Triton compiles while serving and kernel fallbacks, from a worker's timeline rows to the device
report: the worker's timeline carries them once non-zero (`bullet.workers.kernel_stats`), the
reader finds them per system and role (`artifact.served_kernels`), the report shows them beside the
engine benchmark's own count and judges "0 Triton compiles while serving"."""

from __future__ import annotations

import json

from artifact.gpu_check import report
from artifact.served_kernels import main, served_kernels
from bullet.loops.timeline import Timeline
from bullet.workers import kernel_stats
from engines import kernel_fallbacks
from engines.triton_compiles import CompileCounter
from tests.artifact.test_gpu_check import synthetic_results


def test_timeline_rows_carry_compiles_and_fallbacks_once_they_happen(tmp_path, monkeypatch):
    counter = CompileCounter()
    monkeypatch.setattr(kernel_stats, "COUNTER", counter)
    kernel_fallbacks.clear()
    folder = tmp_path / "timeline" / "bullet"
    decode = Timeline(str(folder), "decode", annotate=kernel_stats.timeline_fields)
    prefill = Timeline(str(folder), "prefill", annotate=kernel_stats.timeline_fields)
    counter._on_miss(fn=None, repr="rope_kernel[...]")  # during the warm-up: not while serving
    counter.mark_serving()
    decode.record(1.0, 66, run=True)
    prefill.record(1.0, 66, run=True)
    assert set(json.loads(decode._buffer[0])) == {"t", "role", "units", "repartition", "run"}  # nothing to say yet
    counter._on_miss(fn=None, repr="decode_split_kernel[...]")
    kernel_fallbacks.record("fused rms_norm_triton", "torch lines for every fused stage", RuntimeError("no ptxas"))
    decode.record(2.0, 66, run=True)
    decode.record(3.0, 66, run=True)
    for t in (decode, prefill):
        t.flush()
    kernel_fallbacks.clear()
    got = served_kernels(tmp_path / "timeline")
    assert got["bullet"]["prefill"] == {"triton_compiles": 0, "kernel_fallbacks": [], "rows": 1}
    assert got["bullet"]["decode"]["triton_compiles"] == 1 and got["bullet"]["decode"]["rows"] == 3
    assert got["bullet"]["decode"]["kernel_fallbacks"] == [
        "fused rms_norm_triton -> torch lines for every fused stage: RuntimeError: no ptxas"]


def test_the_reader_prints_per_system_and_role(tmp_path, capsys):
    folder = tmp_path / "chunked-1024"
    folder.mkdir()
    (folder / "unified.jsonl").write_text('{"t": 1, "units": 132}\n{"t": 2, "units": 132, "triton_compiles": 3}\n')
    assert main([str(tmp_path)]) == 0
    assert "chunked-1024 unified: 3 Triton compiles while serving, 0 kernel fallbacks (2 timeline rows)" in \
        capsys.readouterr().out


def test_the_report_shows_compiles_and_fallbacks_and_judges_the_goal(tmp_path):
    results = synthetic_results()
    results["steps"]["bench"]["engine"]["kernels"] = {
        "warm_up": {"steps": 15, "split_counts": [1, 2, 4, 8, 16, 32], "seconds": 0.8},
        "triton_compiles": {"counted": True, "warm_up": 11, "after_warm_up": 2,
                            "kernels_after_warm_up": ["extend_kernel"]},
        "fallbacks": [{"kernel": "fused rope_triton", "instead": "torch lines for every fused stage",
                       "error": "CompilationError: bad layout"}]}
    results["steps"]["replay"]["kernels"] = {
        "bullet": {"prefill": {"triton_compiles": 0, "kernel_fallbacks": [], "rows": 500},
                   "decode": {"triton_compiles": 0, "kernel_fallbacks": [], "rows": 900}}}
    report.write(results, tmp_path)
    verdicts = {g["goal"]: g["met"] for g in json.loads((tmp_path / "results.json").read_text())["goals"]}
    assert verdicts["Triton compiles after the warm-up (engine benchmark)"] is False
    assert verdicts["Triton compiles while serving (every served worker)"] is True
    md = (tmp_path / "report.md").read_text()
    assert "## Triton compiles and kernel fallbacks" in md
    assert "11 in the warm-up, **2 after it** (extend_kernel)" in md
    assert "**fused rope_triton fell back** to torch lines for every fused stage: CompilationError: bad layout" in md
    assert "| bullet | decode | 0 | none | 900 |" in md


def test_a_cut_short_engine_benchmark_reports_what_it_finished(tmp_path):
    results = synthetic_results()
    engine = results["steps"]["bench"]["engine"]
    for section in ("decode", "mixed", "fused", "goals"):
        engine.pop(section)
    engine.update(complete=False, sections_done=["rates", "warm_up", "prefill", "new_lengths"])
    report.write(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "**Cut short**: only rates, warm_up, prefill, new_lengths finished" in md
    assert "| prefill 2048 | - | 50.00 |" in md
