"""Bullet against the chunked-prefill baseline, static splits and the naive co-location on a
*simulated* A100 serving Llama-3.1-8B (Bullet §4.2.1, Fig. 15), with Table 4's SLOs, for ShareGPT,
Azure-Code and arXiv-Summarization; plus a Fig. 20-like timeline of Azure-Code at 5 req/s.

  python -m artifact.sim_comparison [--duration 300] [--jobs 2] [--workloads sharegpt azure-code arxiv]
                                    [--systems bullet chunked:1024 ...] [--out artifact/results/sim]

Every (workload, system, rate) is one `bullet.sim` run with Poisson arrivals (same seed for every
system, so each sees the same requests). Goodput = the highest rate with >= 90 % SLO attainment.
A run stops early once 50 % attainment is out of reach (its rate cannot count towards goodput;
its means then cover the part simulated, and the table marks it). Writes results.json, results.md,
comparison.png, timeline_bullet.png and timeline_chunked.png into --out, with a sensitivity table
(bullet and chunked:1024 at one rate per workload under other device-model assumptions). All numbers are
simulated: see bullet/sim/report.py for what that does and does not include.

Attainment and goodput carry 95 % bootstrap intervals (artifact/stats.py; over requests, and over
seeds with --repeats), and each system is marked "tie" against bullet where the intervals overlap.
--parts picks what runs (the artifact runs the comparison and the timelines as separate steps);
--rates overrides a workload's grid (`--rates sharegpt:5,15 arxiv:1,3`); --title names the
figure and report (Fig. 22 reuses this driver with static splits)."""

from __future__ import annotations

import argparse
import json
import time
from multiprocessing import Pool
from pathlib import Path

from artifact.plots import plot_timeline
from artifact.scoring import add_intervals, goodput
from artifact.sim_plots import plot_chunked_timeline, plot_comparison
from artifact.sim_report import TITLES, markdown, sensitivity_markdown
from artifact.stats import run_counts
from bullet.commands.simulate import TABLE4_SLOS
from bullet.sim import SimConfig, Simulation
from bullet.types.slo import SLO
from bullet.workloads.traces import build_workload

SYSTEMS = ["bullet", "chunked:1024", "chunked:2048", "static:54", "static:72", "static:84", "naive"]
RATES = {"sharegpt": [2, 5, 10, 15, 20, 25, 30], "azure-code": [0.5, 1, 2, 3, 4, 5, 6], "arxiv": [0.5, 1, 2, 3, 4, 5]}
STOP_BELOW = 0.5

def simulate_one(job: tuple) -> tuple:
    workload, system, rate, duration, seed, timeline_dir = job
    ttft, tpot = TABLE4_SLOS[workload]
    config = SimConfig(policy=system, ttft_slo=ttft, tpot_slo=tpot, seed=seed, timeline_dir=timeline_dir,
                       stop_below_attainment=None if timeline_dir else STOP_BELOW)
    requests = build_workload(workload, rate, duration, seed)
    result = Simulation(config, requests).run()
    run = {"stopped_early": result.stopped_early, "wall_s": result.wall_s, "virtual_s": result.end_time,
           "corun_s": result.device.corun_s, **result.counters}
    # requests never finished (a run stopped early) count as misses, as in the summary's attainment
    slo = SLO.parse(ttft, tpot)
    hits = [r.ok and slo.attained(r.input_len, r.ttft, r.tpot) for r in result.records]
    counts = (len(requests), run_counts(hits)[1])
    return workload, system, rate, seed, {**result.summary, "run": run, "counts": counts}


def pool_repeats(summaries: list[dict]) -> dict:
    """One summary for the seeds of a (workload, system, rate): latencies and throughput are the
    mean over seeds, attainment is pooled over their requests, and "runs" keeps each seed's
    (requests, attained) for the bootstrap; it counts as stopped early if any seed did."""
    first = summaries[0]
    out = {k: sum(s[k] for s in summaries) / len(summaries) for k, v in first.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    runs = [s["counts"] for s in summaries]
    out.update(runs=runs, attainment=sum(h for _, h in runs) / max(1, sum(n for n, _ in runs)),
               repeats=len(summaries),
               run={"stopped_early": any(s["run"]["stopped_early"] for s in summaries),
                    "wall_s": sum(s["run"]["wall_s"] for s in summaries), "seeds": [s["run"] for s in summaries]})
    return out


def run_all(args) -> dict:
    seeds = [args.seed + k for k in range(args.repeats)]
    jobs = [(wl, system, rate, args.duration, seed, None)
            for wl in args.workloads for rate in args.rate_grid[wl] for system in args.systems for seed in seeds]
    raw: dict = {}
    t0 = time.monotonic()
    with Pool(args.jobs) as pool:
        for k, (wl, system, rate, seed, summary) in enumerate(pool.imap_unordered(simulate_one, jobs), 1):
            raw.setdefault((wl, system, rate), []).append(summary)
            print(f"[sim-compare] {k:3d}/{len(jobs)} {wl:>10} {system:>12} @ {rate:>4} req/s seed {seed}: "
                  f"attainment {summary['attainment']:5.1%}{' (stopped)' if summary['run']['stopped_early'] else ''}, "
                  f"TTFT {summary['mean_ttft_s']:.3f}s, TPOT {summary['mean_tpot_s'] * 1e3:.0f}ms, "
                  f"{summary['output_tok_per_s']:.0f} tok/s [{summary['run']['wall_s']:.0f}s, "
                  f"total {time.monotonic() - t0:.0f}s]", flush=True)
    results: dict = {}
    for wl in args.workloads:
        by_system = {}
        for system in args.systems:
            per = {rate: pool_repeats(raw[(wl, system, rate)]) for rate in sorted(args.rate_grid[wl])}
            by_system[system] = {"per_rate": {f"{r:g}": s for r, s in per.items()},
                                 "goodput": goodput({r: s for r, s in per.items() if not s["run"]["stopped_early"]})}
        results[wl] = add_intervals(by_system)
    return results


# ---- how much the device model's assumptions matter ------------------------------------------------

SENSITIVITY = {"default": {}, "no contention": {"contention_model": False},
               "overlap split evenly": {"overlap_share": "even"}, "no noise": {"noise": 0.0},
               "policy blind to contention": {"policy_contention": False}}
SENSITIVITY_RATES = {"sharegpt": 10, "azure-code": 3, "arxiv": 3}


def sensitivity_one(job: tuple) -> tuple:
    workload, system, variant, duration, seed = job
    ttft, tpot = TABLE4_SLOS[workload]
    config = SimConfig(policy=system, ttft_slo=ttft, tpot_slo=tpot, seed=seed, **SENSITIVITY[variant])
    result = Simulation(config, build_workload(workload, SENSITIVITY_RATES[workload], duration, seed)).run()
    return workload, system, variant, result.summary


def run_sensitivity(args) -> list[dict]:
    jobs = [(wl, system, variant, args.duration, args.seed) for wl in args.workloads
            for system in ("bullet", "chunked:1024") for variant in SENSITIVITY]
    rows = []
    with Pool(args.jobs) as pool:
        for wl, system, variant, s in pool.imap(sensitivity_one, jobs):
            rows.append({"workload": wl, "rate": SENSITIVITY_RATES[wl], "system": system, "variant": variant,
                         "attainment": s["attainment"], "mean_ttft_s": s["mean_ttft_s"],
                         "mean_tpot_s": s["mean_tpot_s"], "output_tok_per_s": s["output_tok_per_s"]})
            print(f"[sim-compare] sensitivity {wl} {system} {variant}: attainment {s['attainment']:.1%}", flush=True)
    return rows


def timelines(out: Path, args) -> list[Path]:
    """Fig. 20-like: every decision of Bullet and of the chunked baseline on one workload and rate."""
    paths = []
    wl, rate = args.timeline_workload, args.timeline_rate
    for system, name, plot in [("bullet", "timeline_bullet.png", plot_timeline),
                               (args.timeline_chunked, "timeline_chunked.png", plot_chunked_timeline)]:
        directory = out / "timeline" / system.replace(":", "-")
        for old in directory.glob("*.jsonl"):
            old.unlink()  # the timeline appends
        *_, summary = simulate_one((wl, system, rate, args.timeline_duration, args.seed, str(directory)))
        print(f"[sim-compare] timeline {system} {wl} @ {rate:g} req/s: attainment {summary['attainment']:.1%}, "
              f"TTFT {summary['mean_ttft_s']:.2f}s, TPOT {summary['mean_tpot_s'] * 1e3:.0f}ms")
        paths.append(plot(directory, out / name))
    return paths


def rate_grid(overrides: list[str], workloads: list[str]) -> dict[str, list[float]]:
    """RATES with `workload:r1,r2` overrides applied."""
    grid = {wl: [float(r) for r in RATES[wl]] for wl in workloads}
    for item in overrides:
        wl, _, rates = item.partition(":")
        if wl not in RATES or not rates:
            raise SystemExit(f"--rates {item!r}: expected <workload>:<rate>[,<rate>...] with a workload of {list(RATES)}")
        grid[wl] = sorted(float(r) for r in rates.split(","))
    return grid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--systems", nargs="+", default=SYSTEMS)
    ap.add_argument("--rates", nargs="*", default=[], metavar="WORKLOAD:R1,R2", help="override a workload's rates")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per run")
    ap.add_argument("--repeats", type=int, default=1, help="seeds per point (seed, seed+1, ...), pooled")
    ap.add_argument("--parts", nargs="+", default=["comparison", "sensitivity", "timeline"],
                    choices=["comparison", "sensitivity", "timeline"])
    ap.add_argument("--timeline-duration", type=float, default=120.0)
    ap.add_argument("--timeline-workload", default="azure-code", choices=list(RATES))
    ap.add_argument("--timeline-rate", type=float, default=5.0)
    ap.add_argument("--timeline-chunked", default="chunked:2048")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-sensitivity", dest="sensitivity", action="store_false",
                    help="skip the runs that vary the device model's assumptions (same as leaving it out of --parts)")
    ap.add_argument("--title", default=None, help="heading of results.md and the figure")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim"))
    args = ap.parse_args()
    args.rate_grid = rate_grid(args.rates, args.workloads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    if "comparison" in args.parts or ("sensitivity" in args.parts and args.sensitivity):
        results = run_all(args) if "comparison" in args.parts else {}
        sensitivity = run_sensitivity(args) if "sensitivity" in args.parts and args.sensitivity else []
        (out / "results.json").write_text(json.dumps({"simulated": True, "args": vars(args), "workloads": results,
                                                      "sensitivity": sensitivity}, indent=1))
        report = (markdown(results, args) if results else "") + ("\n" + sensitivity_markdown(sensitivity)
                                                                  if sensitivity else "")
        (out / "results.md").write_text(report)
        print(report)
        if results:
            title = args.title or "SIMULATED Llama-3.1-8B on a virtual A100"
            figures.append(plot_comparison(results, out / "comparison.png", TITLES, TABLE4_SLOS,
                                           f"{title} (x: run stopped early, means partial)"))
    if "timeline" in args.parts:
        figures += timelines(out, args)
    for path in figures:
        print(f"[sim-compare] figure: {path}")


if __name__ == "__main__":
    main()
