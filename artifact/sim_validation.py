"""The simulator against served runs: each served run's load replayed in the simulator, for the same
policy, on the device model of a measured profile of the serving device, and predicted vs measured
TTFT and TPOT (P50, P90) and throughput, with the error of every cell.

    python -m artifact.sim_validation --serve-jsonl docs/sim/h200-2026-11-26/serve.jsonl \\
        --profile estimator/reference/data/h200-llama-3.1-8b-green-ctx.json \\
        --max-total-tokens 131072 --max-running-requests 128 --out docs/sim/validation-h200
    python -m artifact.sim_validation --bench-serving logs/bench-bullet.jsonl,bullet ... --profile logs/profile.json \
        --served-steps-by-system logs/timeline ...   # a GPU check's logs.tgz (docs/sim/validation-h200-2026-11-26b.md)
    python -m artifact.sim_validation --bench-serving bench-bullet-2.0-0.jsonl,bullet,1 ... --profile <cpu profile>
    python -m artifact.sim_validation --comparison docs/artifact/full-2026-11-26/06_cpu_comparison/results.json \
        --profile <cpu profile> --max-total-tokens 32768 --max-running-requests 64 ...

Each run is simulated with `--seeds` seeds (the simulator's noise and its policies' estimator error
differ; the load does not) and the predictions averaged. Percentiles are computed the way the served
run computed them (`ServedRun.percentiles`). Rankings: at each rate, the systems ordered by each metric,
predicted against measured. Goals (issue 25): P50s within 15 %, P90s within 30 %, the same ranking.
Writes <out>.json and <out>.md."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from artifact.served_runs import ServedRun, nearest_rank, read_bench_runs, read_comparison, read_serve_jsonl
from artifact.slo_rule import server_slo_flags
from bullet.sim import SimConfig, Simulation
from bullet.sim.metrics import percentile
from bullet.types.slo import parse_duration

# the GPU run's load generator judges TTFT <= max(0.25 s, 3 ms x prompt tokens) and TPOT <= 50 ms
GPU_RUN_SLO_RULE = (0.003, 0.25, 0.05)

METRICS = ("ttft_p50_s", "ttft_mean_s", "ttft_p90_s", "tpot_p50_s", "tpot_mean_s", "tpot_p90_s", "out_tok_per_s")
GOALS = {"ttft_p50_s": 0.15, "tpot_p50_s": 0.15, "ttft_p90_s": 0.30, "tpot_p90_s": 0.30}
LOWER_IS_BETTER = {m: m != "out_tok_per_s" for m in METRICS}


def predict(run: ServedRun, base: SimConfig, seed: int) -> dict:
    """One simulated replay of `run` (each of its loads, their requests pooled): its metrics, computed
    the way the served run computed them."""
    config = SimConfig(**{**base.as_dict(), **run.extra.get("sim", {}), "policy": run.system, "seed": seed})
    deadline = run.extra.get("deadline_s")  # the served point cut what ran past it (seconds from its start)
    done, span, wall = [], 0.0, 0.0
    for load in run.loads:
        result = Simulation(config, load).run()
        ok = [r for r in result.records if r.ok]
        start = min(a for a, _, _ in load)
        if deadline is not None:
            cut = len(ok)
            ok = [r for r in ok if r.finish_time <= deadline]
            cut -= len(ok)
        done += ok
        if deadline is not None and cut:
            span += deadline - start
        else:
            span += max(r.finish_time for r in ok) - start if ok else 0.0
        wall += result.wall_s
    pct = nearest_rank if run.percentiles == "nearest-rank" else percentile
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    gaps = [g for r in done for g in r.token_gaps]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "tpot_p50_s": pct(tpot, 50),
            "tpot_p90_s": pct(tpot, 90), "ttft_mean_s": mean(ttft), "tpot_mean_s": mean(tpot),
            "out_tok_per_s": sum(r.output_len for r in done) / span if span else 0.0,
            "p99_tbt_s": percentile(gaps, 99), "completed": len(done), "wall_s": wall, "records": done}


def attainment(records, ttft_per_token: float, ttft_floor: float, tpot: float, total: int) -> float:
    """The GPU run's load generator's SLO rule: TTFT <= max(floor, per-token x prompt), TPOT <= target."""
    ok = [r for r in records if r.ttft <= max(ttft_floor, ttft_per_token * r.input_len)
          and (r.tpot is None or r.tpot <= tpot)]
    return len(ok) / total if total else 0.0


def slo_rule_arg(text: str) -> tuple[float, float, float] | str:
    """`--slo-rule`: per-token TTFT, TTFT floor, TPOT — seconds, or durations as the server takes them
    ('21.9ms/token,0,287ms'); '' judges no attainment."""
    if not text.strip():
        return "none"
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give three values, per-token TTFT,TTFT floor,TPOT "
                                         "(e.g. 3ms/token,250ms,50ms or 0.003,0.25,0.05)")
    try:
        per_token = parse_duration(parts[0], allow_per_token=True)[0]
        floor = 0.0 if parts[1] in ("0", "0s", "0ms") else parse_duration(parts[1], allow_per_token=False)[0]
        tpot = parse_duration(parts[2], allow_per_token=False)[0]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return per_token, floor, tpot


def comparison_slo_rule(path: str) -> tuple[float, float, float] | None:
    """The SLO a served comparison (`artifact.cpu_comparison`'s results.json) scored its requests by."""
    slo = json.loads(Path(path).read_text()).get("slo") or {}
    if "ttft_s_per_token" in slo and "tpot_s" in slo:
        return slo["ttft_s_per_token"], 0.0, slo["tpot_s"]
    return None


def comparison_policy_slo(path: str) -> tuple[str, str] | None:
    """The `--ttft-slo` and `--tpot-slo` a served comparison gave its servers' policies (the SLO it scored
    by): a replay that gave its simulated policies other targets would replay other decisions."""
    slo = json.loads(Path(path).read_text()).get("slo") or {}
    if "ttft_s_per_token" in slo and "tpot_s" in slo:
        return server_slo_flags(slo["ttft_s_per_token"], slo["tpot_s"])
    return None


def validate(runs: list[ServedRun], base: SimConfig, seeds: list[int], slo_rule: tuple | None) -> list[dict]:
    rows = []
    for run in runs:
        preds = [predict(run, base, s) for s in seeds]
        predicted = {m: statistics.fmean(p[m] for p in preds) for m in (*METRICS, "p99_tbt_s")}
        spread = {m: (min(p[m] for p in preds), max(p[m] for p in preds)) for m in METRICS}
        if slo_rule is not None:
            predicted["attainment"] = statistics.fmean(attainment(p["records"], *slo_rule, run.num_requests)
                                                       for p in preds)
        errors = {m: predicted[m] / run.measured[m] - 1 for m in METRICS if run.measured.get(m)}
        if "p99_tbt_s" in run.measured:
            errors["p99_tbt_s"] = predicted["p99_tbt_s"] / run.measured["p99_tbt_s"] - 1
        rows.append({"system": run.system, "rate": run.rate, "requests": run.num_requests, "load": run.load,
                     "source": run.source, "percentiles": run.percentiles, "measured": run.measured,
                     "predicted": predicted, "seed_range": spread, "error": errors,
                     "sim_wall_s": sum(p["wall_s"] for p in preds)})
        print(f"[validate] {run.system:>13} @ {run.rate:g} req/s: " + ", ".join(
            f"{m} {run.measured[m]:.4g} vs {predicted[m]:.4g} ({errors[m]:+.0%})" for m in errors), flush=True)
    return rows


def concordant(at: list[dict], metric: str) -> bool:
    """No two systems swap places: wherever the measurement ranks one strictly better, the prediction
    does not rank it strictly worse (ties, e.g. 0 % attainment for both, order nothing)."""
    sign = -1.0 if LOWER_IS_BETTER.get(metric, False) else 1.0
    for a in at:
        for b in at:
            if (sign * (a["measured"][metric] - b["measured"][metric]) > 0
                    and sign * (a["predicted"][metric] - b["predicted"][metric]) < 0):
                return False
    return True


def rankings(rows: list[dict]) -> list[dict]:
    """At each rate, the systems ordered by each metric (best first), measured and predicted; `same`
    when no pair of systems swaps places (`concordant`)."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        at = [r for r in rows if r["rate"] == rate]
        if len(at) < 2:
            continue
        for metric in (*METRICS, "attainment"):
            if not all(metric in r["measured"] and metric in r["predicted"] for r in at):
                continue
            reverse = not LOWER_IS_BETTER.get(metric, False)
            measured = [r["system"] for r in sorted(at, key=lambda r: r["measured"][metric], reverse=reverse)]
            predicted = [r["system"] for r in sorted(at, key=lambda r: r["predicted"][metric], reverse=reverse)]
            out.append({"rate": rate, "metric": metric, "measured": measured, "predicted": predicted,
                        "same": concordant(at, metric)})
    return out


HEADERS = {"ttft_p50_s": "TTFT p50", "ttft_mean_s": "TTFT mean", "ttft_p90_s": "TTFT p90", "tpot_p50_s": "TPOT p50",
           "tpot_mean_s": "TPOT mean", "tpot_p90_s": "TPOT p90", "out_tok_per_s": "output tok/s",
           "attainment": "attainment", "p99_tbt_s": "P99 TBT"}


def _cell(row: dict, metric: str) -> str:
    m, p = row["measured"].get(metric), row["predicted"].get(metric)
    if metric == "attainment":
        return f"{m:.0%} / {p:.0%}" if m is not None and p is not None else "–"
    scale, unit = (1.0, "") if metric == "out_tok_per_s" else (1e3, "ms")
    if m is None:
        return "–" if p is None else f"– / {p * scale:.0f}{unit}"
    if p is None:  # the replay finished none of the point's requests (a steady-state point cut them all)
        return f"{m * scale:.0f}{unit} / –"
    err = row["error"].get(metric)
    goal = GOALS.get(metric)
    if err is None:  # no relative error (a measured value of 0)
        return f"{m * scale:.0f} / {p * scale:.0f}{unit}"
    flag = "" if goal is None or abs(err) <= goal else " ✗"
    return f"{m * scale:.0f} / {p * scale:.0f}{unit} ({err:+.0%}{flag})"


def within_goal(rows: list[dict]) -> tuple[int, int]:
    """(P50/P90 latency cells within the goal, all of them)."""
    cells = [(m, e) for r in rows for m, e in r["error"].items() if m in GOALS]
    return sum(1 for m, e in cells if abs(e) <= GOALS[m]), len(cells)


def median_errors(rows: list[dict]) -> dict[str, float]:
    """Median |error| of the P50, mean, P90 and throughput cells (the labels that have any)."""
    out = {}
    for label, keys in (("P50", ("ttft_p50_s", "tpot_p50_s")), ("mean", ("ttft_mean_s", "tpot_mean_s")),
                        ("P90", ("ttft_p90_s", "tpot_p90_s")), ("throughput", ("out_tok_per_s",))):
        errors = [abs(r["error"][k]) for r in rows for k in keys if k in r["error"]]
        if errors:
            out[label] = statistics.median(errors)
    return out


def markdown(rows: list[dict], ranks: list[dict], title: str, notes: list[str]) -> str:
    columns = [m for m in (*METRICS, "attainment", "p99_tbt_s") if any(m in r["measured"] for r in rows)]
    lines = [f"# {title}", "", *(x for note in notes for x in (note, "")),
             "Each cell: measured / predicted (error). ✗: outside the goal (P50 ±15 %, P90 ±30 %).", "",
             "| system | rate | " + " | ".join(HEADERS[m] for m in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for r in sorted(rows, key=lambda r: (r["rate"], r["system"])):
        lines.append(f"| {r['system']} | {r['rate']:g} | " + " | ".join(_cell(r, m) for m in columns) + " |")
    within, cells = within_goal(rows)
    if cells:
        lines += ["", f"Within the goal: {within} of {cells} P50/P90 latency cells."]
    medians = [f"{label} cells {m:.0%}" for label, m in median_errors(rows).items()]
    if medians:
        lines += ["", "Median |error|: " + ", ".join(medians) + "."]
    if ranks:
        same = sum(r["same"] for r in ranks)
        lines += ["", f"Rankings (best first) — the same in {same} of {len(ranks)} (rate, metric) pairs:", "",
                  "| rate | metric | measured | predicted | same |", "|---|---|---|---|---|"]
        for r in ranks:
            lines.append(f"| {r['rate']:g} | {r['metric']} | {' > '.join(r['measured'])} | "
                         f"{' > '.join(r['predicted'])} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def fit_by_system(runs: list[ServedRun], profile: str, root: Path, by_role_fits: bool = True,
                  setup: bool = True) -> dict[str, dict]:
    """Each run replays on the device as its own server's steps measured it (`root/<system>/`, the
    fit of `artifact.served_steps`), set in `run.extra["sim"]`: each worker role with enough priced
    steps on its own fit (`by_role_fits`), the rest on the system's; returns each system's fits."""
    from artifact.server import system_slug  # deferred: the server helpers import the launcher's config
    from artifact.served_steps import attention_setup, fit, fit_by_role, priced_by_role, read_timelines  # deferred: numpy
    from estimator.profile import load_estimator  # deferred: as above

    est = load_estimator(profile)
    steps = {system: priced_by_role(read_timelines([root / system_slug(system)]), est)
             for system in dict.fromkeys(run.system for run in runs)}
    fits, roles, pooled = {}, {}, []
    for system, by_role in steps.items():
        try:
            fits[system], roles[system] = fit_by_role(by_role, setup) if by_role_fits else (fit(
                [step for steps in by_role.values() for step in steps], setup), {})
        except ValueError as exc:  # e.g. a timeline from before hybrid steps were recorded in full
            print(f"[validate] {system}: {exc}; it takes the other systems' pooled fit", flush=True)
            pooled.append(system)
    if pooled:
        if not fits:
            raise SystemExit(f"{root}: no system's steps could be priced")
        shared = fit([step for system in fits for role_steps in steps[system].values() for step in role_steps], setup)
        fits.update({system: shared for system in pooled})
        roles.update({system: {} for system in pooled})
    for system, times in fits.items():
        print(f"[validate] {system}: served steps vs the profile {times.as_dict()}"
              + "".join(f"; {role} {t.as_dict()}" for role, t in roles[system].items()), flush=True)
    setups = {system: attention_setup(times, roles[system]) for system, times in fits.items()}
    for run in runs:
        times = fits[run.system]
        run.extra["sim"] = {"step_time_scale": times.scale, "step_overhead_s": times.overhead_s,
                            "role_step_times": {role: (t.scale, t.overhead_s) for role, t in roles[run.system].items()},
                            "attention_setup_s": setups[run.system]}
    return {system: {**times.as_dict(), "pooled": system in pooled, "attention_setup_s": setups[system],
                     "by_role": {role: t.as_dict() for role, t in roles[system].items()}}
            for system, times in fits.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-jsonl", type=Path, help="a load-generator summary file (one run per line)")
    p.add_argument("--bench-serving", nargs="+", default=[], metavar="FILE,POLICY[,SEED]",
                   help="bench_serving --output-details files (every run in each; artifact.loadgen's too), "
                        "with the policy served and, where the file records no arrivals, the run's --seed")
    p.add_argument("--comparison", type=Path, help="a served comparison's results.json (artifact.cpu_comparison)")
    p.add_argument("--systems", nargs="+", default=None, help="only these systems of --comparison")
    p.add_argument("--profile", required=True, help="the serving device's estimator profile")
    p.add_argument("--max-total-tokens", type=int, required=True, help="the servers' KV pool")
    p.add_argument("--max-running-requests", type=int, required=True)
    p.add_argument("--ttft-slo", default=None,
                   help="the SLOs the servers' policies were given (default: a --comparison's own, which its "
                        "servers were started with; else 3.0ms/token and 150ms)")
    p.add_argument("--tpot-slo", default=None)
    steps_how = p.add_mutually_exclusive_group()
    steps_how.add_argument("--served-steps", nargs="+", default=None, metavar="TIMELINE_DIR",
                           help="replay on the device as the served run's own step log measured it: the profile's "
                                "latencies scaled (plus a per-step overhead) to fit the steps these timeline "
                                "directories recorded (artifact.served_steps)")
    steps_how.add_argument("--served-steps-by-system", type=Path, default=None, metavar="TIMELINE_ROOT",
                           help="as --served-steps, fitted for each system to its own server's steps: "
                                "TIMELINE_ROOT/<system>/ (a served comparison's <out>/timeline) — where the "
                                "profile prices one system's steps worse than another's (a hybrid step, "
                                "which no profile sample times)")
    p.add_argument("--one-fit-per-system", action="store_true",
                   help="with --served-steps-by-system: one fit for all of a system's steps, not one per worker role")
    p.add_argument("--no-attention-setup", action="store_true",
                   help="with --served-steps(-by-system): fit no set-up per new attention length (a per-shape kernel "
                        "plan the served prefill paid; the fit before 2026-11-27)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--slo-rule", type=slo_rule_arg, default=None,
                   help="per-token TTFT, TTFT floor, TPOT that attainment is judged by, e.g. 3ms/token,250ms,50ms "
                        "('' for none; default: a --comparison's own SLO, else the GPU run's 3ms/token,250ms,50ms)")
    p.add_argument("--title", default="Simulator vs served runs")
    p.add_argument("--note", action="append", default=[])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runs: list[ServedRun] = read_serve_jsonl(args.serve_jsonl) if args.serve_jsonl else []
    for spec in args.bench_serving:
        path, policy, *seed = spec.split(",")
        runs += read_bench_runs(path, policy, int(seed[0]) if seed else None)
    if args.comparison:
        from bullet.workloads.sharegpt import repaired_sharegpt_path  # deferred: the tokenizer's imports are heavy
        from engines.tokenizer import gguf_tokenizer_dir  # deferred: as above
        from engines.weights.resolve import default_gguf_path  # deferred: as above

        runs += read_comparison(args.comparison, str(gguf_tokenizer_dir(default_gguf_path())), repaired_sharegpt_path(),
                                args.systems)
    if not runs:
        p.error("give --serve-jsonl, --bench-serving or --comparison")
    steps = None
    if args.served_steps:
        from artifact.served_steps import served_step_times  # deferred: numpy and the profile loader

        steps = served_step_times(args.profile, args.served_steps, not args.no_attention_setup)
        print(f"[validate] served steps vs the profile: {steps.as_dict()}", flush=True)
    by_system = fit_by_system(runs, args.profile, args.served_steps_by_system, not args.one_fit_per_system,
                              not args.no_attention_setup) if args.served_steps_by_system else None
    served_slo = (args.comparison and comparison_policy_slo(args.comparison)) or ("3.0ms/token", "150ms")
    ttft_slo, tpot_slo = args.ttft_slo or served_slo[0], args.tpot_slo or served_slo[1]
    print(f"[validate] the simulated policies are given TTFT {ttft_slo}, TPOT {tpot_slo}", flush=True)
    base = SimConfig(estimator_profile=args.profile, max_total_tokens=args.max_total_tokens,
                     max_running_requests=args.max_running_requests, ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                     **({"step_time_scale": steps.scale, "step_overhead_s": steps.overhead_s,
                         "attention_setup_s": steps.setup_s} if steps else {}))
    slo_rule = args.slo_rule
    if slo_rule is None:
        slo_rule = (args.comparison and comparison_slo_rule(args.comparison)) or GPU_RUN_SLO_RULE
    elif slo_rule == "none":
        slo_rule = None
    rows = validate(runs, base, list(range(args.seeds)), slo_rule)
    ranks = rankings(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"config": base.as_dict(), "seeds": args.seeds, "slo_rule": slo_rule, "notes": args.note,
         "served_steps": ({**steps.as_dict(), "timelines": [str(d) for d in args.served_steps]} if steps
                          else {"by_system": by_system, "root": str(args.served_steps_by_system)} if by_system else None),
         "runs": rows,
         "rankings": ranks},
        indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, ranks, args.title, args.note))
    print(markdown(rows, ranks, args.title, args.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
