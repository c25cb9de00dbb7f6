"""scripts/gpu_check.sh without a GPU: the plans and their budgets (each fits 8 minutes with a minute
to spare), the dry run (every step with its budget; every carried wheel present, or exit 2 naming
the missing ones and how to fetch them), the step selection, the record of which plan ran when and
the stalest pick from it, the served comparison fitting its points to the time left, a steady-state
point's arithmetic (warm-up left out, the drain's bound, cut requests as misses, goodput with its
intervals), the orchestration's deadlines with stand-in steps, and the report written from a
results dict."""

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
from artifact.gpu_check import cli, record, report, sm_probe, steady, steps, wheels
from artifact.gpu_check.plan import CPU_SMOKE, ENGINE, GPU_PLANS, MECHANISM, NAMES, PLANS, SERVE, SPARE_S, select
from artifact.gpu_check.serve_budget import fit, system_cost
from artifact.loadgen import Record
from bullet.types.slo import SLO

GPU = SERVE  # the served comparison's settings (model, pool, SLO) are the GPU plans' own

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


def test_dry_run_of_each_plan_lists_its_steps_with_their_budget_and_passes_with_the_wheels(tmp_path, capsys):
    fake_wheels(tmp_path, wheels.read_pins())
    for plan in GPU_PLANS.values():
        if plan is SERVE:  # through the script once; the others in this process (each start imports torch)
            out = dry_run(tmp_path, "--plan", plan.name)
            code, stdout = out.returncode, out.stdout + out.stderr
        else:
            code = cli.main(["--dry-run", "--plan", plan.name, "--wheels-dir", str(tmp_path)])
            stdout = capsys.readouterr().out
        assert code == 0, stdout
        for name in NAMES:
            assert (f"  {name} " in stdout) == (name in plan.names), (plan.name, name)
        assert "480 s in all" in stdout and cli.RUN_COMMAND.format(plan=plan.name) in stdout
        assert f"expected {plan.expected_s:.0f} s of 480 s" in stdout
        assert f"all {len(wheels.read_pins())} pinned wheels" in stdout
        assert ("serve fits" in stdout) == (plan is SERVE)


def test_every_plan_fits_its_budget_with_a_minute_to_spare():
    """A plan's expected step times (its setup included) and the report leave >= 60 s of its total:
    the 2026-11-26 all-in-one plan expected ~482 s of its 480 and left the served comparison ~175 s."""
    assert SPARE_S >= 60
    for plan in PLANS.values():
        assert plan.expected_s <= plan.total_s - SPARE_S, (plan.name, plan.expected_s)
        assert all(s.min_s <= s.expect_s <= s.cap_s for s in plan.steps), plan.name
    for plan in GPU_PLANS.values():
        assert plan.total_s <= 480 and plan.device == "cuda"
        assert plan.names[:3] == ("env", "install", "build")  # each plan stands on its own setup
    covered = {n for p in GPU_PLANS.values() for n in p.names}
    assert covered == set(NAMES) and set(CPU_SMOKE.names) == set(NAMES)  # the CPU smoke runs every step
    assert {"libsmctrl", "sm-probe", "doctor-nomps", "doctor-mps", "gpu-tests"} <= set(MECHANISM.names)
    assert {"bench", "profile"} <= set(ENGINE.names) and {"profile", "serve", "replay"} <= set(SERVE.names)
    budgets = {s.name: (s.cap_s, s.expect_s, s.min_s) for s in MECHANISM.steps}
    assert budgets["libsmctrl"] == (60, 20, 10)
    # the probe's step is planned on what its configurations are expected to take, with room to spare
    assert sm_probe.expected_seconds() <= budgets["sm-probe"][1] < budgets["sm-probe"][0]


def test_the_serve_plan_leaves_the_served_comparison_three_systems_at_three_rates():
    """When the steps before it take their expected times, the served comparison has bullet and two
    baselines at >= 3 rates, 20 s of arrivals each; with a profile given, every system."""
    before = sum(s.expect_s for s in SERVE.steps[:SERVE.names.index("serve")])
    after = sum(s.min_s for s in SERVE.steps[SERVE.names.index("serve") + 1:])
    left = SERVE.total_s - before - after - SERVE.report_s
    sp = SERVE.serve
    count, rates = fit(sp, left, [sp.launch_s] * len(sp.systems))
    assert count >= 3 and len(rates) >= 3 and sp.window_s >= 20 and sp.systems[0][0] == "bullet"
    assert rates == sorted(rates) and rates[0] <= 6 and rates[-1] >= 18  # around the 12-13 req/s knee
    given = min(SERVE.step("serve").cap_s, left + SERVE.step("profile").expect_s)
    assert fit(sp, given, [sp.launch_s] * len(sp.systems))[0] == len(sp.systems)


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
    assert [s.name for s in select(SERVE, ["serve"])] == ["env", "install", "build", "mps-start", "serve", "mps-stop"]
    assert [s.name for s in select(ENGINE, ["bench"], setup=False)] == ["bench"]
    assert [s.name for s in select(MECHANISM, None)] == list(MECHANISM.names)
    with pytest.raises(ValueError, match="unknown step"):
        select(ENGINE, ["bench", "coffee"])
    with pytest.raises(ValueError, match="serve is in plan serve"):  # a step of another plan: which one
        select(ENGINE, ["serve"])
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--plan", "engine", "--steps", "coffee"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert out.returncode == 2 and "coffee" in out.stdout


def test_the_served_comparison_fits_its_points_to_the_time_left_every_system_the_same():
    sp = GPU.serve
    four = [sp.launch_s] * 4
    cost = lambda n, rates: sum(system_cost(sp, x, rates) for x in four[:n])  # noqa: E731
    assert fit(sp, cost(4, 4), four) == (4, list(sp.rates))  # all of it
    # a little less: the highest rate goes first, every system keeps the same three
    assert fit(sp, cost(4, 4) - 1, four) == (4, list(sp.rates[:3]))
    # then the last systems (static first), never below bullet and one baseline, never below 3 rates
    assert fit(sp, cost(4, 3) - 1, four) == (3, list(sp.rates[:3]))
    assert fit(sp, cost(2, 3), four) == (2, list(sp.rates[:3]))
    assert fit(sp, cost(2, 3) - 1, four) is None
    # a bullet start that measures its own profile is planned with it
    assert fit(sp, cost(3, 3), [sp.launch_s + 75] + four[1:])[0] == 2


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
    # the launcher says why a start failed in one line of its own (a reason the user can fix)
    log.write_text("[w decode] ERROR worker failed:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "RuntimeError: CUDA error: out of memory\nbullet launch: decode worker exited with code 1 during startup\n")
    assert failure_reason(log) == ("RuntimeError: CUDA error: out of memory / "
                                   "bullet launch: decode worker exited with code 1 during startup")


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
    # a profile that timed both phases on every SM says what that cost
    from artifact.gpu_check.profile_findings import findings
    data = json.loads(given.read_text())
    data["contention"]["shared_units"] = [{"kind": "prefill", "factor": 1.31}, {"kind": "decode", "factor": 2.04}]
    given.write_text(json.dumps(data))
    assert findings(given)[-1].startswith("each phase on every SM beside the other on every SM took prefill 1.31x, "
                                          "decode 2.04x its time alone")


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
        [policy for policy, _ in GPU.serve.systems]
    out = replay_step(ctx, 120)
    assert out["status"] == "pass", out
    assert re.match(r"\d+ of 40 P50/P90 cells within the goal; median \|error\| P50 \d+%; median \|error\| P90 \d+%"
                    r"; set-up per new prompt length: bullet \d+ ms, .*static \d+ ms", out["summary"]), out["summary"]
    section = "\n".join(report._replay_section(out))
    assert section.startswith("## Simulator vs this run") and "| bullet | 24 |" in section and "\n# " not in section
    # and what the served steps cost, from the timelines alone: chunked's mixed steps paid 0.37 ms per decode row
    # and the co-run scale of each two-worker system (static's steps co-ran as the profile priced them)
    assert set(out["corun"]) == {"bullet", "static"} and 0.9 < out["corun"]["static"]["scale"] < 1.1
    assert "- static: S = 0.99" in "\n".join(report._costs_section(out))
    mixed = out["step_costs"]["chunked-1024"]["unified"]
    (fit,) = [v for k, v in mixed.items() if k.startswith("mixed")]
    assert 0.3 < fit["b_ms"] < 0.45 and fit["steps"] > 100


# -- which plan ran when, and the stalest -----------------------------------------------------------
PLAN_STEPS = {name: p.names for name, p in GPU_PLANS.items()}


def test_the_stalest_plan_is_one_never_run_then_the_oldest_then_the_one_with_steps_never_run():
    entry = lambda date, *steps: {"date": date, "commit": "c", "steps": {s: "pass" for s in steps}}  # noqa: E731
    full = {name: entry("2026-11-27T10:00:00Z", *steps) for name, steps in PLAN_STEPS.items()}
    assert record.stalest({}, PLAN_STEPS) == "serve"  # none ran: the plans' own order
    assert record.stalest({k: v for k, v in full.items() if k != "engine"}, PLAN_STEPS) == "engine"
    older = dict(full, serve=entry("2026-11-27T09:59:59Z", *PLAN_STEPS["serve"]))
    assert record.stalest(older, PLAN_STEPS) == "serve"
    # the same date: the plan with steps that never ran goes first
    tied = dict(full, engine=entry("2026-11-27T10:00:00Z", "env", "bench"))
    assert record.stalest(tied, PLAN_STEPS) == "engine"
    assert record.never_ran(tied["engine"], PLAN_STEPS["engine"]) == ["install", "build", "models", "mps-start",
                                                                       "profile", "mps-stop"]


def test_the_committed_record_says_what_the_h200_runs_covered():
    """Seeded from the two committed H200 reports, both runs of the old all-in-one plan: libsmctrl and
    the SM probe never ran, so mechanism is the stalest (tied on date with engine, from the same run)."""
    committed = record.load(cli.RECORD)
    assert set(committed) == set(GPU_PLANS)
    for name, e in committed.items():
        assert (ROOT / "docs" / "gpu" / e["report"] / "report.md").is_file()
        results = json.loads((ROOT / "docs" / "gpu" / e["report"] / "results.json").read_text())
        assert e["commit"] == results["machine"]["commit"] and e["date"] == results["machine"]["started_utc"]
        assert all(results["steps"][s]["status"] == status for s, status in e["steps"].items())
        assert "old all-in-one" in e["note"]
    assert record.never_ran(committed["mechanism"], MECHANISM.names) == ["libsmctrl", "sm-probe"]
    assert record.stalest(committed, PLAN_STEPS) == "mechanism"


def test_dry_run_of_the_stalest_plan_reads_the_record(tmp_path, capsys):
    fake_wheels(tmp_path / "wheels", wheels.read_pins())
    rec = tmp_path / "plans.json"
    record.update(rec, "serve", {"date": "2026-11-28T00:00:00Z", "commit": "abc", "steps": {"serve": "pass"}})
    record.update(rec, "mechanism", {"date": "2026-11-28T01:00:00Z", "commit": "abc", "steps": {"sm-probe": "pass"}})
    code = cli.main(["--dry-run", "--wheels-dir", str(tmp_path / "wheels"), "--record", str(rec),
                     "--out", str(tmp_path / "out")])  # --plan stalest is the default
    out = capsys.readouterr().out
    assert code == 0, out
    assert "engine     never run" in out and "stalest: engine" in out
    assert "plan engine:" in out and "  bench " in out


def _gpu_run(tmp_path: Path, monkeypatch, base: Path, names: list[str] | None = None) -> tuple[int, Path]:
    """A run of the engine plan whose steps are stand-ins (nothing touches a GPU or MPS)."""
    def env(ctx, timeout):
        ctx.info = {"date": "2026-12-01", "started_utc": "2026-12-01T08:00:00Z", "commit": "feedbeef",
                    "gpu": "NVIDIA H200", "driver": "580.1", "torch": {}}
        return steps.result("pass", "stand-in env")

    functions = {name: (lambda ctx, timeout: steps.result("pass", "ok")) for name in NAMES} | {"env": env}
    args = cli.parse(["--plan", "engine", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                      "--record", str(base), *(["--steps", ",".join(names)] if names else [])])
    monkeypatch.setattr(cli, "step_functions", lambda: functions)
    code = cli.Run(ENGINE, select(ENGINE, names), args).go()
    return code, tmp_path / "out"


def test_a_gpu_run_writes_its_entry_into_the_record_beside_its_report(tmp_path, monkeypatch):
    base = tmp_path / "committed.json"
    record.update(base, "serve", {"date": "2026-11-26T23:01:34Z", "commit": "efd0a6a", "steps": {"serve": "pass"}})
    record.update(base, "engine", {"date": "2026-11-26T22:51:35Z", "commit": "ab1d698", "steps": {"bench": "pass"}})
    code, out = _gpu_run(tmp_path, monkeypatch, base)
    assert code == 0 and (out / "nvidia-h200-2026-12-01-engine" / "report.md").is_file()
    written = record.load(out / "plans.json")
    assert written["serve"]["commit"] == "efd0a6a"  # the others' entries come along
    engine = written["engine"]
    assert engine["commit"] == "feedbeef" and engine["date"] == "2026-12-01T08:00:00Z" and engine["gpu"] == "NVIDIA H200"
    assert engine["report"] == "nvidia-h200-2026-12-01-engine" and engine["steps"]["bench"] == "pass"
    assert record.stalest(written, PLAN_STEPS) == "mechanism"
    # a second run of the plan on the same day keeps the first report and is the newer entry
    monkeypatch.setattr(cli.procs, "_copies", [])
    _gpu_run(tmp_path, monkeypatch, base)
    assert record.load(out / "plans.json")["engine"]["report"] == "nvidia-h200-2026-12-01-engine-b"
    assert (out / "nvidia-h200-2026-12-01-engine" / "report.md").is_file()


def test_a_run_of_setup_steps_alone_is_no_news_for_the_record(tmp_path, monkeypatch):
    base = tmp_path / "committed.json"
    monkeypatch.setattr(cli.procs, "_copies", [])
    code, out = _gpu_run(tmp_path, monkeypatch, base, names=["env"])
    assert code == 0 and not (out / "plans.json").exists()


# -- a steady-state point's arithmetic --------------------------------------------------------------
SLO_T = SLO.parse("10ms/token", "50ms")  # a 100-token prompt: TTFT within 1 s; 5 tokens: 4 gaps within 0.2 s


def rec(arrival: float, ttft: float | None, gaps: list[float] | None = None, *, out: int = 5, error: str = "",
        sent: float | None = None) -> Record:
    """A request of 100 prompt tokens: finished (all `out` tokens) when `gaps` has out-1 gaps."""
    r = Record(100, arrival, sent_s=arrival if sent is None else sent)
    if ttft is not None:
        r.ttft, r.itl = ttft, list(gaps or [])
        r.output_len = 1 + len(r.itl)
    r.ok = ttft is not None and r.output_len == out and not error
    r.error = error
    return r


def test_a_points_metrics_leave_the_warm_up_out_and_count_cut_requests_as_misses():
    records = [rec(0.5, 5.0, [0.01] * 4),                     # warm-up: missed TTFT, not scored
               rec(2.0, 0.2, [0.01] * 4),                     # in SLO, finished at 2.24
               rec(3.0, 0.3, [0.1] * 4),                      # TPOT 100 ms: a miss, finished at 3.7
               rec(4.0, 0.1, [0.01] * 4),                     # in SLO, finished at 4.14
               rec(5.0, None, error="unfinished at the point's deadline (9 s)"),  # cut: a miss
               rec(5.5, None, error="HTTP 500: boom")]        # failed: a miss
    point = steady.point_summary(records, 9.0, SLO_T, warmup_s=1.0, window_s=6.0)
    assert point["requests"] == 6 and point["warmup_requests"] == 1 and point["measured"] == 5
    assert point["completed"] == 3 and point["attained"] == 2 and point["attainment"] == pytest.approx(2 / 5)
    assert point["cut"] == 1 and point["failed"] == 1
    # finished within [1, 6): 2.24, 3.7, 4.14 (the warm-up request finished at 5.54: counted, it is served load)
    assert point["req_per_s"] == pytest.approx(4 / 5.0)
    assert point["ttft_p50_s"] == pytest.approx(0.2)


def test_the_drain_stops_once_every_request_left_has_missed_and_never_later_than_the_slo_bound():
    out = 5
    assert steady.slo_bound_s(SLO_T, 2048, 128) == pytest.approx(0.01 * 2048 + 0.05 * 127)
    waiting = rec(1.0, None)                         # no token yet: TTFT target 1 s after its send
    assert not steady.certain_miss(waiting, 1.9, SLO_T, out) and steady.certain_miss(waiting, 2.1, SLO_T, out)
    decoding = Record(100, 1.0, sent_s=1.0, ttft=0.5, output_len=2, itl=[0.01])  # first token at 1.5
    assert not steady.certain_miss(decoding, 1.6, SLO_T, out)  # 4 gaps may still average 50 ms: 1.5 + 0.2
    assert steady.certain_miss(decoding, 1.71, SLO_T, out)
    late_first = Record(100, 1.0, sent_s=1.0, ttft=1.5, output_len=1)
    assert steady.certain_miss(late_first, 2.6, SLO_T, out)
    unsent = Record(100, 5.0)
    assert not steady.certain_miss(unsent, 99.0, SLO_T, out)
    done = rec(0.0, 0.1, [0.01] * 4)
    assert steady.nothing_left_to_attain([done, waiting], 2.1, SLO_T, out)
    assert not steady.nothing_left_to_attain([done, waiting], 1.9, SLO_T, out)
    assert not steady.nothing_left_to_attain([done, waiting, unsent], 2.1, SLO_T, out)


def test_a_point_whose_requests_have_all_missed_stops_before_its_deadline_over_http():
    """The load generator's early stop, against a server that sends one token and then stalls: the
    point ends once the request cannot attain (TPOT 50 ms over 4 gaps: 0.2 s after its first token),
    not at its 30 s deadline, and the request counts as a miss."""
    import asyncio
    import socket

    from artifact import loadgen

    async def go():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            one = json.dumps({"text": "", "meta_info": {"completion_tokens": 1}})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         + f"data: {one}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(60)

        server = await asyncio.start_server(handle, "127.0.0.1", 0, family=socket.AF_INET)
        port = server.sockets[0].getsockname()[1]
        async with server:
            stop = lambda records, now: steady.nothing_left_to_attain(records, now, SLO_T, 5)  # noqa: E731
            return await loadgen.run_point(f"http://127.0.0.1:{port}", [[101] * 100], [0.0], 5, 30.0, stop_early=stop)

    records, duration = asyncio.run(go())
    assert duration < 5.0 and records[0].output_len == 1 and records[0].sent_s is not None
    assert not records[0].ok and "stopped early" in records[0].error
    point = steady.point_summary(records, duration, SLO_T, warmup_s=0.0, window_s=1.0)
    assert point["cut"] == 1 and point["attainment"] == 0.0


def test_goodput_is_the_highest_rate_in_slo_with_its_interval_and_bracket():
    def point(n, hits):
        return {"measured": n, "attained": hits, "attainment": hits / n}

    got = steady.goodput_summary({6.0: point(100, 99), 12.0: point(200, 186), 18.0: point(300, 120)})
    assert got["goodput_req_s"] == 12.0 and got["bracket"] == [12.0, 18.0]
    assert got["interval"]["low"] <= 12.0 <= got["interval"]["high"] and got["interval"]["high"] <= 18.0
    none = steady.goodput_summary({6.0: point(100, 50), 12.0: point(100, 10), 18.0: point(100, 0)})
    assert none["goodput_req_s"] == 0.0 and none["bracket"] == [0.0, 6.0]
    top = steady.goodput_summary({6.0: point(100, 100), 12.0: point(100, 100), 18.0: point(100, 95)})
    assert top["goodput_req_s"] == 18.0 and top["bracket"] == [18.0, None]


def test_the_same_arrivals_for_every_system_spanning_the_window():
    from artifact.gpu_check.serve import arrivals, drain_cap_s, inflight

    sp = GPU.serve
    prompts, times = arrivals(sp, 12.0)
    again = arrivals(sp, 12.0)
    assert again == (prompts, times) and len(prompts) == len(times)
    assert times[0] == 0.0 and times[-1] < sp.window_s and times[-1] > sp.window_s - 2
    assert 12.0 * sp.window_s * 0.7 < len(times) < 12.0 * sp.window_s * 1.3
    other = arrivals(sp, 6.0)[1]
    assert other != times[:len(other)]  # another rate, other prompts and times
    assert drain_cap_s(sp, SLO.parse(sp.ttft_slo, sp.tpot_slo)) == pytest.approx(0.003 * 2048 + 0.05 * 127 + 1)
    page = "# HELP bullet:inflight_requests x\n# TYPE bullet:inflight_requests gauge\nbullet:inflight_requests 3.0\n"
    assert inflight(page) == 3 and inflight("bullet:up 1.0\n") is None


def test_the_report_shows_steady_state_points_and_judges_goodput(tmp_path):
    results = synthetic_results()
    p = {"requests": 240, "warmup_requests": 48, "measured": 192, "completed": 190, "attained": 188, "attainment": 0.98,
         "cut": 0, "failed": 0, "duration_s": 23.0, "req_per_s": 11.9, "output_tok_per_s": 1500.0, "ttft_p50_s": 0.1,
         "ttft_p90_s": 0.2, "tpot_p50_s": 0.02, "tpot_p90_s": 0.03, "itl_p99_s": 0.05, "ended": "drained"}
    bad = dict(p, attained=100, attainment=100 / 192, cut=40, ended="stopped early (every request left had missed)")
    system = lambda good, hi: {"backend": "none", "per_rate": {"6": p, "12": p if good >= 12 else bad, "18": bad},  # noqa: E731
                               "goodput_req_s": good, "bracket": [good, hi], "interval": {"value": good, "low": 6.0, "high": good}}
    results["steps"]["serve"] = {"status": "pass", "summary": "3 of 4", "mps": True, "seconds": 300, "cap_s": 420,
                                 "slo": "TTFT 3ms/token, TPOT 50ms", "dropped_rates": ["24 req/s"],
                                 "workload": {"prompt_tokens": [128, 2048], "output_tokens": 128, "window_s": 20.0,
                                              "warmup_s": 4.0, "drain_cap_s": 13.5},
                                 "systems": {"bullet": system(12.0, 18.0), "chunked:1024": system(6.0, 12.0),
                                             "static": {"backend": "green-ctx", "skipped": "dropped before the first launch"}}}
    report.write(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Served comparison (steady state)" in md and "first 4 s of arrivals are a warm-up" in md
    assert "| bullet | none | 18 | 190/192 (+48 warm-up) | 40 |" in md and "stopped early" in md
    assert "12 [6, 12]; knee in [12, 18)" in md and "Not served, for time: 24 req/s" in md
    goals = {g["goal"]: g for g in json.loads((tmp_path / "results.json").read_text())["goals"]}
    assert goals["steady-state goodput, best policy (bullet)"]["met"] is False  # 12 < 18
    ratio = goals["bullet's goodput over the best baseline's (chunked:1024)"]
    assert ratio["measured"] == pytest.approx(2.0) and ratio["met"] is True


def test_a_replay_cell_whose_simulated_point_finished_nothing_says_so():
    """A steady-state point whose requests the replay cut all has no predicted latency: the table says
    '–' where the cell used to stop the replay step (a None formatted as a number); nor has a measured 0
    a relative error."""
    from artifact.sim_validation import _cell

    row = {"measured": {"ttft_p50_s": 0.5}, "predicted": {"ttft_p50_s": None}, "error": {"ttft_p50_s": None}}
    assert _cell(row, "ttft_p50_s") == "500ms / –"
    zero = {"measured": {"out_tok_per_s": 0.0}, "predicted": {"out_tok_per_s": 12.0}, "error": {"out_tok_per_s": None}}
    assert _cell(zero, "out_tok_per_s") == "0 / 12"  # no relative error of a measured 0
