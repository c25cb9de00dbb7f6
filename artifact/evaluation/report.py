"""`report.md` of an evaluation run: the environment, a summary of every step (status, time, what it
reproduces), then per step how it was produced (commands, environment, caveats), its tables and its
figures. Built from the step directories alone, so it can be rebuilt at any time and covers steps
run in earlier invocations of a resumed run."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from artifact.evaluation.runner import OK, read_record, step_dir
from artifact.evaluation.steps import STEPS, Plan

LOG_NOISE = re.compile(r"^(\$ |\[bench\]|\[profile\]|\[estimator-cpu\]|\[round \d|wrote |\s*\d+%\|)|it/s\]|s/it\]")
MAX_LOG_LINES = 200


def demote(markdown: str, levels: int = 3) -> str:
    """Headings of an inlined file nested under the step's own heading."""
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", markdown, flags=re.M)


def log_tables(log: Path) -> str:
    """What a benchmark printed, without its progress lines, as a fixed-width block."""
    try:
        lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    kept = [ln for ln in lines if ln.strip() and not LOG_NOISE.search(ln)]
    if len(kept) > MAX_LOG_LINES:
        kept = [f"... ({len(kept) - MAX_LOG_LINES} earlier lines in the log)"] + kept[-MAX_LOG_LINES:]
    return "```\n" + "\n".join(kept) + "\n```\n" if kept else ""


def environment_summary(run_dir: Path) -> list[str]:
    path = step_dir(run_dir, 1, STEPS[0]) / "environment.json"
    try:
        env = json.loads(path.read_text())
    except (OSError, ValueError):
        return ["Environment: not recorded (the environment step has not run)."]
    cores = env.get("usable_cores") or []
    git = env.get("git", {})
    return [f"**Machine**: {env['cpu']['model']}, {len(cores)} usable cores, flags "
            f"{', '.join(env['cpu']['notable_flags']) or '(no AVX2/AVX-512/AMX)'}, {env.get('memory_gib')} GiB; "
            f"torch {env.get('torch', {}).get('version')}, Python {env.get('python')}; commit "
            f"`{(git.get('commit') or '?')[:12]}` ({git.get('uncommitted_changes', '?')} uncommitted changes); "
            f"load average at start {', '.join(f'{x:.1f}' for x in env.get('load_average', []))}."]


def step_section(index: int, step, plan: Plan, directory: Path, record: dict | None, run_dir: Path) -> list[str]:
    rel = directory.relative_to(run_dir)
    lines = [f"## {index}. {step.title}", "", f"*Paper*: {step.paper}. *Output*: `{rel}/`."]
    if step.notes:
        lines += ["", step.notes]
    status = record["status"] if record else "not run"
    if not record or status != OK:
        reason = (record or {}).get("reason", "this step has not been run in this run directory")
        lines += ["", f"**{status}**: {reason}"]
    if record and record.get("commands"):
        env = " ".join(f"{k}={v}" for k, v in record.get("env", {}).items())
        lines += ["", f"How it was produced ({record.get('started_utc', '?')} UTC, {record['wall_s']:.0f} s):", "",
                  "```", *[f"{env + ' ' if env else ''}{c}" for c in record["commands"]], "```"]
    if record and status == OK:
        for name in plan.tables:
            path = directory / name
            if path.exists():
                lines += ["", demote(path.read_text().strip())]
        if plan.log_tables:
            block = log_tables(directory / "log.txt")
            if block:
                lines += ["", "What it printed:", "", block.rstrip()]
        for fig in sorted(directory.glob("*.png")):
            lines += ["", f"![{step.name}: {fig.stem}]({fig.relative_to(run_dir)})"]
    elif record and record.get("commands"):
        lines += ["", "Last lines of the log:", "", "```", *tail(directory / "log.txt", 15), "```"]
    return lines + [""]


def tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ["(no log)"]


def write_report(run_dir: Path, mode: str, run_name: str) -> Path:
    rows, sections, total = [], [], 0.0
    for index, step in enumerate(STEPS, 1):
        directory = step_dir(run_dir, index, step)
        record = read_record(directory)
        plan = step.plan(mode, directory)
        total += (record or {}).get("wall_s", 0.0)
        status = record["status"] if record else "not run"
        load = (record or {}).get("load_avg_1min_at_end")
        rows.append(f"| {index} | {step.title} | {step.paper} | {status} | "
                    f"{(record or {}).get('wall_s', 0):.0f} s | {'-' if load is None else f'{load:.1f}'} |")
        sections += step_section(index, step, plan, directory, record, run_dir)
    flag = {"full": "", "quick": " --quick", "smoke": " --smoke"}[mode]
    head = [f"# Artifact evaluation: run `{run_name}` ({mode})", "",
            f"Written {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC by `bash artifact/run_all.sh{flag}"
            f"{'' if run_name == mode else ' --run ' + run_name}`; steps took {total / 60:.1f} minutes in all. "
            "Every number below was produced by the command shown with it; SIMULATED results come from the "
            "simulator (virtual time, an A100 device model), not from a GPU.", "",
            *environment_summary(run_dir), "",
            f"Load average (1 min) is the machine's, at the end of each step: above {os.cpu_count()} (the "
            "cores), other jobs were competing and timings are inflated.", "",
            "| # | step | paper | status | time | load |", "|---|---|---|---|---|---|", *rows, ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(head + sections))
    return path
