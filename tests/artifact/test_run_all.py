"""The artifact evaluation: `run_all.sh --smoke` end to end (every step run on a minimal workload or
skipped with its reason, one report), resumption, --force, and the runner's handling of failing,
silent and hung steps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifact.evaluation.runner import FAILED, OK, run_steps
from artifact.evaluation.steps import STEPS, Plan, Step

ROOT = Path(__file__).resolve().parents[2]


def run_all(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "BULLET_PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "artifact" / "run_all.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["step"]: json.loads(p.read_text()) for p in run_dir.glob("*/step.json")}


def test_smoke_run_reports_every_step_and_resumes(tmp_path):
    first = run_all("--smoke", "--results-dir", str(tmp_path))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = tmp_path / "smoke"
    progress = [ln for ln in first.stdout.splitlines() if re.match(r"\[artifact\]\s+\d+/\d+ ", ln)]
    assert len(progress) == len(STEPS)  # one progress line per step
    recs = records(run_dir)
    assert set(recs) == {s.name for s in STEPS}
    for name in ("environment", "estimator", "control_plane", "sim_comparison", "timeline", "static_splits"):
        assert recs[name]["status"] == OK, recs[name]
    for name in ("engine", "estimator_cpu", "cpu_comparison"):
        assert recs[name]["status"] == "skipped" and recs[name]["reason"]
    for name in ("ablation", "prefix"):  # hooks whose features have landed: they run
        assert recs[name]["status"] == OK, recs[name]

    report = (run_dir / "report.md").read_text()
    for step in STEPS:
        assert step.title in report
    assert "python -m artifact.sim_comparison" in report and "bench_control_plane.py" in report
    assert "##### Azure-Code (SLO" in report  # the inlined results.md nests under the step heading
    assert re.search(r"attain \[95% CI\]", report) and "tie" in report
    figures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert len(figures) >= 4 and all((run_dir / f).is_file() for f in figures)
    env = json.loads(next(run_dir.glob("*_environment/environment.json")).read_text())
    assert env["cpu"]["flags"] and env["usable_cores"] and env["git"]["commit"]

    # resumed: nothing that succeeded runs again; --force re-runs what --only names
    started = {k: v.get("started_utc") for k, v in recs.items()}
    time.sleep(1.1)
    second = run_all("--smoke", "--results-dir", str(tmp_path))
    assert second.returncode == 0, second.stdout[-3000:]
    assert second.stdout.count("done earlier") == sum(r["status"] == OK for r in recs.values())
    assert {k: v.get("started_utc") for k, v in records(run_dir).items()} == started
    forced = run_all("--smoke", "--results-dir", str(tmp_path), "--force", "--only", "timeline")
    assert forced.returncode == 0, forced.stdout[-3000:]
    after = records(run_dir)
    assert after["timeline"]["started_utc"] != started["timeline"]
    assert after["sim_comparison"]["started_utc"] == started["sim_comparison"]


def test_list_shows_what_each_mode_runs():
    out = run_all("--quick", "--list", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m artifact.cpu_comparison" in out.stdout and "--num-prompts 60" in out.stdout
    assert "not available" in out.stdout or "partition-only" in out.stdout


def _step(name: str, *commands: list[str], expect=(), timeout=None) -> Step:
    return Step(name, name, "-", lambda mode, out: Plan([list(c) for c in commands], expect=list(expect),
                                                        timeout_s=timeout))


def test_runner_records_failures_and_retries_them(tmp_path, capsys):
    ok = _step("ok", [sys.executable, "-c", "print('hello')"])
    bad = _step("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    silent = _step("silent", [sys.executable, "-c", "pass"], expect=["result.json"])
    outcomes = run_steps([(1, ok), (2, bad), (3, silent)], tmp_path, "smoke", force=False, total=3)
    status = {o.step.name: o.record for o in outcomes}
    assert status["ok"]["status"] == OK and "hello" in (tmp_path / "01_ok" / "log.txt").read_text()
    assert status["bad"]["status"] == FAILED and status["bad"]["returncode"] == 3
    assert status["silent"]["status"] == FAILED and "result.json" in status["silent"]["reason"]
    again = run_steps([(1, ok), (2, bad)], tmp_path, "smoke", force=False, total=3)
    assert [o.reused for o in again] == [True, False]  # a failed step is retried, a finished one kept
    assert "done earlier" in capsys.readouterr().out


def test_a_step_past_its_timeout_loses_its_whole_process_tree(tmp_path):
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys, time; "
             f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    hung = _step("hung", [sys.executable, "-c", spawn], timeout=3)
    t0 = time.monotonic()
    [outcome] = run_steps([(1, hung)], tmp_path, "smoke", force=False, total=1)
    assert time.monotonic() - t0 < 60
    assert outcome.record["status"] == FAILED and outcome.record["returncode"] == 124
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    state = Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] if Path(f"/proc/{child}").exists() else "gone"
    assert state in ("gone", "Z")


@pytest.mark.parametrize("mode", ["smoke", "quick", "full"])
def test_every_mode_plans_every_step(mode, tmp_path):
    for step in STEPS:
        plan = step.plan(mode, tmp_path / step.name)
        assert plan.commands or plan.skip or plan.unavailable, step.name
        if mode != "smoke":
            assert not plan.skip, f"{step.name} is skipped in {mode} mode: {plan.skip}"


def test_sigterm_stops_the_running_step_and_still_writes_the_report(tmp_path):
    """A run that is killed leaves no step process behind, and the next run resumes it."""
    env = {**os.environ, "BULLET_PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(ROOT / "artifact" / "run_all.sh"), "--smoke", "--results-dir", str(tmp_path),
                             "--only", "environment", "sim_comparison"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    run_dir = tmp_path / "smoke"
    deadline = time.monotonic() + 120
    while not (run_dir / "07_sim_comparison" / "log.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.terminate()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in out
    assert (run_dir / "report.md").exists()
    step = records(run_dir).get("sim_comparison")
    assert step is None or step["status"] != OK  # not recorded as done: the next run redoes it
    assert processes_mentioning(str(run_dir / "07_sim_comparison")) == []


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
