"""`bash artifact/run_all.sh [--quick | --smoke] [--force] [--run NAME] [--only STEP ...]`: run the
artifact evaluation and write artifact/results/<run>/report.md (see artifact/evaluation/steps.py)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from artifact.evaluation.report import write_report
from artifact.evaluation.runner import FAILED, ROOT, run_steps
from artifact.evaluation.steps import STEPS


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="artifact/run_all.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="every step on a reduced workload (<= 20 minutes on 2 cores)")
    mode.add_argument("--smoke", dest="mode", action="store_const", const="smoke",
                      help="the steps that take seconds, on a minimal workload; the others skipped with the reason")
    ap.set_defaults(mode="full")
    ap.add_argument("--run", default=None, help="run name: results go to <results-dir>/<run>/ (default: the mode)")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "artifact" / "results")
    ap.add_argument("--force", action="store_true", help="run steps again even if their results exist")
    ap.add_argument("--only", nargs="+", default=None, metavar="STEP", choices=[s.name for s in STEPS],
                    help="run only these steps (the report still covers every step of the run directory)")
    ap.add_argument("--list", action="store_true", help="print the steps and what each mode runs, then exit")
    return ap.parse_args(argv)


def list_steps(mode: str, run_dir: Path) -> None:
    from artifact.evaluation.runner import shown, step_dir  # deferred: only --list needs them

    for index, step in enumerate(STEPS, 1):
        plan = step.plan(mode, step_dir(run_dir, index, step))
        what = plan.unavailable and f"not available: {plan.unavailable}" or plan.skip and f"skipped: {plan.skip}"
        print(f"{index:2d}. {step.name}: {step.title}")
        for line in [what] if what else [shown(c) for c in plan.commands]:
            print(f"      {line}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a scheduler, `kill`, a background run that ignores SIGINT) ends the run like Ctrl-C: the
    # running step's whole process tree is stopped and the report of what finished is written
    signal.signal(signal.SIGTERM, _interrupt)
    args = parse(argv)
    run_dir = (args.results_dir / (args.run or args.mode)).resolve()
    if args.list:
        list_steps(args.mode, run_dir)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    selected = [(i, s) for i, s in enumerate(STEPS, 1) if args.only is None or s.name in args.only]
    print(f"[artifact] {args.mode} evaluation, {len(selected)} of {len(STEPS)} steps -> "
          f"{os.path.relpath(run_dir, ROOT)}/", flush=True)
    t0 = time.monotonic()
    try:
        outcomes = run_steps(selected, run_dir, args.mode, args.force, len(STEPS))
    except KeyboardInterrupt:  # the running step's processes are gone; report what finished
        print("\n[artifact] interrupted: the next run resumes from the first unfinished step", flush=True)
        write_report(run_dir, args.mode, args.run or args.mode)
        return 130
    report = write_report(run_dir, args.mode, args.run or args.mode)
    failed = [o.step.name for o in outcomes if o.record["status"] == FAILED]
    print(f"[artifact] report: {os.path.relpath(report, ROOT)} ({(time.monotonic() - t0) / 60:.1f} min"
          f"{', failed: ' + ', '.join(failed) if failed else ''})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
