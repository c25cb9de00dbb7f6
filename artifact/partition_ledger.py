"""What the partition gains and costs, policy by policy, on the same arrivals — the ledger of
`bullet.sim.ledger` (whole-device seconds: work = busy − solo loss + co-run gain) beside each run's SLO
attainment, for Bullet and its ablations on each workload at one rate.

    python -m artifact.partition_ledger [--workloads sharegpt azure-code arxiv]
        [--policies bullet scheduler-only partition-only naive] [--rates sharegpt=55 azure-code=6 arxiv=4]
        [--seeds 1 2 3] [--duration 60] [--estimator-profile PATH] [--ttft-slo 3ms/token] [--tpot-slo 50ms]
        [--set KEY=VALUE ...] [--jobs 2] [--out artifact/results/partition-ledger]

Simulated, not measured: by default on the measured H200 profile shipped with the estimator, at the
GPU plan's SLOs (TTFT 3 ms/token, TPOT 50 ms). Writes `ledger.json` and `ledger.md` (means over the
seeds)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from multiprocessing import Pool
from pathlib import Path

from artifact.crossing import parse_override
from bullet.sim import SimConfig, Simulation
from bullet.workloads.traces import build_workload
from estimator.reference.profiles import H200_PROFILE

POLICIES = ["bullet", "scheduler-only", "partition-only", "naive"]
WORKLOADS = ["sharegpt", "azure-code", "arxiv"]
DEFAULT_RATES = {"sharegpt": 55.0, "azure-code": 6.0, "arxiv": 4.0}  # near bullet's crossing on the measured H200
LEDGER_FIELDS = ("busy_s", "work_total_s", "solo_loss_s", "corun_s", "corun_gain_s", "split_gain_s",
                 "contention_loss_s", "idle_unit_fraction")
SUMMARY_FIELDS = ("attainment", "ttft_attained", "tpot_attained", "p50_ttft_s", "p90_ttft_s", "p50_tpot_s", "p90_tpot_s")


def run_one(job: tuple) -> dict:
    workload, policy, rate, seed, duration, overrides = job
    t0 = time.perf_counter()
    config = SimConfig(**{"policy": policy, "seed": seed, "ledger": True, **overrides})
    result = Simulation(config, build_workload(workload, rate, duration, seed)).run()
    return {"workload": workload, "policy": policy, "rate": rate, "seed": seed,
            "summary": {k: result.summary[k] for k in SUMMARY_FIELDS},
            "ledger": result.counters["ledger"], "steps": result.counters["steps"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def _mean(rows: list[dict], get) -> float:
    return statistics.mean(get(r) for r in rows)


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        out[workload] = {}
        for policy in dict.fromkeys(r["policy"] for r in rows if r["workload"] == workload):
            mine = [r for r in rows if r["workload"] == workload and r["policy"] == policy]
            entry = {k: _mean(mine, lambda r, k=k: r["summary"][k]) for k in SUMMARY_FIELDS}
            entry.update({k: _mean(mine, lambda r, k=k: r["ledger"][k] or 0.0) for k in LEDGER_FIELDS})
            roles = sorted({role for r in mine for role in r["ledger"]["mean_corun_units"]})
            entry["mean_corun_units"] = {role: _mean(mine, lambda r, role=role: r["ledger"]["mean_corun_units"].get(role, 0.0))
                                         for role in roles}
            entry["work_s"] = {role: _mean(mine, lambda r, role=role: r["ledger"]["work_s"].get(role, 0.0))
                               for role in sorted({k for r in mine for k in r["ledger"]["work_s"]})}
            entry.update(rate=mine[0]["rate"], seeds=len(mine))
            out[workload][policy] = entry
    return out


def markdown(summary: dict, header: str) -> str:
    lines = [header, ""]
    for workload, policies in summary.items():
        rate = next(iter(policies.values()))["rate"]
        lines += [f"### {workload} at {rate:g} req/s", "",
                  "| policy | attainment (TTFT / TPOT ok) | busy s | work s (prefill / decode) | solo loss s | co-run s "
                  "| co-run gain s (split's worth, contention) | units idle while busy | mean co-run units (prefill / decode) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for policy, e in policies.items():
            units = e["mean_corun_units"]
            lines.append(
                f"| {policy} | {e['attainment']:.3f} ({e['ttft_attained']:.3f} / {e['tpot_attained']:.3f}) "
                f"| {e['busy_s']:.1f} | {e['work_total_s']:.1f} ({e['work_s'].get('prefill', 0):.1f} / "
                f"{e['work_s'].get('decode', 0):.1f}) | {e['solo_loss_s']:.1f} | {e['corun_s']:.1f} "
                f"| {e['corun_gain_s']:+.1f} ({e['split_gain_s']:+.1f}, -{e['contention_loss_s']:.1f}) "
                f"| {e['idle_unit_fraction']:.1%} | {units.get('prefill', 0):.0f} / {units.get('decode', 0):.0f} |")
        lines.append("")
    return "\n".join(lines)


def parse_rates(items: list[str]) -> dict[str, float]:
    rates = dict(DEFAULT_RATES)
    for item in items:
        workload, _, value = item.partition("=")
        try:
            rates[workload] = float(value)
        except ValueError:
            raise SystemExit(f"--rates: expected WORKLOAD=REQ_PER_S, got {item!r}")
    return rates


def parse_sets(items: list[str]) -> dict:
    return dict(parse_override(item) for item in items)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--rates", nargs="*", default=[], metavar="WORKLOAD=REQ_PER_S",
                    help=f"rate per workload (default {DEFAULT_RATES})")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--estimator-profile", default=str(H200_PROFILE),
                    help="the device model (default: the measured H200 profile shipped with the estimator; '' for "
                         "none: the built-in device of --set hardware=NAME, a100 unless given, and its shipped calibration)")
    ap.add_argument("--ttft-slo", default="3ms/token")
    ap.add_argument("--tpot-slo", default="50ms")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="SimConfig overrides for every run")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="artifact/results/partition-ledger")
    args = ap.parse_args(argv)
    rates = parse_rates(args.rates)
    missing = [w for w in args.workloads if w not in rates]
    if missing:
        ap.error(f"no rate for {', '.join(missing)}: give --rates {missing[0]}=<req/s>")
    overrides = {"estimator_profile": args.estimator_profile, "ttft_slo": args.ttft_slo, "tpot_slo": args.tpot_slo,
                 **parse_sets(args.set)}
    jobs = [(w, p, rates[w], seed, args.duration, overrides) for w in args.workloads for p in args.policies
            for seed in args.seeds]
    rows = []
    with Pool(args.jobs) as pool:
        for i, row in enumerate(pool.imap_unordered(run_one, jobs), 1):
            rows.append(row)
            print(f"[ledger] {i}/{len(jobs)} {row['workload']} {row['policy']} seed {row['seed']}: attainment "
                  f"{row['summary']['attainment']:.3f}, busy {row['ledger']['busy_s']:.1f}s ({row['wall_s']}s)", flush=True)
    order = {(w, p, s): i for i, (w, p, _, s, _, _) in enumerate(jobs)}
    rows.sort(key=lambda r: order[(r["workload"], r["policy"], r["seed"])])
    summary = summarize(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = Path(args.estimator_profile).name if args.estimator_profile else f"built-in {overrides.get('hardware') or 'a100'}"
    header = (f"SIMULATED ({device}; TTFT {args.ttft_slo}, TPOT {args.tpot_slo}; "
              f"{args.duration:g} s of arrivals; seeds {' '.join(map(str, args.seeds))}; overrides "
              f"{parse_sets(args.set) or 'none'})")
    (out / "ledger.json").write_text(json.dumps({"header": header, "overrides": overrides, "rows": rows,
                                                 "summary": summary}, indent=1))
    (out / "ledger.md").write_text(markdown(summary, header))
    print(markdown(summary, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
