"""Run the steps of an evaluation: one progress line per step, each step's output in its own
directory with its log and a `step.json` record, and resumption — a step whose record says it
succeeded in this mode, and whose expected files are all there, is not run again unless forced.
Steps that are skipped in this mode or not available yet are re-checked every time (cheaply), so a
feature that lands later is picked up by the next run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from artifact.evaluation.steps import Plan, Step

ROOT = Path(__file__).resolve().parents[2]
OK, FAILED, SKIPPED, UNAVAILABLE = "ok", "failed", "skipped", "not available"


@dataclass
class Outcome:
    step: Step
    directory: Path
    plan: Plan
    record: dict
    reused: bool = False


def step_dir(run_dir: Path, index: int, step: Step) -> Path:
    return run_dir / f"{index:02d}_{step.name}"


def read_record(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "step.json").read_text())
    except (OSError, ValueError):
        return None


def write_record(directory: Path, record: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "step.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(directory / "step.json")


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it: `python` for the interpreter, paths relative to the root."""
    def one(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        if arg.startswith(str(ROOT) + os.sep):
            return os.path.relpath(arg, ROOT)
        return arg if arg and " " not in arg else repr(arg)
    return " ".join(one(a) for a in cmd)


def _run_command(cmd: list[str], env: dict, log, timeout: float | None) -> int:
    """Run one command in its own session (so a timeout or Ctrl-C takes its whole process tree:
    servers, workers, bench clients), its output appended to the step's log."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        if isinstance(exc, KeyboardInterrupt):
            raise
        log.write(f"\n[artifact] timed out after {timeout:g} s\n".encode())
        return 124


def execute(step: Step, plan: Plan, directory: Path, mode: str) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **plan.env}
    record = {"step": step.name, "title": step.title, "mode": mode, "status": FAILED,
              "commands": [shown(c) for c in plan.commands],
              "env": {k: (os.path.relpath(v, ROOT) if v.startswith(str(ROOT)) else v) for k, v in plan.env.items()},
              "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "log": "log.txt"}
    t0 = time.monotonic()
    with open(directory / "log.txt", "wb") as log:
        for cmd in plan.commands:
            log.write(f"$ {shown(cmd)}\n".encode())
            log.flush()
            code = _run_command(cmd, env, log, plan.timeout_s)
            if code != 0:
                record.update(returncode=code, reason=f"`{shown(cmd)}` exited with {code}")
                break
        else:
            missing = [f for f in plan.expect if not (directory / f).exists()]
            if missing:
                record["reason"] = f"finished but did not write {', '.join(missing)}"
            else:
                record.update(status=OK, returncode=0)
    record["wall_s"] = round(time.monotonic() - t0, 1)
    # other jobs on the machine move every timing: the load when the step ended says how much
    record["load_avg_1min_at_end"] = round(os.getloadavg()[0], 2)
    write_record(directory, record)
    return record


def done_before(record: dict | None, plan: Plan, directory: Path, mode: str) -> bool:
    return bool(record and record.get("status") == OK and record.get("mode") == mode
                and all((directory / f).exists() for f in plan.expect))


def run_steps(steps: list[tuple[int, Step]], run_dir: Path, mode: str, force: bool, total: int) -> list[Outcome]:
    outcomes = []
    for index, step in steps:
        directory = step_dir(run_dir, index, step)
        plan = step.plan(mode, directory)
        head = f"[artifact] {index:2d}/{total} {step.name:<15}"
        previous = read_record(directory)
        if not force and done_before(previous, plan, directory, mode):
            print(f"{head} done earlier ({previous['wall_s']:.0f} s), kept   {os.path.relpath(directory, ROOT)}",
                  flush=True)
            outcomes.append(Outcome(step, directory, plan, previous, reused=True))
            continue
        if plan.unavailable or plan.skip:
            status, reason = (UNAVAILABLE, plan.unavailable) if plan.unavailable else (SKIPPED, plan.skip)
            record = {"step": step.name, "title": step.title, "mode": mode, "status": status, "reason": reason,
                      "wall_s": 0.0}
            write_record(directory, record)
            print(f"{head} {status}: {reason}", flush=True)
            outcomes.append(Outcome(step, directory, plan, record))
            continue
        print(f"{head} running ...", end="", flush=True)
        record = execute(step, plan, directory, mode)
        tail = "" if record["status"] == OK else f": {record.get('reason')} (log: {os.path.relpath(directory, ROOT)}/log.txt)"
        print(f" {record['status']} in {record['wall_s']:.0f} s{tail}", flush=True)
        outcomes.append(Outcome(step, directory, plan, record))
    return outcomes
