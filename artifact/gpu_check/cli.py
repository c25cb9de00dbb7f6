"""One prepared device run: `bash scripts/gpu_check.sh [--plan NAME|stalest] [--dry-run] [--cpu-smoke] [--steps a,b]`.

What the device should be asked does not fit in one 8-minute run, so it is split into plans, each
fitting 8 minutes with a minute to spare: `serve` (the served comparison at steady state: every
system at the same rates around the knee on the same arrivals, the bullet policy's profile first,
the simulator's replay after), `mechanism` (libsmctrl built from carried source, `bullet doctor`
with MPS off and on, the SM-counting isolation probe, the GPU-marked tests) and `engine` (the
engine micro-benchmark and the profile). `--plan stalest` (the default) runs the plan whose last
run, as docs/gpu/plans.json records it, is oldest; plans never run first.

For a GPU machine without internet, first, on a machine with it:
  bash scripts/gpu_wheels.sh                          # the wheels the GPU image lacks -> .gpu-wheels/ (~7 MiB)
  bash scripts/gpu_check.sh --plan stalest --dry-run  # which plan is stalest, its steps and budget; every wheel present?
then copy the checkout, .gpu-wheels/ included, to the GPU machine and run there (allow ~10 minutes):
  BULLET_COMMIT=<git rev-parse HEAD> OUT=<dir> bash scripts/gpu_check.sh --plan stalest
and copy the report and the updated record back into the repository and commit them:
  cp -r <dir>/gpu/* docs/gpu/      # <gpu>-<date>-<plan>/ and plans.json

Each step runs in child processes with a deadline; MPS is started (`nvidia-cuda-mps-control -d`)
for the steps that need it and stopped (`echo quit | nvidia-cuda-mps-control`) whatever happens.
A slow step shortens what follows, and partial results still come back. It writes
$OUT/gpu/<gpu>-<date>-<plan>/ (or docs/gpu/... without $OUT, or --out DIR): report.md,
results.json, logs.tgz and progress.log, rewritten after every step, and plans.json beside it
($OUT/gpu/... mirrors docs/gpu/... in the repository, so both are copied back as they are).

--cpu-smoke runs every step of every plan that can run on a CPU, on dummy SmolLM2-135M (--device
cpu): proves the orchestration, measures nothing about a GPU (and updates no record). Exit status:
0 when the run went through (checks that FAIL are in the report), 1 when a setup step failed, 2
for a dry run that found wheels missing or a wrong option."""

from __future__ import annotations

import argparse
import os
import tarfile
import time
import traceback
from pathlib import Path

from artifact.gpu_check import procs, record, report, steps, wheels
from artifact.gpu_check.plan import CPU_SMOKE, GPU_PLANS, NAMES, Plan, Step, budget_lines, select
from artifact.gpu_check.procs import progress

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "gpu" / "plans.json"
RUN_COMMAND = ("BULLET_COMMIT=<git rev-parse HEAD> OUT=<dir> bash scripts/gpu_check.sh --plan {plan}  "
               "(on the GPU machine, .gpu-wheels/ and .gpu-sources/ beside it)")


def _serve_step(ctx, timeout: float) -> dict:
    # the served comparison imports the control plane (pydantic, pyzmq, ...), which a GPU image has
    # only once the install step put the carried wheels on sys.path (on 2026-11-26 an import when the
    # step table was built, before any step ran, stopped the whole run)
    from artifact.gpu_check.serve import serve_step  # deferred: needs the carried wheels (above)

    return serve_step(ctx, timeout)


def _replay_step(ctx, timeout: float) -> dict:
    from artifact.gpu_check.replay import replay_step  # deferred: as the served comparison (above)

    return replay_step(ctx, timeout)


def _not_here(exc: ModuleNotFoundError, module: str) -> dict | None:
    """A step whose module is not in this checkout yet is skipped with that reason; any other
    missing import is the step's error."""
    if exc.name == module:
        return steps.result("skipped", f"{module} is not in this checkout")
    return None


def _libsmctrl_step(ctx, timeout: float) -> dict:
    try:
        from artifact.gpu_check.libsmctrl import build_step  # deferred: as the served comparison (above)
    except ModuleNotFoundError as exc:
        return _not_here(exc, "artifact.gpu_check.libsmctrl") or steps.result("error", f"{type(exc).__name__}: {exc}")
    return build_step(ctx, timeout)


def _sm_probe_step(ctx, timeout: float) -> dict:
    try:
        from artifact.gpu_check.sm_probe import probe_step  # deferred: as the served comparison (above)
    except ModuleNotFoundError as exc:
        return _not_here(exc, "artifact.gpu_check.sm_probe") or steps.result("error", f"{type(exc).__name__}: {exc}")
    return probe_step(ctx, timeout)


def step_functions() -> dict:
    return {"env": steps.env_step, "install": steps.install_step, "build": steps.build_step,
            "libsmctrl": _libsmctrl_step, "doctor-nomps": steps.doctor_step("nomps"), "sm-probe": _sm_probe_step,
            "bench": steps.bench_step, "models": steps.models_step, "mps-start": steps.mps_start_step, "doctor-mps": steps.doctor_step("mps"),
            "gpu-tests": steps.gpu_tests_step, "profile": steps.profile_step, "serve": _serve_step,
            "mps-stop": steps.mps_stop_step, "replay": _replay_step}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="stalest", choices=["stalest", *GPU_PLANS],
                    help="which plan to run; stalest (the default): the one whose last run (--record) is oldest")
    ap.add_argument("--dry-run", action="store_true", help="list the steps and budgets, check the carried wheels; run nothing")
    ap.add_argument("--cpu-smoke", action="store_true", help="every step of every plan that can run on a CPU (dummy SmolLM2-135M)")
    ap.add_argument("--steps", default=None, help=f"comma-separated subset of the plan's steps ({','.join(NAMES)}; "
                                                  "setup steps run too)")
    ap.add_argument("--record", type=Path, default=RECORD, help="which plan last ran when (default: docs/gpu/plans.json)")
    ap.add_argument("--no-setup", action="store_true", help="with --steps: do not add env/install/build")
    ap.add_argument("--wheels-dir", type=Path, default=wheels.DEFAULT_DIR)
    ap.add_argument("--out", type=Path, default=None, help="report folder's parent (default: $OUT/gpu, else docs/gpu)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bullet-gpu-check"), help="logs, installed wheels, profile")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: the plan's)")
    ap.add_argument("--estimator-profile", type=Path, default=None,
                    help="the bullet policy's profile, measured before (e.g. by an earlier run: logs.tgz): not measured again")
    return ap.parse_args(argv)


def dry_run(plan: Plan, chosen: list[Step], wheel_dir: Path) -> int:
    for line in budget_lines(plan, chosen):
        print(line)
    for line in serve_fit_lines(plan, chosen):
        print(line)
    print("run: " + ("bash scripts/gpu_check.sh --cpu-smoke --out <dir>" if plan.device == "cpu"
                     else RUN_COMMAND.format(plan=plan.name)))
    if plan.device == "cuda" and _dummy_drawn_on_device() is False:
        print("warning: engines.weights.dummy.dummy_weights takes no device, so a server draws its dummy weights on "
              "the CPU: an 8B one then takes minutes to start (one random draw at a time), and the served "
              "comparison fits fewer systems in its time")
    needs_wheels = any(s.name == "install" for s in chosen) and "install" not in plan.skipped
    if not needs_wheels:
        print("wheels: not needed by this plan")
        return 0
    gone = wheels.missing(wheel_dir)
    if gone:
        print(f"wheels missing from {wheel_dir}: {' '.join(map(str, gone))}")
        print(f"fetch them (here, with internet): {wheels.FETCH_COMMAND}")
        return 2
    print(f"wheels: all {len(wheels.read_pins())} pinned wheels in {wheel_dir} "
          f"({wheels.total_bytes(wheel_dir) / 2**20:.1f} MiB to carry); {wheels.source_stamp(wheel_dir) or 'no SOURCE stamp'}")
    return 0


def serve_fit_lines(plan: Plan, chosen: list[Step]) -> list[str]:
    """What the served comparison fits in the time the plan leaves it, when every step before it
    takes its expected time: with the profile measured by the run, and given."""
    from artifact.gpu_check.serve_budget import describe  # deferred: only the dry run prints it

    names = [s.name for s in chosen if s.name not in plan.skipped]
    if "serve" not in names:
        return []
    at = names.index("serve")
    run = [s for s in chosen if s.name not in plan.skipped]
    before = sum(s.expect_s for s in run[:at])
    after = sum(s.min_s for s in run[at + 1:])
    left = min(plan.step("serve").cap_s, plan.total_s - before - after - plan.report_s)
    given = left + (plan.step("profile").expect_s if "profile" in names else 0.0)
    return [f"  serve fits, the steps before it at their expected times: {describe(plan.serve, left, True)}; "
            f"with --estimator-profile: {describe(plan.serve, min(given, plan.step('serve').cap_s), True)}"]


def _dummy_drawn_on_device() -> bool | None:
    """Whether the engine's dummy loader can draw on the serving device (None: torch is not here)."""
    import inspect

    try:
        from engines.weights.dummy import dummy_weights  # deferred: the dry run's one look at the engine (torch)
    except ImportError:
        return None
    return "device" in inspect.signature(dummy_weights).parameters


def choose_plan(args: argparse.Namespace, say=print) -> Plan:
    """The plan the options name: the CPU smoke, a GPU plan by name, or the stalest by the record."""
    if args.cpu_smoke:
        return CPU_SMOKE
    if args.plan != "stalest":
        return GPU_PLANS[args.plan]
    out = _out_parent(args)
    known = record.load(args.record, out / "plans.json")
    plans = {name: p.names for name, p in GPU_PLANS.items()}
    name = record.stalest(known, plans)
    say(f"plans, last run ({args.record}):")
    for line in record.lines(known, plans):
        say(line)
    say(f"stalest: {name}")
    return GPU_PLANS[name]


def _out_parent(args: argparse.Namespace) -> Path:
    """Where report folders and the record go: --out, else $OUT/gpu, else docs/gpu."""
    out = args.out or (Path(os.environ["OUT"]) / "gpu" if os.environ.get("OUT") else ROOT / "docs" / "gpu")
    return out.resolve()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.cpu_smoke and args.plan != "stalest":
        print("gpu_check: --cpu-smoke is a plan of its own (every CPU-runnable step of every plan): drop --plan")
        return 2
    plan = choose_plan(args, say=print if args.dry_run else progress)
    try:
        chosen = select(plan, args.steps.split(",") if args.steps else None, setup=not args.no_setup)
    except ValueError as exc:
        print(f"gpu_check: {exc}")
        return 2
    if args.dry_run:
        return dry_run(plan, chosen, args.wheels_dir)
    return Run(plan, chosen, args).go()


class Run:
    def __init__(self, plan: Plan, chosen: list[Step], args: argparse.Namespace):
        self.plan, self.chosen, self.args = plan, chosen, args
        self.budget = args.budget or plan.total_s
        work = args.work.resolve()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               "BULLET_CACHE_DIR": str(work / "cache")}  # a profile cached by an earlier run is not this run's
        self.ctx = steps.Context(ROOT, plan, work, args.wheels_dir.resolve(), env,
                                 given_profile=args.estimator_profile.resolve() if args.estimator_profile else None)
        self.out_parent = _out_parent(args)
        self.folder: Path | None = None
        run = {"plan": plan.name, "device": plan.device, "model": f"{plan.model_path} ({plan.dtype}, dummy)",
               "budget_s": self.budget, "command": "scripts/gpu_check.sh " + " ".join(argv_of(args)),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.results: dict = {"run": run, "machine": {}, "steps": {}}

    def go(self) -> int:
        for line in budget_lines(self.plan, self.chosen):
            progress(line)
        self.ctx.logs.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        deadline = began + self.budget
        functions = step_functions()
        setup_failed = False
        try:
            for i, step in enumerate(self.chosen):
                if step.name == "mps-stop":
                    continue  # in `finally`: MPS is stopped whatever happened
                if step.name in self.plan.skipped:
                    self._record(step, steps.result("skipped", self.plan.skipped[step.name]), 0.0)
                    continue
                # what every later step needs at least is kept back; the setup steps, which everything
                # after stands on, run whatever is left
                later = 0.0 if step.setup else sum(s.min_s for s in self.chosen[i + 1:] if s.name not in self.plan.skipped)
                available = deadline - time.monotonic() - later - self.plan.report_s
                if available < step.min_s and not (step.setup and available > 0):
                    why = f"{max(0.0, available):.0f} s left after keeping {later:.0f} s for the later steps"
                    self._record(step, steps.result("skipped", why), 0.0)
                    continue
                out, seconds = self._run(step, functions[step.name], min(step.cap_s, available))
                setup_failed |= step.setup and out["status"] in ("error", "fail", "timeout")
                if setup_failed and step.setup:
                    self.results["run"]["ended_early"] = f"setup step {step.name} failed"
                    break
        finally:
            if any(s.name == "mps-stop" for s in self.chosen) and "mps-stop" not in self.plan.skipped:
                self._run(self.plan.step("mps-stop"), functions["mps-stop"], 15)
            self.results["run"]["elapsed_s"] = time.monotonic() - began
            self._write(final=True)
        progress(f"done in {time.monotonic() - began:.0f} s: {self.folder}")
        return 1 if setup_failed else 0

    def _record_plan(self, final: bool) -> None:
        """This GPU plan's entry in the record beside the report folder (copied back with it),
        rewritten with the report (a run stopped from outside still leaves its entry)."""
        if self.plan.device == "cpu":
            return  # the CPU smoke proves the orchestration: no device plan ran
        new = record.entry(self.results, self.folder)
        if new is None:
            if final:
                progress("record: not updated (no step beyond the setup ran)")
            return
        path = self.out_parent / "plans.json"
        record.update(path, self.plan.name, new, self.args.record)
        if final:
            progress(f"record: {path} says plan {self.plan.name} ran at {str(new['commit'])[:12]} on {new['date']}")

    def _run(self, step: Step, function, timeout: float) -> tuple[dict, float]:
        progress(f"{step.name}: start (up to {timeout:.0f} s): {step.what}")
        mps = self.ctx.mps_on
        began = time.monotonic()
        try:
            out = function(self.ctx, timeout)
        except Exception as exc:  # noqa: BLE001 — a step's bug is that step's error; the run goes on
            out = steps.result("error", f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        seconds = time.monotonic() - began
        out["mps"] = self.ctx.mps_on if step.name == "mps-start" else mps
        self._record(step, out, seconds, say=False)
        progress(f"{step.name}: {out['status']} in {seconds:.1f} s: {out['summary'][:400]}")
        return out, seconds

    def _record(self, step: Step, out: dict, seconds: float, say: bool = True) -> None:
        out.update(seconds=round(seconds, 2), cap_s=step.cap_s)
        out.setdefault("mps", self.ctx.mps_on)
        self.results["steps"][step.name] = out
        if out["status"] == "skipped" and say:
            progress(f"{step.name}: skipped: {out['summary']}")
        if step.name == "env":
            self.results["machine"] = self.ctx.info
        self._write()

    def _write(self, final: bool = False) -> None:
        if self.folder is None:
            if not self.results["machine"] and not final:
                return  # the folder is named after the GPU: known once `env` ran
            from artifact.gpu_check.machine import slug  # deferred: the name needs the env step's answer

            info = self.results["machine"] or {"date": time.strftime("%Y-%m-%d", time.gmtime())}
            self.folder = fresh_folder(self.out_parent, slug(info, self.plan.name))
            procs.copy_progress_to(self.folder / "progress.log")
        if final:
            self._pack_logs()
        report.write(self.results, self.folder)
        self._record_plan(final)

    def _pack_logs(self) -> None:
        with tarfile.open(self.folder / "logs.tgz", "w:gz") as tar:
            if self.ctx.logs.exists():
                tar.add(self.ctx.logs, arcname="logs")
            if self.ctx.profile and self.ctx.profile.exists():
                tar.add(self.ctx.profile, arcname=f"logs/{self.ctx.profile.name}")


def fresh_folder(parent: Path, name: str) -> Path:
    """`parent/name`, or `name-b`, `name-c`, ... when a report is already there (a second run of the
    same plan on the same day keeps the first's)."""
    path, suffix = parent / name, ord("b")
    while path.exists() and suffix <= ord("z"):
        path, suffix = parent / f"{name}-{chr(suffix)}", suffix + 1
    return path


def argv_of(args: argparse.Namespace) -> list[str]:
    out = []
    if args.cpu_smoke:
        out.append("--cpu-smoke")
    else:
        out += ["--plan", args.plan]
    if args.steps:
        out += ["--steps", args.steps]
    if args.budget:
        out += ["--budget", f"{args.budget:g}"]
    return out
