"""The steps of a device run but the served comparison (`serve`): each takes the run's context and
its time limit, runs its part in child processes, and returns what the report shows — a status
(pass, fail, timeout, skipped, error), a one-line summary and its data."""

from __future__ import annotations

import json
import os
import shutil
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from artifact.gpu_check import machine, procs, wheels
from artifact.gpu_check.plan import Plan
from artifact.gpu_check.profile_findings import findings


@dataclass
class Context:
    root: Path
    plan: Plan
    work: Path          # logs and the profile; packed into logs.tgz at the end
    wheel_dir: Path
    env: dict           # the children's environment (PYTHONPATH gains the installed wheels)
    info: dict = field(default_factory=dict)
    profile: Path | None = None
    given_profile: Path | None = None  # --estimator-profile: measured before, not again
    mps_on: bool = False

    @property
    def logs(self) -> Path:
        return self.work / "logs"


def result(status: str, summary: str, **data) -> dict:
    return {"status": status, "summary": summary, **data}


def finished(done: procs.Finished, ok: str, **data) -> dict:
    """The status of a child that ran: pass, fail (non-zero exit) or timeout."""
    log = str(done.log.name)
    if done.timed_out:
        return result("timeout", f"stopped at its deadline after {done.seconds:.0f} s", log=log, **data)
    if done.returncode != 0:
        return result("fail", f"exit {done.returncode}: {done.tail(3).strip()[-300:]}", log=log, **data)
    return result("pass", ok, log=log, **data)


def env_step(ctx: Context, timeout: float) -> dict:
    ctx.info = machine.describe(ctx.root, ctx.wheel_dir, ctx.env)
    t = ctx.info["torch"]
    gpu = f"{ctx.info['gpu']} (driver {ctx.info['driver']}, {t.get('sms')} SMs)" if "gpu" in ctx.info else "no GPU"
    summary = (f"{gpu}; Python {t.get('python')}, torch {t.get('torch')} (CUDA {t.get('torch_cuda')}); "
               f"commit {ctx.info['commit'][:12]}")
    return result("pass" if "error" not in t else "error", summary, **ctx.info)


def install_step(ctx: Context, timeout: float) -> dict:
    gone = wheels.missing(ctx.wheel_dir)
    if gone:
        return result("error", f"missing wheels {' '.join(map(str, gone))}: run `{wheels.FETCH_COMMAND}` before the run")
    site = ctx.work / "site"
    done = procs.run(wheels.install_command(ctx.wheel_dir, site), ctx.logs / "install.txt", timeout, ctx.env)
    if done.returncode == 0:
        ctx.env["PYTHONPATH"] = os.pathsep.join([str(site), str(ctx.root), ctx.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        sys.path.insert(0, str(site))
        check = procs.run(procs.python("-c", "import pydantic, fastapi, uvicorn, zmq, posix_ipc, setproctitle, gguf"),
                          ctx.logs / "install-imports.txt", 60, ctx.env)
        if check.returncode != 0:
            return result("fail", f"installed, but imports fail: {check.tail(2).strip()}", site=str(site))
    return finished(done, f"{len(wheels.pinned_files(ctx.wheel_dir))} wheels into {site}", site=str(site))


def build_step(ctx: Context, timeout: float) -> dict:
    done = procs.run(procs.python("setup.py", "-q", "build_ext", "--inplace"), ctx.logs / "build.txt", timeout,
                     ctx.env, cwd=ctx.root)
    if done.returncode == 0:
        check = procs.run(procs.python("-c", "import bullet._shmatomic"), ctx.logs / "build-import.txt", 30, ctx.env,
                          cwd=ctx.root)
        if check.returncode != 0:
            return result("fail", f"built, but bullet._shmatomic does not import: {check.tail(2).strip()}")
    return finished(done, "bullet._shmatomic built and imports")


def doctor_step(label: str):
    def step(ctx: Context, timeout: float) -> dict:
        log = ctx.logs / f"doctor-{label}.json"
        done = procs.run(procs.python("-m", "bullet.cli", "doctor", "-v", "--json"), log, timeout, ctx.env, cwd=ctx.root)
        text = log.read_text(errors="replace")
        start = text.find("\n{")  # the report is the JSON object that starts a line (log lines may precede it)
        try:
            report, _ = json.JSONDecoder().raw_decode(text[start + 1:]) if start >= 0 else (None, 0)
        except ValueError:
            report = None
        if not isinstance(report, dict) or "checks" not in report:
            return finished(done, "no JSON report")
        checks = [{k: c.get(k) for k in ("name", "status", "summary", "details")} for c in report["checks"]]
        counts = {s: sum(c["status"] == s for c in checks) for s in sorted({c["status"] for c in checks})}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        fails = "; ".join(f"{c['name']}: {c['summary']}" for c in checks if c["status"] == "FAIL")
        out = finished(done, summary, checks=checks, counts=counts)
        if done.returncode not in (0, None):  # the doctor exits non-zero when a check FAILs: that is its verdict
            out.update(status="fail", summary=f"{summary}; FAIL: {fails}"[:600])
        return out

    return step


def gpu_test_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(errors="replace"))


def gpu_tests_step(ctx: Context, timeout: float) -> dict:
    files = gpu_test_files(ctx.root)
    xml = ctx.logs / "gpu-tests.xml"
    done = procs.run(procs.python("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", *files),
                     ctx.logs / "gpu-tests.txt", timeout, ctx.env, cwd=ctx.root)
    cases = _junit_cases(xml)
    counts = {s: sum(c["outcome"] == s for c in cases) for s in ("passed", "failed", "skipped")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({len(files)} files)"
    out = finished(done, summary, counts=counts, cases=cases, files=files)
    if counts["failed"]:
        out.update(status="fail", summary=summary + ": " + "; ".join(c["test"] for c in cases if c["outcome"] == "failed"))
    return out


def _junit_cases(xml: Path) -> list[dict]:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return []
    cases = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "failed" if bad is not None else "skipped" if case.find("skipped") is not None else "passed"
        message = (bad.get("message") or "")[:300] if bad is not None else None
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message})
    return cases


def _benchmark(ctx: Context, timeout: float, module: str, args: tuple[str, ...], name: str) -> tuple[procs.Finished, dict | None]:
    """Run `python -m module args --output <logs>/<name>.json`: how it ended, and its JSON (None if it
    wrote none; the benchmarks rewrite it after each section, so a cap keeps what was measured)."""
    out = ctx.logs / f"{name}.json"
    done = procs.run(procs.python("-m", module, *args, "--output", str(out)), ctx.logs / f"{name}.txt", timeout,
                     ctx.env, cwd=ctx.root)
    return done, json.loads(out.read_text()) if out.exists() else None


def _goals_met(data: dict) -> str:
    goals = data.get("goals", [])
    return f"{sum(g['met'] for g in goals)} of {len(goals)} goals met"


def bench_step(ctx: Context, timeout: float) -> dict:
    done, data = _benchmark(ctx, timeout, "artifact.benchmarks.bench_engine_gpu", ctx.plan.bench_args, "engine")
    return finished(done, "no results") if data is None else finished(done, _goals_met(data), engine=data)


def models_step(ctx: Context, timeout: float) -> dict:
    """The other models and formats (`artifact.benchmarks.bench_models_gpu`)."""
    done, data = _benchmark(ctx, timeout, "artifact.benchmarks.bench_models_gpu", ctx.plan.models_args, "models")
    if data is None:
        return finished(done, "no results")
    errors = data.get("errors", [])
    failed = f"; {len(errors)} model(s) failed: {', '.join(e['model'] for e in errors)}" if errors else ""
    return finished(done, _goals_met(data) + failed, models=data)


def profile_step(ctx: Context, timeout: float) -> dict:
    path = ctx.work / "profile.json"
    if ctx.given_profile is not None:
        if not ctx.given_profile.is_file():
            return result("error", f"--estimator-profile {ctx.given_profile}: no such file")
        shutil.copyfile(ctx.given_profile, path)
        ctx.profile = path
        return result("pass", f"given: {ctx.given_profile} (not measured in this run)", path=str(path),
                      findings=findings(path))
    done = procs.run(procs.python("-m", "bullet.cli", "profile", *ctx.plan.model_args, *ctx.plan.profile_args,
                                  "--output", str(path)), ctx.logs / "profile.txt", timeout, ctx.env, cwd=ctx.root)
    if done.returncode == 0 and path.exists():
        ctx.profile = path
    return finished(done, f"{path.name}: the bullet policy's profile, passed to its launch", path=str(path),
                    findings=findings(path) if ctx.profile == path else [])


def mps_start_step(ctx: Context, timeout: float) -> dict:
    ok, how = machine.mps_start()
    ctx.mps_on = ok
    return result("pass" if ok else "error", f"MPS control daemon {'running' if ok else 'not started'} ({how})")


def mps_stop_step(ctx: Context, timeout: float) -> dict:
    ok, how = machine.mps_stop()
    ctx.mps_on = ctx.mps_on and not ok
    return result("pass" if ok else "error", f"MPS control daemon: {how}")
