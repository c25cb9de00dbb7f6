"""How fast `bullet simulate` runs, against an earlier commit, side by side in one run on this machine.

    python artifact/benchmarks/bench_simulator.py [--baseline REV] [--rounds 3] [--cpu 0]
        [--policies bullet chunked:1024 ...] [--instructions] [--out docs/sim/speed]

Both commits (the baseline, by default where this branch left main, and HEAD) are unpacked into
temporary directories (`git archive`); each round runs every policy's simulation once with each
tree, alternating which goes first, each in its own process pinned to one core, with the CLI's own
configuration and workload (`bullet simulate --workload sharegpt --rate 20 --duration 60 --seed 1
--policy <policy>`). Reported per policy, as the median over rounds: the simulation's CPU time (what
other jobs on a shared machine disturb least) and wall time, and the real-time factor (virtual
seconds simulated per second). Both trees must produce the same summary, to the bit (the numbers the
baseline reports; keys added since are not compared): the table says whether they did. The CLI's
start-up (`bullet simulate --help`) is timed apart.

`--instructions` also counts, once per policy and tree, the instructions the simulation executes
(valgrind's callgrind, `PYTHONHASHSEED=0`: the same count to about 1e-7 from run to run, where CPU
time on a shared 2-core VM moved by 30 % between back-to-back runs of one tree): the whole process,
less a run of the same process that builds everything but does not simulate. A change of a few
per cent shows there when the time columns cannot see it. It adds about a minute per policy and
tree under valgrind's slowdown.

Writes <out>.json (every measurement) and <out>.md (the table)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from artifact.evaluation.environment import cpu_info  # noqa: E402

POLICIES = ["bullet", "chunked:1024", "sglang:1024", "static", "naive", "partition-only", "scheduler-only"]
WORKLOAD = ["--workload", "sharegpt", "--rate", "20", "--duration", "60", "--seed", "1"]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def unpack(rev: str, into: Path) -> None:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


# run inside each tree's own interpreter: the CLI's own configuration and workload, the simulation timed
# alone (wall and CPU time), its JSON summary printed
RUNNER = """
import argparse, json, sys, time
from bullet.commands.simulate import add_arguments, config_from_args
from bullet.sim import Simulation
from bullet.workloads.traces import build_workload
setup_only = "--setup-only" in sys.argv  # build everything, do not simulate (`instructions`)
p = argparse.ArgumentParser(); add_arguments(p); a = p.parse_args([x for x in sys.argv[1:] if x != "--setup-only"])
sim = Simulation(config_from_args(a), build_workload(a.workload, a.rate, a.duration, a.seed, a.arrivals, a.data_dir))
if setup_only:
    raise SystemExit(0)
c0, t0 = time.process_time(), time.perf_counter()
r = sim.run()
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
print(json.dumps({"sim_cpu_s": cpu, "sim_wall_s": wall, "virtual_s": r.end_time, "summary": r.summary}))
"""


def run_once(tree: Path, policy: str, cpu: int | None) -> dict:
    cmd = [sys.executable, "-c", RUNNER, *WORKLOAD, "--policy", policy, "--quiet"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} {policy}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["requests"] = data["summary"]["requests"]
    return data


COLLECTED = re.compile(r"^==\d+== Collected : (\d+)$", re.M)


def instructions(tree: Path, policy: str) -> int:
    """Instructions the simulation executes (`--instructions`): callgrind's count of the whole run,
    less that of the same process stopped just before it simulates."""
    counts = []
    for extra in ([], ["--setup-only"]):
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", RUNNER,
               *WORKLOAD, "--policy", policy, "--quiet", *extra]
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{tree} {policy} under valgrind: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        counts.append(collected(proc.stderr))
    return counts[0] - counts[1]


def collected(valgrind_stderr: str) -> int:
    """The instruction count callgrind prints on exit."""
    found = COLLECTED.findall(valgrind_stderr)
    if not found:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{valgrind_stderr[-1000:]}")
    return int(found[-1])


def startup_s(tree: Path, cpu: int | None) -> float:
    """Wall seconds of `bullet simulate --help`: the CLI's start-up (imports)."""
    cmd = [sys.executable, "-m", "bullet.cli", "simulate", "--help"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, check=True)
    return time.perf_counter() - t0


def same_summary(baseline: dict, current: dict) -> bool:
    """Every number the baseline reports is the same, to the bit (JSON keeps floats exactly; NaN equals
    NaN there); keys the baseline does not have (added since) are not compared."""
    return all(json.dumps(baseline[k]) == json.dumps(current.get(k)) for k in baseline)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: dict, baseline: str, current: str) -> list[str]:
    """Medians over the rounds. The simulator's wall time is what the issue's target is stated in; on a
    machine other jobs share, its CPU time (user + system of the whole process, start-up included) is
    what they disturb least."""
    lines = [f"| policy | requests | virtual s | sim CPU s {baseline} -> {current} | speed-up (CPU) | "
             f"real-time factor (CPU) {baseline} -> {current} | sim wall s {baseline} -> {current} | "
             "speed-up (wall) | same summary |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        b, n = r["baseline"], r["current"]
        lines.append(
            f"| {policy} | {n[0]['requests']} | {n[0]['virtual_s']:.1f} | {median(b, 'sim_cpu_s'):.2f} -> "
            f"{median(n, 'sim_cpu_s'):.2f} | {r['speedup_cpu']:.2f}x | "
            f"{r['realtime_cpu_baseline']:.0f}x -> {r['realtime_cpu_current']:.0f}x | "
            f"{median(b, 'sim_wall_s'):.2f} -> {median(n, 'sim_wall_s'):.2f} | {r['speedup_wall']:.2f}x | "
            f"{'yes' if r['identical'] else 'NO'} |")
    counted = {policy: r["instructions"] for policy, r in results.items() if r.get("instructions")}
    if counted:
        lines += ["", f"| policy | simulation instructions (G) {baseline} -> {current} | ratio |", "|---|---|---|"]
        for policy, c in counted.items():
            lines.append(f"| {policy} | {c['baseline'] / 1e9:.3f} -> {c['current'] / 1e9:.3f} | "
                         f"{c['baseline'] / c['current']:.3f}x |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="git revision to compare against (default: where HEAD left main)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", type=int, default=0, help="core to pin every run to (-1: no pinning)")
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "sim" / "speed")
    p.add_argument("--instructions", action="store_true",
                   help="also count each simulation's instructions under valgrind (deterministic; needs valgrind)")
    p.add_argument("--render", action="store_true", help="only rewrite <out>.md from <out>.json")
    args = p.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        p.error("--instructions needs valgrind on PATH (e.g. `apt install valgrind`)")
    if args.render:
        data = json.loads(args.out.with_suffix(".json").read_text())
        lines = table(data["results"], data["baseline"], data["current"])
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    cpu = None if args.cpu < 0 else args.cpu
    current = git("rev-parse", "--short", "HEAD")
    args.baseline = args.baseline or git("merge-base", "HEAD", "main")
    baseline = git("rev-parse", "--short", args.baseline)
    info = cpu_info()
    started = {"load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        trees = {"baseline": Path(tmp) / "baseline", "current": Path(tmp) / "current"}
        for side, rev in (("baseline", args.baseline), ("current", "HEAD")):
            trees[side].mkdir()
            unpack(rev, trees[side])  # committed trees: the worktree may change while this runs
        for policy in args.policies:
            runs = {"baseline": [], "current": []}
            for r in range(args.rounds):
                order = ("baseline", "current") if r % 2 == 0 else ("current", "baseline")
                for side in order:
                    runs[side].append(run_once(trees[side], policy, cpu))
                    print(f"{policy} round {r + 1} {side}: sim cpu {runs[side][-1]['sim_cpu_s']:.2f}s, "
                          f"wall {runs[side][-1]['sim_wall_s']:.2f}s", file=sys.stderr, flush=True)
            b, n = runs["baseline"], runs["current"]
            identical = all(same_summary(b[0]["summary"], x["summary"]) for x in b + n)
            results[policy] = {
                "baseline": b, "current": n, "identical": identical,
                "speedup_cpu": median(b, "sim_cpu_s") / median(n, "sim_cpu_s"),
                "speedup_wall": median(b, "sim_wall_s") / median(n, "sim_wall_s"),
                "realtime_cpu_baseline": n[0]["virtual_s"] / median(b, "sim_cpu_s"),
                "realtime_cpu_current": n[0]["virtual_s"] / median(n, "sim_cpu_s"),
                "realtime_wall_baseline": n[0]["virtual_s"] / median(b, "sim_wall_s"),
                "realtime_wall_current": n[0]["virtual_s"] / median(n, "sim_wall_s"),
            }
            if args.instructions:
                results[policy]["instructions"] = {side: instructions(trees[side], policy) for side in trees}
                print(f"{policy} instructions: {results[policy]['instructions']}", file=sys.stderr, flush=True)
        startup = {side: [startup_s(trees[side], cpu) for _ in range(args.rounds)] for side in trees}
    for res in results.values():
        for row in res["baseline"] + res["current"]:
            row.pop("summary")
    data = {"command": f"bullet simulate {' '.join(WORKLOAD)} --policy <policy>",
            "baseline": baseline, "current": current, "rounds": args.rounds, "pinned_cpu": cpu,
            "cpu": {"model": info["model"], "notable_flags": info["notable_flags"], "flags": info["flags"]},
            "logical_cpus": os.cpu_count(), "python": sys.version.split()[0], "started": started,
            "finished": {"load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
            "cli_startup_s": {side: statistics.median(v) for side, v in startup.items()},
            "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = table(results, baseline, current)
    lines += ["", f"CLI start-up (`bullet simulate --help`, wall, median): {baseline} "
                  f"{data['cli_startup_s']['baseline']:.2f} s, {current} {data['cli_startup_s']['current']:.2f} s."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
