"""Goodput as a crossing, not a grid step: for each (workload, system, seed), the highest Poisson
rate at which the simulated server attains the SLO target (90 % of requests meet both TTFT and
TPOT, Bullet §4.1), found by bisection; then, per workload, each system's mean crossing over the
seeds with its spread, and Bullet's ratio to every baseline.

    python -m artifact.crossing [--workloads sharegpt azure-code arxiv] [--systems bullet sglang:1024 ...]
                                [--seeds 1 2 3] [--duration 180] [--jobs 2] [--out artifact/results/crossing]

Everything is simulated (A100, Llama-3.1-8B, Table 4's SLOs, the shipped calibration; policies
predict with a copy of the device model that is wrong by about 10 %; every step pays 0.5 ms of
launch and scheduling overhead): see `bullet/sim/report.py` for what that does and does not include."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from multiprocessing import Pool
from pathlib import Path

from bullet.commands.simulate import TABLE4_SLOS
from bullet.sim import SimConfig, Simulation
from bullet.workloads.traces import build_workload

SYSTEMS = ["bullet", "sglang:1024", "sglang:2048", "chunked:1024", "chunked:2048", "static:54", "static:72"]
WORKLOADS = ["sharegpt", "azure-code", "arxiv"]
BRACKETS = {"sharegpt": (2.0, 40.0), "sharegpt-uncapped": (1.0, 30.0), "azure-code": (0.5, 12.0),
            "azure-conv": (0.5, 30.0), "arxiv": (0.25, 10.0)}
TARGET = 0.9


def attainment(workload: str, system: str, rate: float, seed: int, duration: float, overrides: dict) -> float:
    ttft, tpot = TABLE4_SLOS.get(workload, TABLE4_SLOS["sharegpt"])
    # the workload's Table 4 SLOs unless the overrides set others (e.g. a GPU plan's)
    config = SimConfig(**{"policy": system, "ttft_slo": ttft, "tpot_slo": tpot, "seed": seed,
                          "stop_below_attainment": TARGET - 0.05, **overrides})
    result = Simulation(config, build_workload(workload, rate, duration, seed)).run()
    return result.summary["attainment"] if not result.stopped_early else 0.0


def crossing(job: tuple) -> dict:
    """Bisection on the rate (attainment falls with load; 6 halvings of the bracket's log-span)."""
    workload, system, seed, duration, overrides, steps, *bracket = job
    lo, hi = bracket[0] if bracket and bracket[0] else BRACKETS[workload]
    t0, trace = time.perf_counter(), []
    if attainment(workload, system, lo, seed, duration, overrides) < TARGET:
        return {"workload": workload, "system": system, "seed": seed, "crossing": 0.0, "trace": [(lo, "below")]}
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        a = attainment(workload, system, mid, seed, duration, overrides)
        trace.append((round(mid, 3), round(a, 3)))
        lo, hi = (mid, hi) if a >= TARGET else (lo, mid)
    return {"workload": workload, "system": system, "seed": seed, "crossing": lo, "bracket": [lo, hi],
            "trace": trace, "wall_s": round(time.perf_counter() - t0, 1)}


def summarize(rows: list[dict], systems: list[str]) -> dict:
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        per = {s: [r["crossing"] for r in rows if r["workload"] == workload and r["system"] == s] for s in systems}
        stats = {s: {"mean": statistics.mean(v), "min": min(v), "max": max(v), "seeds": len(v)} for s, v in per.items() if v}
        bullet = stats.get("bullet", {}).get("mean")
        for s, st in stats.items():
            st["bullet_ratio"] = (bullet / st["mean"]) if bullet and st["mean"] else None
        baselines = [s for s in stats if s != "bullet"]
        best = max(baselines, key=lambda s: stats[s]["mean"]) if baselines else None
        out[workload] = {"systems": stats, "best_baseline": best,
                         "bullet_over_best": stats[best]["bullet_ratio"] if best else None}
    return out


def markdown(summary: dict) -> str:
    lines = []
    for workload, data in summary.items():
        lines += [f"### {workload}", "", "| system | goodput crossing (req/s), mean over seeds | min-max | bullet / system |",
                  "|---|---|---|---|"]
        for s, st in data["systems"].items():
            ratio = f"{st['bullet_ratio']:.2f}x" if st["bullet_ratio"] else "-"
            lines.append(f"| {s} | {st['mean']:.2f} | {st['min']:.2f}-{st['max']:.2f} | {ratio} |")
        lines += ["", f"Best baseline: {data['best_baseline']}; bullet / best = "
                      f"{data['bullet_over_best']:.2f}x" if data["bullet_over_best"] else "", ""]
    return "\n".join(lines)


def parse_override(text: str) -> tuple[str, object]:
    """KEY=VALUE: VALUE as JSON (0.1, false, null), else the string itself (aggregate)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=sorted(BRACKETS))
    ap.add_argument("--systems", nargs="+", default=SYSTEMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals per run")
    ap.add_argument("--steps", type=int, default=6, help="bisection steps per crossing")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="SimConfig overrides for every run, e.g. policy_error=0 split_rule=aggregate "
                    "(a value is read as JSON, else taken as a string)")
    ap.add_argument("--brackets", nargs="*", default=[], metavar="WORKLOAD=LO,HI",
                    help="the rate bracket a workload's bisection starts from (default: sized for the A100, "
                         f"{BRACKETS}; a faster device needs higher ones, e.g. sharegpt=20,120 on the H200)")
    ap.add_argument("--out", default="artifact/results/crossing")
    args = ap.parse_args(argv)
    overrides = dict(parse_override(kv) for kv in args.set)
    brackets = {}
    for item in args.brackets:
        workload, _, span = item.partition("=")
        try:
            lo, hi = (float(x) for x in span.split(","))
        except ValueError:
            ap.error(f"--brackets: expected WORKLOAD=LO,HI, got {item!r}")
        brackets[workload] = (lo, hi)
    jobs = [(w, s, seed, args.duration, overrides, args.steps, brackets.get(w)) for w in args.workloads
            for s in args.systems for seed in args.seeds]
    t0 = time.perf_counter()
    rows = []
    with Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(crossing, jobs), 1):
            rows.append(row)
            print(f"[crossing] {i}/{len(jobs)} {row['workload']} {row['system']} seed {row['seed']}: "
                  f"{row['crossing']:.2f} req/s ({time.perf_counter() - t0:.0f}s)", flush=True)
    summary = summarize(rows, args.systems)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crossing.json").write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    (out / "crossing.md").write_text(markdown(summary) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
