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
simulated: see bullet/sim/report.py for what that does and does not include."""

from __future__ import annotations

import argparse
import json
import time
from multiprocessing import Pool
from pathlib import Path

from artifact.plots import plot_timeline
from artifact.scoring import goodput
from bullet.commands.simulate import TABLE4_SLOS
from bullet.loops.timeline import load_timeline
from bullet.sim import SimConfig, Simulation
from bullet.workloads.traces import build_workload

SYSTEMS = ["bullet", "chunked:1024", "chunked:2048", "static:54", "static:72", "static:84", "naive"]
RATES = {"sharegpt": [2, 5, 10, 15, 20, 25, 30], "azure-code": [0.5, 1, 2, 3, 4, 5, 6], "arxiv": [0.5, 1, 2, 3, 4, 5]}
TITLES = {"sharegpt": "ShareGPT", "azure-code": "Azure-Code", "arxiv": "arXiv-Sum"}
STOP_BELOW = 0.5
PAPER = ("Bullet paper, one A100 (Fig. 15): 1.09x average / up to 1.20x throughput vs SGLang-1024, "
         "13.5x lower TTFT with 0.94x TPOT; chunked systems show seconds of TTFT even at low rates.")


def simulate_one(job: tuple) -> tuple:
    workload, system, rate, duration, seed, timeline_dir = job
    ttft, tpot = TABLE4_SLOS[workload]
    config = SimConfig(policy=system, ttft_slo=ttft, tpot_slo=tpot, seed=seed, timeline_dir=timeline_dir,
                       stop_below_attainment=None if timeline_dir else STOP_BELOW)
    result = Simulation(config, build_workload(workload, rate, duration, seed)).run()
    run = {"stopped_early": result.stopped_early, "wall_s": result.wall_s, "virtual_s": result.end_time,
           "corun_s": result.device.corun_s, **result.counters}
    return workload, system, rate, {**result.summary, "run": run}


def run_all(args) -> dict:
    jobs = [(wl, system, rate, args.duration, args.seed, None)
            for wl in args.workloads for rate in RATES[wl] for system in args.systems]
    results: dict = {wl: {} for wl in args.workloads}
    t0 = time.monotonic()
    with Pool(args.jobs) as pool:
        for k, (wl, system, rate, summary) in enumerate(pool.imap_unordered(simulate_one, jobs), 1):
            results[wl].setdefault(system, {})[rate] = summary
            print(f"[sim-compare] {k:3d}/{len(jobs)} {wl:>10} {system:>12} @ {rate:>4} req/s: "
                  f"attainment {summary['attainment']:5.1%}{' (stopped)' if summary['run']['stopped_early'] else ''}, "
                  f"TTFT {summary['mean_ttft_s']:.3f}s, TPOT {summary['mean_tpot_s'] * 1e3:.0f}ms, "
                  f"{summary['output_tok_per_s']:.0f} tok/s [{summary['run']['wall_s']:.0f}s, "
                  f"total {time.monotonic() - t0:.0f}s]", flush=True)
    return {wl: {system: {"per_rate": {f"{r:g}": per[r] for r in sorted(per)},
                          "goodput": goodput({r: s for r, s in per.items() if not s["run"]["stopped_early"]})}
                 for system, per in sorted(by_system.items(), key=lambda kv: args.systems.index(kv[0]))}
            for wl, by_system in results.items()}


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


def sensitivity_markdown(rows: list[dict]) -> str:
    lines = ["## Sensitivity to the device model's assumptions", "",
             "| workload @ rate | system | variant | attain | TTFT mean s | TPOT mean ms | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {TITLES[r['workload']]} @ {r['rate']} | {r['system']} | {r['variant']} | {r['attainment']:.1%} | "
                     f"{r['mean_ttft_s']:.3f} | {r['mean_tpot_s'] * 1e3:.0f} | {r['output_tok_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


# ---- reporting ------------------------------------------------------------------------------------

def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def markdown(results: dict, args) -> str:
    lines = [f"# Simulated comparison (Llama-3.1-8B, virtual A100, {args.duration:g} s of Poisson arrivals per point)",
             "", "SIMULATED: estimator latencies, assumed contention, no framework overhead. " + PAPER, ""]
    lines += ["## Goodput (highest rate with >= 90 % SLO attainment, req/s) and bullet / system", "",
              "| system | " + " | ".join(TITLES[w] for w in results) + " | mean bullet/system |",
              "|---|" + "---|" * (len(results) + 1)]
    for system in args.systems:
        cells, ratios = [], []
        for by_system in results.values():
            g = by_system[system]["goodput"]
            ref = by_system["bullet"]["goodput"] if "bullet" in by_system else None
            if system == "bullet" or ref is None:
                cells.append(f"{g:g}")
                continue
            cells.append(f"{g:g} ({ratio(ref, g)})")
            if g:
                ratios.append(ref / g)
        mean = f"{sum(ratios) / len(ratios):.2f}x" if ratios else "-"
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {mean} |")
    for wl, by_system in results.items():
        ttft, tpot = TABLE4_SLOS[wl]
        lines += ["", f"## {TITLES[wl]} (SLO: TTFT {ttft}, TPOT {tpot})", "",
                  "| system | rate | attain | TTFT ok | TPOT ok | TTFT mean s | TTFT p90 s | TPOT mean ms | TPOT p90 ms | tok/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for system, res in by_system.items():
            for rate, s in res["per_rate"].items():
                stop = " (stopped)" if s["run"]["stopped_early"] else ""
                lines.append(f"| {system} | {rate} | {s['attainment']:.1%}{stop} | {s['ttft_attained']:.1%} | "
                             f"{s['tpot_attained']:.1%} | {s['mean_ttft_s']:.3f} | {s['p90_ttft_s']:.3f} | "
                             f"{s['mean_tpot_s'] * 1e3:.0f} | {s['p90_tpot_s'] * 1e3:.0f} | {s['output_tok_per_s']:.0f} |")
    lines += ["", "## Bullet against chunked:1024 over the rates both completed", ""]
    for wl, by_system in results.items():
        if "bullet" not in by_system or "chunked:1024" not in by_system:
            continue
        b, c = by_system["bullet"]["per_rate"], by_system["chunked:1024"]["per_rate"]
        common = [r for r in b if r in c and not b[r]["run"]["stopped_early"] and not c[r]["run"]["stopped_early"]]
        if common:
            tput = sum(b[r]["output_tok_per_s"] / c[r]["output_tok_per_s"] for r in common) / len(common)
            ttft = sum(c[r]["mean_ttft_s"] / b[r]["mean_ttft_s"] for r in common) / len(common)
            tpot = sum(c[r]["mean_tpot_s"] / b[r]["mean_tpot_s"] for r in common) / len(common)
            lines.append(f"* {TITLES[wl]} (rates {', '.join(common)}): mean over rates of bullet/chunked throughput "
                         f"{tput:.2f}, chunked/bullet mean TTFT {ttft:.2f}, chunked/bullet mean TPOT {tpot:.2f} "
                         "(above 1: Bullet better)")
    return "\n".join(lines) + "\n"


def plot_comparison(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("attainment", "SLO attainment", 1.0), ("mean_ttft_s", "mean TTFT (s)", 1.0),
              ("mean_tpot_s", "mean TPOT (ms)", 1e3), ("output_tok_per_s", "throughput (tok/s)", 1.0)]
    fig, axes = plt.subplots(len(results), 4, figsize=(17, 3.4 * len(results)), squeeze=False)
    for row, (wl, by_system) in zip(axes, results.items()):
        for ax, (key, label, scale) in zip(row, panels):
            for system, res in by_system.items():
                rates = list(res["per_rate"])
                ax.plot([float(r) for r in rates], [res["per_rate"][r][key] * scale for r in rates], marker="o",
                        ms=3, label=system, linewidth=2.5 if system == "bullet" else 1.1)
                stopped = [r for r in rates if res["per_rate"][r]["run"]["stopped_early"]]
                ax.plot([float(r) for r in stopped], [res["per_rate"][r][key] * scale for r in stopped], "x",
                        color="gray", ms=6)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if key == "mean_ttft_s":
                ax.set_yscale("log")
        row[0].axhline(0.9, color="gray", linestyle=":")
        ttft, tpot = TABLE4_SLOS[wl]
        row[0].set_title(f"{TITLES[wl]} (TTFT {ttft}, TPOT {tpot})", fontsize=10, loc="left")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("SIMULATED Llama-3.1-8B on a virtual A100 (x: run stopped early, means partial)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_chunked_timeline(directory: Path, path: Path) -> Path:
    """Fig. 20b-like: the chunked baseline's hybrid batches and queue over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_timeline(directory)
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(12, 6), sharex=True)
    axes[0].plot(t, [r["tokens"] for r in rows], ".", ms=2)
    axes[0].set_ylabel("tokens / step")
    axes[1].plot(t, [r["batch"] for r in rows], ".", ms=2, color="tab:orange")
    axes[1].set_ylabel("running requests")
    axes[2].plot(t, [r["queue"] for r in rows], ".", ms=2, color="tab:red")
    axes[2].set_ylabel("waiting")
    axes[2].set_xlabel("time (s)")
    fig.suptitle("SIMULATED chunked prefill: hybrid batches on the whole device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timelines(out: Path, args) -> list[Path]:
    paths = []
    for system, name, plot in [("bullet", "timeline_bullet.png", plot_timeline),
                               (args.timeline_chunked, "timeline_chunked.png", plot_chunked_timeline)]:
        directory = out / "timeline" / system.replace(":", "-")
        for old in directory.glob("*.jsonl"):
            old.unlink()  # the timeline appends
        _, _, _, summary = simulate_one(("azure-code", system, 5.0, args.timeline_duration, args.seed, str(directory)))
        print(f"[sim-compare] timeline {system} azure-code @ 5 req/s: attainment {summary['attainment']:.1%}, "
              f"TTFT {summary['mean_ttft_s']:.2f}s, TPOT {summary['mean_tpot_s'] * 1e3:.0f}ms")
        paths.append(plot(directory, out / name))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--systems", nargs="+", default=SYSTEMS)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per run")
    ap.add_argument("--timeline-duration", type=float, default=120.0)
    ap.add_argument("--timeline-chunked", default="chunked:2048")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-sensitivity", dest="sensitivity", action="store_false",
                    help="skip the runs that vary the device model's assumptions")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_all(args)
    sensitivity = run_sensitivity(args) if args.sensitivity else []
    (out / "results.json").write_text(json.dumps({"simulated": True, "args": vars(args), "rates": RATES,
                                                  "workloads": results, "sensitivity": sensitivity}, indent=1))
    report = markdown(results, args) + ("\n" + sensitivity_markdown(sensitivity) if sensitivity else "")
    (out / "results.md").write_text(report)
    print(report)
    plot_comparison(results, out / "comparison.png")
    for path in [out / "comparison.png", *timelines(out, args)]:
        print(f"[sim-compare] figure: {path}")


if __name__ == "__main__":
    main()
