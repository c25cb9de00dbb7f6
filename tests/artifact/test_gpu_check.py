"""scripts/gpu_check.sh without a GPU: the dry run (every step with its budget; every carried wheel
present, or exit 2 naming the missing ones and how to fetch them), the step selection, the served
comparison fitting itself to the time left, the orchestration's deadlines with stand-in steps, and
the report written from a results dict."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifact.benchmarks.llamacpp_build import safe_extract
from artifact.gpu_check import cli, report, steps, wheels
from artifact.gpu_check.plan import CPU_SMOKE, GPU, NAMES, select
from artifact.gpu_check.serve import fit, point_requests, same_points

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def dry_run(wheel_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--wheels-dir", str(wheel_dir), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def fake_wheels(folder: Path, pins: list[wheels.Pin]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for pin in pins:
        (folder / f"{pin.name.replace('-', '_')}-{pin.version}-py3-none-any.whl").write_bytes(b"PK")


def test_dry_run_names_every_missing_wheel_and_how_to_fetch_it(tmp_path):
    pins = wheels.read_pins()
    fake_wheels(tmp_path, pins[:2])
    out = dry_run(tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    for pin in pins[2:]:
        assert str(pin) in out.stdout
    assert str(pins[0]) not in out.stdout.split("missing")[1]
    assert wheels.FETCH_COMMAND in out.stdout


def test_dry_run_lists_every_step_with_its_budget_and_passes_with_the_wheels(tmp_path):
    fake_wheels(tmp_path, wheels.read_pins())
    out = dry_run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in NAMES:
        assert f"  {name} " in out.stdout
    assert "480 s in all" in out.stdout and cli.RUN_COMMAND in out.stdout
    assert f"all {len(wheels.read_pins())} pinned wheels" in out.stdout


def test_a_wheel_of_another_version_does_not_count(tmp_path):
    pin = wheels.Pin("pydantic_core", "2.50.5")
    (tmp_path / "pydantic_core-2.40.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"PK")
    assert wheels.missing(tmp_path, [pin]) == [pin]
    (tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"PK")
    assert wheels.missing(tmp_path, [pin]) == []
    assert [p.name for p in wheels.pinned_files(tmp_path, [pin])] == ["pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl"]
    assert wheels.normalize("Typing.Inspection") == wheels.normalize("typing_inspection")


def test_a_bad_pin_line_is_a_clear_error(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("# comment\npydantic==2.14.4\nfastapi\n")
    with pytest.raises(ValueError, match="pins.txt:3"):
        wheels.read_pins(bad)


def test_step_selection_adds_setup_and_mps_and_refuses_unknown_steps():
    assert [s.name for s in select(GPU, ["serve"])] == ["env", "install", "build", "mps-start", "serve", "mps-stop"]
    assert [s.name for s in select(GPU, ["bench"], setup=False)] == ["bench"]
    assert [s.name for s in select(GPU, None)] == list(NAMES)
    with pytest.raises(ValueError, match="unknown step"):
        select(GPU, ["bench", "coffee"])
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--steps", "coffee"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 2 and "coffee" in out.stdout


def test_later_systems_get_the_first_systems_points_never_more():
    # the first system was squeezed to the saturating rate in a 3 s window; a later one, with time to
    # spare after fast starts, is planned all three rates in 6 s: it gets the first's points
    assert same_points(([1.0, 8.0, 24.0], 6.0), ([24.0], 3.0)) == ([24.0], 3.0)
    # and with less time than the first, fewer
    assert same_points(([24.0], 3.0), ([1.0, 24.0], 4.5)) == ([24.0], 3.0)
    plan = GPU.serve
    squeezed = fit(plan, 120.0, [25.0] * 4)
    roomy = fit(plan, 400.0, [25.0])
    assert squeezed and roomy and len(roomy[0]) > len(squeezed[0])
    assert same_points(roomy, squeezed) == squeezed


def test_the_served_comparison_fits_itself_to_the_time_left():
    sp = GPU.serve
    four = [sp.launch_s] * 4
    rates, window = fit(sp, 1000, four)
    assert rates == list(sp.rates) and window == sp.window_s
    assert point_requests(sp, 24.0, window) == 144 and point_requests(sp, 1.0, window) == sp.min_requests
    rates, window = fit(sp, 4 * 60, four)  # a minute each: shorter windows, then fewer rates
    assert window < sp.window_s and rates[-1] == max(sp.rates) and len(rates) < len(sp.rates)
    squeezed = fit(sp, 4 * 45, four)
    assert squeezed is not None and squeezed[0] == [max(sp.rates)]  # saturation is the last rate to go
    # too little for four: this system still runs, as if the last ones were not there
    assert fit(sp, 70, four) == fit(sp, 70, four[:1]) is not None
    assert fit(sp, 30, four) is None
    # a system whose start takes longer (bullet measuring its profile) is planned with it
    assert fit(sp, 360, four) == (list(sp.rates), sp.window_s)
    assert fit(sp, 360, [sp.launch_s + 75] + four[1:])[1] < sp.window_s


def _run(tmp_path: Path, monkeypatch, functions: dict, budget: float, names: list[str] | None = None) -> dict:
    """A cpu-smoke run whose steps are `functions` (stand-ins: nothing is launched)."""
    args = cli.parse(["--cpu-smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                      "--budget", str(budget), *(["--steps", ",".join(names)] if names else [])])
    monkeypatch.setattr(cli, "step_functions", lambda: functions)
    code = cli.Run(CPU_SMOKE, select(CPU_SMOKE, names), args).go()
    folder = next((tmp_path / "out").iterdir())
    results = json.loads((folder / "results.json").read_text())
    assert (folder / "report.md").exists() and (folder / "progress.log").exists() and (folder / "logs.tgz").exists()
    return {"code": code, "results": results, "folder": folder}


def test_a_failing_step_is_recorded_and_the_run_goes_on_within_its_budget(tmp_path, monkeypatch):
    def env(ctx, timeout):
        ctx.info = {"date": "2026-01-02", "commit": "abc", "torch": {}}
        return steps.result("pass", "stand-in env")

    def broken(ctx, timeout):
        raise RuntimeError("a bug in this step")

    def slow(ctx, timeout):
        time.sleep(min(timeout, 0.5))
        return steps.result("pass", f"had {timeout:.0f} s")

    functions = {name: slow for name in NAMES} | {"env": env, "doctor-nomps": broken}
    began = time.monotonic()
    out = _run(tmp_path, monkeypatch, functions, budget=CPU_SMOKE.total_s)
    assert time.monotonic() - began < 30
    got = out["results"]["steps"]
    assert out["code"] == 0 and out["folder"].name == "cpu-smoke-2026-01-02"
    assert got["doctor-nomps"]["status"] == "error" and "a bug in this step" in got["doctor-nomps"]["summary"]
    assert got["bench"]["status"] == "pass" and got["serve"]["status"] == "pass"
    assert got["doctor-mps"]["status"] == "skipped"  # the plan's own skip, with its reason
    assert all(s["cap_s"] > 0 for s in got.values())


def test_steps_that_do_not_fit_are_skipped_with_the_reason(tmp_path, monkeypatch):
    def env(ctx, timeout):
        ctx.info = {"date": "2026-01-02", "commit": "abc", "torch": {}}
        return steps.result("pass", "stand-in env")

    functions = {name: (lambda ctx, timeout: steps.result("pass", "ok")) for name in NAMES} | {"env": env}
    # the budget covers the setup steps and serve's minimum, not the bench before it
    out = _run(tmp_path, monkeypatch, functions, budget=CPU_SMOKE.step("serve").min_s + 20, names=["bench", "serve"])
    got = out["results"]["steps"]
    assert got["bench"]["status"] == "skipped" and "later steps" in got["bench"]["summary"]
    assert got["serve"]["status"] == "pass"


def test_a_failed_setup_step_ends_the_run_with_exit_1(tmp_path, monkeypatch):
    def env(ctx, timeout):
        ctx.info = {"date": "2026-01-02", "commit": "abc", "torch": {}}
        return steps.result("pass", "stand-in env")

    functions = {name: (lambda ctx, timeout: steps.result("pass", "ok")) for name in NAMES}
    functions |= {"env": env, "build": lambda ctx, timeout: steps.result("fail", "no compiler")}
    out = _run(tmp_path, monkeypatch, functions, budget=300)
    assert out["code"] == 1 and "build" in out["results"]["run"]["ended_early"]
    assert "bench" not in out["results"]["steps"]


def synthetic_results() -> dict:
    point = {"requests": 8, "completed": 8, "duration_s": 9.0, "req_per_s": 0.9, "output_tok_per_s": 115.0,
             "ttft_p50_s": 0.05, "ttft_p90_s": 0.08, "tpot_p50_s": 0.007, "tpot_p90_s": 0.009, "itl_p99_s": 0.02,
             "attainment": 1.0}
    sat = dict(point, requests=144, completed=120, req_per_s=19.5, tpot_p50_s=0.03, attainment=0.6)
    engine = {"config": {"model": "llama-3.1-8b", "dtype": "bfloat16", "device": "NVIDIA H200"},
              "rates": {"copy_gbs": 4200.0, "copy_mib": 1024, "gemm_tflops": 790.0, "gemm_n": 8192},
              "prefill": {"tokens": 2048, "ms": 50.0, "model_tflop": 29.7, "tflops": 594.0, "of_gemm": 0.75},
              "decode": [{"batch": 1, "context": 1024, "graphs": "on", "floor_ms": 3.6, "ms": 5.0, "tok_s": 200.0,
                          "over_floor": 1.39},
                         {"batch": 128, "context": 512, "graphs": "on", "floor_ms": 5.6, "error": "no graph bucket"}],
              "mixed": [{"prompt": 512, "batch": 128, "context": 512, "split_ms": 30.0, "one_extend_ms": 48.0,
                         "one_extend_x_split": 1.6}],
              "fused": [{"step": "decode 1x1024 graphs on", "fused_ms": 5.0, "torch_lines_ms": 6.0,
                         "torch_lines_x_fused": 1.2}],
              "goals": [{"goal": "decode 1x1024, graphs on", "measured": 1.39, "target": "<= 1.5x floor", "met": True, "unit": "x"},
                        {"goal": "decode 128x512, graphs on", "measured": None, "target": "<= 2x floor", "met": False, "unit": "x"}]}
    return {"run": {"plan": "gpu", "device": "cuda", "model": "llama-3.1-8b (bfloat16, dummy)", "budget_s": 480, "elapsed_s": 470.0},
            "machine": {"gpu": "NVIDIA H200", "driver": "580.159.04", "date": "2026-11-27", "commit": "0123abcd",
                        "commit_source": "BULLET_COMMIT", "torch": {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "sms": 132}},
            "steps": {"bench": {"status": "pass", "summary": "1 of 2 goals met", "seconds": 40, "cap_s": 120, "mps": False,
                                "engine": engine},
                      "doctor-nomps": {"status": "fail", "summary": "1 FAIL", "mps": False, "seconds": 20, "cap_s": 70,
                                       "checks": [{"name": "MPS daemon", "status": "FAIL", "summary": "not running"}]},
                      "doctor-mps": {"status": "pass", "summary": "ok", "mps": True, "seconds": 20, "cap_s": 70,
                                     "checks": [{"name": "MPS daemon", "status": "PASS", "summary": "running"}]},
                      "replay": {"status": "skipped", "summary": "no profile", "step_costs": {"chunked-1024": {"unified": {
                          "mixed, 922-1024 new tokens: ms = a + b x decode rows": {"a_ms": 35.2, "b_ms": 0.366, "r2": 0.97,
                                                                                  "steps": 161}}}}},
                      "serve": {"status": "fail", "summary": "2 of 3", "mps": True, "seconds": 200, "cap_s": 330,
                                "slo": "TTFT 3ms/token, TPOT 50ms",
                                "workload": {"prompt_tokens": [128, 2048], "output_tokens": 128},
                                "systems": {"bullet": {"backend": "green-ctx", "per_rate": {"1": point, "24": sat},
                                                       "goodput_req_s": 1.0, "launch_s": 20.0, "exit": 0},
                                            "static": {"backend": "green-ctx",
                                                       "per_rate": {"1": dict(point, tpot_p50_s=0.009), "24": dict(sat, req_per_s=12.0)}},
                                            "sglang:1024": {"backend": "none", "skipped": "20 s left: not one point fits"}}}}}


def test_the_report_judges_every_goal_and_labels_every_number(tmp_path):
    report.write(synthetic_results(), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    verdicts = {g["goal"]: g["met"] for g in results["goals"]}
    assert verdicts["decode 1x1024, graphs on"] is True and verdicts["decode 128x512, graphs on"] is False
    assert verdicts["served throughput, best policy (bullet)"] is True  # 19.5 >= 18 req/s
    assert verdicts["TPOT p50 at 1 req/s, bullet (bullet)"] is True      # 7 ms <= 8 ms
    md = (tmp_path / "report.md").read_text()
    assert "NVIDIA H200" in md and "0123abcd" in md and "580.159.04" in md and "torch 2.11.0+cu130" in md
    assert "**not met**" in md and "| bullet | green-ctx | 24 | 120/144 | 19.50 |" in md
    assert "20 s left: not one point fits" in md and "no graph bucket" in md
    assert "| MPS daemon | FAIL: not running | PASS: running |" in md
    assert "| 512 + 128x512 | 30.00 | 48.00 | 1.60x |" in md  # mixed steps: the split beside one extend
    assert "| decode 1x1024 graphs on | 5.00 | 6.00 | 1.20x |" in md  # fused stages beside torch lines
    assert "| chunked-1024 | unified | 161 | mixed, 922-1024 new tokens" in md  # the served steps' costs


def test_the_report_of_a_run_that_measured_nothing_says_so(tmp_path):
    report.write({"run": {"plan": "gpu"}, "machine": {}, "steps": {"serve": {"status": "skipped", "summary": "no time"}}},
                 tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "No goal measured" in md and "Not measured (skipped: no time)" in md


def test_a_server_that_did_not_start_is_reported_by_the_exceptions_its_log_names(tmp_path):
    from artifact.gpu_check.serve import failure_reason

    log = tmp_path / "server.log"
    log.write_text("INFO loaded\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "AttributeError: 'str' object has no attribute 'type'\nERROR:    Traceback\n"
                   "bullet.launcher.launcher.WorkerStartupError: unified worker exited with code 1\n")
    assert failure_reason(log) == ("AttributeError: 'str' object has no attribute 'type' / "
                                   "bullet.launcher.launcher.WorkerStartupError: unified worker exited with code 1")
    assert failure_reason(tmp_path / "missing.log") is None


def test_every_served_system_keeps_its_step_timeline(tmp_path):
    """The served comparison's servers write their step timelines under logs/timeline/<system>/ (packed
    into logs.tgz): what `sim_validation --served-steps-by-system` replays the GPU run with."""
    from artifact.gpu_check.serve import Launch
    from artifact.gpu_check.steps import Context

    ctx = Context(root=tmp_path, plan=GPU, work=tmp_path / "work", wheel_dir=tmp_path / "wheels", env={})
    for policy in ("bullet", "chunked:1024"):
        args = Launch(ctx, policy, "green-ctx", None, 60.0).server.args
        at = args.index("--timeline-dir")
        assert args[at + 1] == str(ctx.logs / "timeline" / policy.replace(":", "-"))


def test_the_report_says_what_the_profile_measured(tmp_path):
    """A given profile's padding verdict and its hybrid steps against decode's calibration reach the report."""
    from types import SimpleNamespace

    from engines.model_config import ModelConfig
    from estimator.profile import EstimatorProfile
    from estimator.profiler.fit import build_estimator
    from estimator.profiler.padding import decide_padding
    from artifact.gpu_check.steps import profile_step
    from tests.estimator.test_hybrid_samples import _samples
    from tests.estimator.test_local_profile import TINY_HF_CONFIG, two_core_cpu

    model, hw = ModelConfig.from_hf_dict(TINY_HF_CONFIG, name="tiny"), two_core_cpu()
    verdict = decide_padding(14.5e-3, 10e-3, 14e-3, "decode[32x512..2048] on 132 SMs")
    given = tmp_path / "given.json"
    EstimatorProfile.from_estimator(build_estimator(model, hw, "bf16", _samples(model, hw, 1.7)),
                                    ["measured somewhere", verdict.note]).write(given)
    ctx = SimpleNamespace(work=tmp_path, given_profile=given, profile=None)
    step = profile_step(ctx, 10.0)
    assert step["status"] == "pass" and step["findings"][0] == verdict.note
    hybrid = step["findings"][1:]
    assert len(hybrid) == 4 and all("from decode's calibration (-" in line for line in hybrid), hybrid  # 1.7x slower
    results = synthetic_results()
    results["steps"]["profile"] = dict(step, seconds=1, cap_s=120, mps=True)
    report.write(results, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## What the profile measured" in md and "priced as padded to the longest context" in md
    assert hybrid[0] in md


def test_the_step_table_imports_nothing_the_install_step_brings():
    """On a GPU image the control plane's packages arrive with the install step: building the step
    table (before any step runs) must not import them."""
    code = ("import sys; import artifact.gpu_check.cli as cli; cli.step_functions(); "
            "bad = sorted(m for m in ('pydantic', 'zmq', 'posix_ipc', 'fastapi', 'bullet', 'estimator') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_replay_step_replays_a_gpu_runs_served_points(tmp_path):
    """On the committed H200 run (its per-request files, step timelines and profile): the replay step
    runs `artifact.sim_validation` on them and the report quotes its table; without served points or
    a profile it says why it has nothing to replay."""
    import tarfile

    from artifact.gpu_check.replay import replay_command, replay_step
    from artifact.gpu_check.steps import Context

    logs = ROOT / "docs" / "gpu" / "nvidia-h200-2026-11-26-b" / "logs.tgz"
    work = tmp_path / "work"
    ctx = Context(root=ROOT, plan=GPU, work=work, wheel_dir=tmp_path, env=dict(os.environ))
    work.mkdir()
    assert "no served points" in replay_command(ctx, work / "v")
    with tarfile.open(logs) as tgz:
        safe_extract(tgz, work)  # tarfile's "data" filter, or its checks by hand on a Python without it
    assert "no profile" in replay_command(ctx, work / "v")
    ctx.profile = work / "logs" / "profile.json"
    cmd = replay_command(ctx, work / "v")
    assert "--served-steps-by-system" in cmd and "0.003,0,0.05" in cmd  # 3ms/token TTFT, 50ms TPOT
    assert [c.split(",")[1] for c in cmd if c.endswith((",bullet", ",static", ",chunked:1024", ",sglang:1024"))] == \
        ["bullet", "static", "chunked:1024", "sglang:1024"]
    out = replay_step(ctx, 120)
    assert out["status"] == "pass", out
    assert re.match(r"\d+ of 40 P50/P90 cells within the goal; median \|error\| P50 \d+%; median \|error\| P90 \d+%"
                    r"; set-up per new prompt length: bullet \d+ ms, static \d+ ms", out["summary"]), out["summary"]
    section = "\n".join(report._replay_section(out))
    assert section.startswith("## Simulator vs this run") and "| bullet | 24 |" in section and "\n# " not in section
    # and what the served steps cost, from the timelines alone: chunked's mixed steps paid 0.37 ms per decode row
    mixed = out["step_costs"]["chunked-1024"]["unified"]
    (fit,) = [v for k, v in mixed.items() if k.startswith("mixed")]
    assert 0.3 < fit["b_ms"] < 0.45 and fit["steps"] > 100
