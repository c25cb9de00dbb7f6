"""How fast `bullet simulate` runs, against an earlier commit, side by side in one run on this machine.

    python artifact/benchmarks/bench_simulator.py [--baseline main] [--rounds 3] [--cpu 0]
        [--policies bullet chunked:1024 ...] [--out docs/sim/speed]

The baseline commit is unpacked into a temporary directory (`git archive`); each round runs every
policy's simulation once with each tree, alternating which goes first, each as its own process
(`bullet simulate --workload sharegpt --rate 20 --duration 60 --seed 1 --json`), pinned to one core.
Reported per policy, as the median over rounds: the simulator's own wall time (`run.wall_s`), the CPU
time of the whole process (what other jobs on a shared machine disturb least), the process's wall
time (start-up included), and the real-time factor (virtual seconds simulated per second). Both trees
must produce the same summary, to the bit: the table says whether they did.

Writes <out>.json (every measurement) and <out>.md (the table)."""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def run_once(tree: Path, policy: str, cpu: int | None, scratch: Path) -> dict:
    out = scratch / "result.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bullet.cli", "simulate", *WORKLOAD, "--policy", policy, "--quiet", "--json", str(out)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} {policy}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    data = json.loads(out.read_text())
    return {"sim_wall_s": data["run"]["wall_s"], "virtual_s": data["run"]["virtual_s"],
            "process_wall_s": wall, "process_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "requests": data["summary"]["requests"], "summary": data["summary"]}


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(results: dict, baseline: str, current: str) -> list[str]:
    lines = [f"| policy | requests | virtual s | sim wall s ({baseline}) | sim wall s ({current}) | speed-up | "
             f"real-time factor ({baseline} -> {current}) | process CPU s ({baseline} -> {current}) | "
             "process wall s | same summary |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        b, n = r["baseline"], r["current"]
        lines.append(
            f"| {policy} | {n[0]['requests']} | {n[0]['virtual_s']:.1f} | {median(b, 'sim_wall_s'):.2f} | "
            f"{median(n, 'sim_wall_s'):.2f} | {r['speedup_sim_wall']:.2f}x | "
            f"{r['realtime_baseline']:.0f}x -> {r['realtime_current']:.0f}x | "
            f"{median(b, 'process_cpu_s'):.2f} -> {median(n, 'process_cpu_s'):.2f} | "
            f"{median(b, 'process_wall_s'):.2f} -> {median(n, 'process_wall_s'):.2f} | "
            f"{'yes' if r['identical'] else 'NO'} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="main", help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", type=int, default=0, help="core to pin every run to (-1: no pinning)")
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "sim" / "speed")
    args = p.parse_args()
    cpu = None if args.cpu < 0 else args.cpu
    current = git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    baseline = git("rev-parse", "--short", args.baseline)
    info = cpu_info()
    started = {"load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        base_tree, scratch = Path(tmp) / "baseline", Path(tmp) / "scratch"
        base_tree.mkdir()
        scratch.mkdir()
        unpack(args.baseline, base_tree)
        trees = {"baseline": base_tree, "current": ROOT}
        for policy in args.policies:
            runs = {"baseline": [], "current": []}
            for r in range(args.rounds):
                order = ("baseline", "current") if r % 2 == 0 else ("current", "baseline")
                for side in order:
                    runs[side].append(run_once(trees[side], policy, cpu, scratch))
                    print(f"{policy} round {r + 1} {side}: sim {runs[side][-1]['sim_wall_s']:.2f}s, "
                          f"cpu {runs[side][-1]['process_cpu_s']:.2f}s", file=sys.stderr, flush=True)
            b, n = runs["baseline"], runs["current"]
            identical = all(x["summary"] == b[0]["summary"] for x in b + n)
            results[policy] = {
                "baseline": b, "current": n, "identical": identical,
                "speedup_sim_wall": median(b, "sim_wall_s") / median(n, "sim_wall_s"),
                "speedup_process_cpu": median(b, "process_cpu_s") / median(n, "process_cpu_s"),
                "realtime_baseline": n[0]["virtual_s"] / median(b, "sim_wall_s"),
                "realtime_current": n[0]["virtual_s"] / median(n, "sim_wall_s"),
            }
    for res in results.values():
        for row in res["baseline"] + res["current"]:
            row.pop("summary")
    data = {"command": f"bullet simulate {' '.join(WORKLOAD)} --policy <policy>",
            "baseline": baseline, "current": current, "rounds": args.rounds, "pinned_cpu": cpu,
            "cpu": {"model": info["model"], "notable_flags": info["notable_flags"], "flags": info["flags"]},
            "logical_cpus": os.cpu_count(), "python": sys.version.split()[0], "started": started,
            "finished": {"load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
            "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = table(results, baseline, current)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
