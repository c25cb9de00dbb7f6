"""Bullet against the usual alternatives, served for real on this machine and driven by
`sglang.bench_serving` on ShareGPT prompts, side by side in one run.

  python -m artifact.cpu_comparison [--systems bullet sglang:1024 chunked:1024 static naive]
                                    [--rates 2 3 4 5 6] [--num-prompts 150] [--context-len 512]

For each system: start `bullet launch --policy <system>`, run bench_serving at every rate, score each
request against SLOs derived from the profiled solo latencies (artifact/slo_rule.py), and report SLO
attainment with its 95 % bootstrap interval (artifact/stats.py; over requests, and over runs with
--repeats), goodput (highest rate with >= 90 % attainment) with its interval, "tie" against bullet
where the intervals overlap, mean/P90 TTFT and TPOT, throughput; also
Bullet's scheduler overhead per step from its decision timeline. Writes
<out>/results.json, a printed table, and figures (artifact/plots.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from artifact.bench_client import point_seed, run_bench_serving
from artifact.plots import plot_comparison
from artifact.report import comparison_markdown, print_comparison
from artifact.scoring import add_intervals, goodput, outcomes, summarize
from artifact.stats import Interval, attainment_interval, run_counts
from artifact.server import BulletServer, all_started, system_launch, system_slug
from artifact.slo_rule import derive_slo, server_slo_flags
from bullet.loops.timeline import load_timeline
from bullet.workloads.sharegpt import repaired_sharegpt_path
from engines.tokenizer import gguf_tokenizer_dir
from engines.weights.resolve import default_gguf_path, served_precision
from estimator.profile import load_estimator
from estimator.profiler.cache import ensure_profile

DEFAULT_SYSTEMS = ["bullet", "sglang:1024", "chunked:1024", "static", "naive"]


def prepare(args) -> tuple[str, Path, str, object]:
    tokenizer_dir = str(gguf_tokenizer_dir(default_gguf_path()))
    dataset = repaired_sharegpt_path()
    # the profile times what the servers serve: the GGUF as int8 by default, computing in fp32
    quantization, dtype = served_precision(None, "auto", "auto", args.dtype)
    profile = args.profile or str(ensure_profile(None, "auto", str(dtype).removeprefix("torch."),
                                                 sorted(os.sched_getaffinity(0)),
                                                 quick=not args.full_profile, quantization=quantization))
    return tokenizer_dir, dataset, profile, load_estimator(profile)


def scheduler_overhead(timeline_dir: Path) -> dict:
    out = {}
    rows = load_timeline(timeline_dir) if timeline_dir.exists() else []
    for role in ("prefill", "decode"):
        mine = [r for r in rows if r["role"] == role and r.get("run") and r.get("obs_ms")]
        if mine:
            sched = sum(r.get("sched_us", 0.0) for r in mine) / 1e3
            step = sum(r["obs_ms"] for r in mine)
            out[role] = {"steps": len(mine), "mean_sched_us": statistics.fmean(r.get("sched_us", 0.0) for r in mine),
                         "mean_step_ms": step / len(mine), "overhead_fraction": sched / step}
    return out


def cpu_speed_probe(rounds: int = 3) -> float:
    """Seconds for a fixed workload on every allowed core — GEMMs plus copies of a buffer larger than the
    caches, as a decode step mixes arithmetic and memory traffic (best of `rounds`) — taken with no server
    running, before and after each system (or the whole run, `--interleave`): a shared machine's speed
    drifts. (A single-thread GEMM alone missed a spell in which serving ran at half speed.)"""
    import torch

    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    src = torch.ones(64 * 2**20 // 4)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(50):
            a @ a
        for _ in range(8):
            dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def start_server(system: str, args, profile: str, slo, out: Path) -> BulletServer:
    name = system_slug(system)
    ttft_slo, tpot_slo = server_slo_flags(slo.ttft, slo.tpot)
    launch = [*system_launch(system), "--dtype", args.dtype, "--timeline-dir", str(out / "timeline" / name),
              "--estimator-profile", profile, "--ttft-slo", ttft_slo,
              "--tpot-slo", tpot_slo, "--max-total-tokens", str(args.max_total_tokens),
              "--log-level", "warning"]
    return BulletServer(*launch, log_path=str(out / f"server-{name}.log"))


def run_once(system: str, server: BulletServer, rate: float, rep: int, args, tokenizer_dir: str, dataset: Path,
             slo) -> tuple[dict, list]:
    """One bench_serving run; other prompts at every rate and repeat, the same for every system."""
    print(f"[compare] {system:>13} @ {rate:>4} req/s: run {rep + 1} of {args.repeats}, {args.num_prompts} requests "
          f"(~{args.num_prompts / rate:.0f} s of arrivals)", flush=True)
    return run_bench_serving(server.url, tokenizer_dir, dataset, rate, args.num_prompts,
                             Path(args.out) / f"bench-{system_slug(system)}-{rate}-{rep}.jsonl",
                             args.context_len, args.output_len,
                             seed=point_seed(args.seed, args.rates.index(rate), rep))


def summarize_point(system: str, rate: float, runs: list[tuple[dict, list]], args, slo, seconds: float) -> dict:
    records = [r for _, recs in runs for r in recs]
    duration = sum(result["duration"] for result, _ in runs)
    summary = {**summarize(records, slo, duration), "repeats": args.repeats,
               "runs": [run_counts(outcomes(recs, slo)) for _, recs in runs]}
    summary["attainment_ci"] = attainment_interval(summary["runs"]).as_dict()
    ci = Interval.from_dict(summary["attainment_ci"])
    print(f"[compare] {system:>13} @ {rate:>4} req/s: attainment {ci.percent()}, "
          f"TTFT {summary['mean_ttft_s']:.2f}s (p90 {summary['p90_ttft_s']:.2f}), "
          f"TPOT {summary['mean_tpot_s'] * 1e3:.0f}ms (p90 {summary['p90_tpot_s'] * 1e3:.0f}), "
          f"{summary['output_tok_per_s']:.0f} tok/s [{seconds:.0f}s]", flush=True)
    return summary


def run_rate(system: str, server: BulletServer, rate: float, args, tokenizer_dir: str, dataset: Path, slo) -> dict:
    t0 = time.monotonic()
    runs = [run_once(system, server, rate, rep, args, tokenizer_dir, dataset, slo) for rep in range(args.repeats)]
    return summarize_point(system, rate, runs, args, slo, time.monotonic() - t0)


def finish(per_rate: dict, out: Path, system: str, probe: dict) -> dict:
    return {"per_rate": per_rate, "goodput": goodput(per_rate),
            "scheduler": scheduler_overhead(out / "timeline" / system_slug(system)), "cpu_probe_s": probe}


def run_sequential(args, tokenizer_dir: str, dataset: Path, profile: str, slo, out: Path, save) -> dict:
    """One server at a time through every rate; the speed probe before and after each system."""
    results = {}
    for system in args.systems:
        before = cpu_speed_probe()
        print(f"[compare] starting {system}", flush=True)
        with start_server(system, args, profile, slo, out) as server:
            per_rate = {rate: run_rate(system, server, rate, args, tokenizer_dir, dataset, slo) for rate in args.rates}
        results[system] = finish(per_rate, out, system, {"before": before, "after": cpu_speed_probe()})
        save(results)
    return results


def turns(systems: list[str], point: int) -> list[str]:
    """The order the systems take their turns in at the `point`-th (rate, repeat) of an interleaved
    run: rotated by one at every point, so none always goes first while the machine's speed drifts."""
    k = point % len(systems)
    return systems[k:] + systems[:k]


def run_interleaved(args, tokenizer_dir: str, dataset: Path, profile: str, slo, out: Path, save) -> dict:
    """Every server up at once (the idle ones wait), the systems taking turns at each rate and repeat,
    in an order that rotates (`turns`): a machine whose speed drifts over minutes slows them alike. The
    speed probe runs before the servers start and after they stop."""
    before = cpu_speed_probe()
    per_rate: dict[str, dict] = {s: {} for s in args.systems}
    print(f"[compare] starting {len(args.systems)} servers: {', '.join(args.systems)}", flush=True)
    with all_started({s: start_server(s, args, profile, slo, out) for s in args.systems}) as servers:
        for i, rate in enumerate(args.rates):
            runs: dict[str, list] = {s: [] for s in args.systems}
            seconds: dict[str, float] = {s: 0.0 for s in args.systems}
            for rep in range(args.repeats):
                for system in turns(list(args.systems), i * args.repeats + rep):
                    t0 = time.monotonic()
                    runs[system].append(run_once(system, servers[system], rate, rep, args, tokenizer_dir, dataset, slo))
                    seconds[system] += time.monotonic() - t0
            for system in args.systems:
                per_rate[system][rate] = summarize_point(system, rate, runs[system], args, slo, seconds[system])
    probe = {"before": before, "after": cpu_speed_probe()}
    results = {s: finish(per_rate[s], out, s, probe) for s in args.systems}
    save(results)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS)
    # the int8 engine serves about 3 req/s of fresh requests on 2 AVX-512 cores: rates must reach past that, and
    # a run must last long enough for a queue to build (50 prompts at 6 req/s end before it does)
    ap.add_argument("--rates", nargs="+", type=float, default=[2.0, 3.0, 4.0, 5.0, 6.0])
    ap.add_argument("--num-prompts", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=1, help="runs per rate (seeds seed, seed+1, ...); pooled, "
                    "and the intervals bootstrap over runs, then requests")
    ap.add_argument("--context-len", type=int, default=512, help="drop ShareGPT requests longer than this (prompt+output)")
    ap.add_argument("--output-len", type=int, default=64, help="fixed output length (0: the dataset's)")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", default=None, help="estimator profile (default: cached or measured now)")
    ap.add_argument("--full-profile", action="store_true")
    ap.add_argument("--typical-prompt", type=int, default=256, help="prompt length the SLO rule uses")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first and let the systems take turns at each rate and repeat, in "
                         "an order that rotates (an A/B on a machine whose speed drifts); default: one server at a "
                         "time through every rate")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_comparison"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, dataset, profile, est = prepare(args)
    derived = derive_slo(est, args.typical_prompt)
    print(f"[compare] SLO rule: {derived.rule}", flush=True)

    def save(results: dict) -> None:
        add_intervals(results)
        (out / "results.json").write_text(json.dumps(
            {"slo": derived.as_dict(), "args": vars(args), "profile": profile, "systems": results}, indent=1))

    run = run_interleaved if args.interleave else run_sequential
    results = run(args, tokenizer_dir, dataset, profile, derived.slo, out, save)

    print_comparison(results, args.rates)
    (out / "results.md").write_text(comparison_markdown(results, args.rates, derived.rule))
    print(f"[compare] wrote {out / 'results.json'} and {out / 'results.md'}")
    try:
        for path in plot_comparison(out):
            print(f"[compare] figure: {path}")
    except ImportError as exc:
        print(f"[compare] no figures ({exc})")


if __name__ == "__main__":
    main()
