"""`bullet simulate`: serve a workload on a *simulated* GPU (virtual time, latencies from the
estimator), with the same scheduling policies the real runtime uses."""

from __future__ import annotations

import argparse
import json
import sys

from bullet.sim import Simulation
from bullet.sim.config import SimConfig
from bullet.sim.report import result_dict, summary_lines
from bullet.types.roles import Role
from bullet.workloads.traces import build_workload
from estimator.interconnect import LINKS

NAME = "simulate"
HELP = "SIMULATED run: a workload on a virtual GPU (A100/H100...) with the real scheduling policies"
DESCRIPTION = (
    "Discrete-event simulation, NOT a measurement: the real Bullet / static / naive policies and the real "
    "chunked-prefill scheduler run unchanged on virtual time, and every step is charged the latency the "
    "estimator predicts for it (calibrated A100 profile, or the device a measured --estimator-profile describes; "
    "other built-in devices, and models of another shape than the A100 profile's Llama-8B, are roofline-only), "
    "with an assumed "
    "contention model and seeded noise. Use it to study policies at GPU scale on a machine without a GPU.")

# Bullet Table 4: (normalized TTFT, TPOT) per workload; Azure-Conv takes ShareGPT's (both are chat)
TABLE4_SLOS = {"sharegpt": ("3.0ms/token", "150ms"), "azure-code": ("1.5ms/token", "200ms"),
               "arxiv": ("1.5ms/token", "175ms"), "azure-conv": ("3.0ms/token", "150ms"),
               "sharegpt-uncapped": ("3.0ms/token", "150ms")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    p.add_argument("--model", default=None, help="built-in model config (default: the profile's, else llama-3.1-8b)")
    p.add_argument("--hardware", default=None,
                   help="a100 (calibrated from public kernel measurements) | h200 (the H200 measured by `bullet profile "
                        "--device cuda`, shipped: estimator/reference/data/h200-llama-3.1-8b-green-ctx-profiled.json, "
                        "for llama-3.1-8b; other models on it get its spec sheet) | h100 | h20 (spec sheets, "
                        "uncalibrated); default: the --estimator-profile's device, else a100")
    p.add_argument("--quantization", default=d.quantization, choices=["none", "fp8"],
                   help="the weights' storage: none (bf16) | fp8 (the projections a byte each, as an FP8 checkpoint "
                        "stores them; GEMMs priced at bf16's rate; built-in --hardware only)")
    p.add_argument("--tp-size", type=positive_int, default=d.tp_size,
                   help="tensor parallelism (SGLang's flag): the model split over this many devices of --hardware, "
                        "both workers on every device with the same SM split; each device is priced as one rank "
                        "(its shard's kernels, weights and KV cache, two all-reduces per layer over --tp-link, not "
                        "overlapped with compute). Built-in --hardware only, roofline-priced")
    p.add_argument("--tp-link", default=None, choices=sorted(LINKS),
                   help="the link between the devices under --tp-size: nvlink3 (A100 SXM4) | nvlink4 "
                        "(H100/H200/H20) | pcie4 | bullet-a100 (the 20 GB/s of the Bullet paper's 8xA100 server, "
                        "its Table 3); spec-sheet rates with assumed efficiency and latency "
                        "(estimator/interconnect.py); unset: the --hardware's own (NVLink)")
    p.add_argument("--tp-link-busbw-gbps", type=float, default=None,
                   help="the link's all-reduce bus bandwidth in GB/s (NCCL-tests' busbw, e.g. as all_reduce_perf "
                        "measured it on your server), in place of --tp-link's")
    p.add_argument("--tp-link-latency-us", type=float, default=None,
                   help="the link's time per collective in microseconds, in place of --tp-link's")
    p.add_argument("--estimator-profile", default=None,
                   help="simulate the device this profile measured (`bullet profile`, e.g. --device cuda: its "
                        "SM-share rates, kernel and step times, contention); shipped: "
                        "estimator/reference/data/h200-llama-3.1-8b-green-ctx-profiled.json (an H200 measured by bullet profile "
                        "--device cuda; default: the A100 one)")
    p.add_argument("--policy", default=d.policy, help="bullet | static[:<prefill units>] | naive | chunked:<token budget>")
    p.add_argument("--workload", default="sharegpt", choices=sorted(TABLE4_SLOS))
    p.add_argument("--arrivals", default="poisson", choices=["poisson", "trace"],
                   help="Poisson at --rate, or the Azure trace's own timestamps (scaled to --rate if given)")
    p.add_argument("--rate", type=float, default=None, help="requests per second (default 5 for Poisson)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (the run drains after)")
    p.add_argument("--ttft-slo", default=None, help="TTFT target (default: Bullet Table 4 for the workload)")
    p.add_argument("--tpot-slo", default=None, help="TPOT target (default: Bullet Table 4 for the workload)")
    p.add_argument("--tbt-slo", default=None,
                   help="P99 time-between-tokens target per request, e.g. 300ms (default: not judged); "
                        "attainment then needs it as well as TTFT and TPOT")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and latency noise")
    p.add_argument("--noise", type=float, default=d.noise, help="step latency x U[1-n, 1+n]")
    p.add_argument("--no-contention", action="store_true", help="charge no memory contention between the workers")
    p.add_argument("--contention-floor", type=float, default=d.contention_floor,
                   help="assumed decode bandwidth fraction beside a compute-bound full-device prefill")
    p.add_argument("--prefill-slowdown", type=float, default=d.prefill_slowdown,
                   help="assumed prefill slowdown beside decode")
    p.add_argument("--blind-policy", action="store_true",
                   help="the policies' estimators get no contention table (as with an unprofiled device)")
    p.add_argument("--overlap-share", default=d.overlap_share, choices=["auto", "demand", "even", "time-sliced", "measured"],
                   help="how units both workers hold are divided between them: demand (a GPU's block scheduler, "
                        "by the thread blocks each keeps in flight, assumed free), even, time-sliced (a CPU's OS "
                        "scheduler: a step of several threads on cores the other's threads hold runs "
                        "--oversubscribed-slowdown times slower), measured (each phase slowed by the factor its "
                        "profile measured on every unit beside the other on every unit); auto (default): "
                        "time-sliced on a CPU profile, measured on a GPU profile that has it, else demand")
    p.add_argument("--oversubscribed-slowdown", type=float, default=None,
                   help="how many times its time alone a step takes on units both workers hold. Time-sliced (a "
                        "CPU): a step of several threads on cores the other's threads hold (default: the profile's own "
                        "measurement, else 7.4, measured served on a 2-core AMD EPYC; `python -m artifact.served_corun "
                        "--oversubscribed` measures a served run's). On a GPU: both phases on SMs both hold, in place "
                        "of the profile's measured factors or the demand split (a what-if)")
    p.add_argument("--shared-slowdown", nargs="+", default=[], metavar="PHASE=FACTOR", type=phase_factor,
                   help="a what-if by phase for a GPU: a prefill or decode step on SMs both workers hold takes FACTOR "
                        "times its time alone, in place of that phase's factor from the profile (or from "
                        "--oversubscribed-slowdown), e.g. `--shared-slowdown prefill=1.2 decode=2` (a compute-bound "
                        "prefill barely slowed, a memory-bound decode halved). Prices the shared SMs by phase "
                        "(--overlap-share measured, which auto picks once both phases have a factor)")
    p.add_argument("--slo-percentile", type=float, default=d.slo_percentile,
                   help="bullet: the percentile of its requests' predicted TTFT (against target) and TPOT each "
                        "scheduler keeps within its SLO (default 0.9, the paper's P90; as `bullet launch`)")
    p.add_argument("--layers-per-step", type=int, default=d.prefill_layers_per_step)
    p.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests, help="chunked baseline's cap")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool size (default: memory minus weights)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (beats --kv-memory-gb)")
    p.add_argument("--step-overhead-ms", type=float, default=None,
                   help="charged after every step's kernels (default: 0 with a measured profile, whose step "
                        "times include it, else 0.5)")
    p.add_argument("--step-time-scale", type=float, default=d.step_time_scale,
                   help="every step's kernels take this many times the device model's latency (a served "
                        "machine slower than its profile: `python -m artifact.served_steps` measures it)")
    p.add_argument("--corun-scale", type=float, default=d.corun_scale,
                   help="a step running beside the other worker's takes this many times what the device model "
                        "prices for it (1: as profiled): a what-if for partitions that hold each other back more "
                        "(> 1) or less (< 1) than the profile measured; every system whose two workers run at "
                        "once pays it (bullet, static, naive and the ablations), chunked and sglang never co-run")
    p.add_argument("--role-step-time", action="append", default=[], metavar="ROLE=SCALE[,OVERHEAD_MS]",
                   type=role_step_time,
                   help="for one worker role (prefill, decode, unified): its steps' time scale and the overhead "
                        "after each, in place of --step-time-scale/--step-overhead-ms (repeat per role; "
                        "`python -m artifact.served_steps --by-role` fits them to a served run)")
    p.add_argument("--attention-setup-ms", type=milliseconds, default=d.attention_setup_s * 1e3,
                   help="set-up a worker pays the first time its prompt attention meets a fresh sequence of a new "
                        "length, before that step's kernels (a per-shape kernel plan: 50-70 ms measured on an H200 "
                        "whose SDPA went to cuDNN; `python -m artifact.served_steps` measures it). Default 0")
    p.add_argument("--handoff-delay-ms", type=float, default=d.handoff_delay_s * 1e3)
    p.add_argument("--stop-below", type=float, default=None, metavar="ATTAINMENT",
                   help="stop early once this SLO attainment is out of reach")
    p.add_argument("--ledger", action="store_true",
                   help="account what dividing the units gained and cost, in whole-device seconds (co-run gain, "
                        "solo loss, contention, idle units; see bullet/sim/ledger.py)")
    p.add_argument("--data-dir", default=None, help="directory holding traces/ (default: BULLET_DATA_DIR, else the traces installed with bullet)")
    p.add_argument("--timeline-dir", default=None, help="write every scheduling decision to <dir>/<role>.jsonl")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH (or stdout without PATH)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


ROLES = tuple(r.value for r in Role)


def positive_int(text: str) -> int:
    """An integer >= 1 (a device count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def milliseconds(text: str) -> float:
    """A duration in ms, >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected milliseconds >= 0")
    return value


def phase_factor(text: str) -> tuple[str, float]:
    """`decode=2` -> ("decode", 2.0): a phase and its factor (>= 1) on shared units."""
    phase, _, rest = text.partition("=")
    try:
        factor = float(rest)
    except ValueError:
        factor = float("nan")
    if phase not in ("prefill", "decode") or not factor >= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PHASE=FACTOR with PHASE prefill or decode "
                                         "and FACTOR >= 1")
    return phase, factor


def role_step_time(text: str) -> tuple[str, tuple[float, float]]:
    """`prefill=1.5,7.4` -> ("prefill", (1.5, 0.0074)); the overhead (ms) may be left out (0)."""
    role, _, rest = text.partition("=")
    try:
        scale, *overhead = (float(x) for x in rest.split(","))
    except ValueError:
        scale, overhead = None, []
    if role not in ROLES or scale is None or len(overhead) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROLE=SCALE[,OVERHEAD_MS] with ROLE one of {', '.join(ROLES)}")
    return role, (scale, overhead[0] / 1e3 if overhead else 0.0)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    ttft, tpot = TABLE4_SLOS[args.workload]
    return SimConfig(
        policy=args.policy, model=args.model, hardware=args.hardware, estimator_profile=args.estimator_profile,
        ttft_slo=args.ttft_slo or ttft, tpot_slo=args.tpot_slo or tpot, tbt_slo=args.tbt_slo,
        prefill_layers_per_step=args.layers_per_step, max_prefill_tokens=args.max_prefill_tokens,
        slo_percentile=args.slo_percentile,
        max_running_requests=args.max_running_requests, page_size=args.page_size, kv_memory_gb=args.kv_memory_gb,
        quantization=args.quantization, tp_size=args.tp_size, tp_link=args.tp_link,
        tp_link_busbw_gbps=args.tp_link_busbw_gbps, tp_link_latency_us=args.tp_link_latency_us,
        max_total_tokens=args.max_total_tokens,
        step_overhead_s=None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3,
        step_time_scale=args.step_time_scale, role_step_times=dict(args.role_step_time),
        corun_scale=args.corun_scale, oversubscribed_slowdown=args.oversubscribed_slowdown,
        shared_slowdown=dict(args.shared_slowdown),
        attention_setup_s=args.attention_setup_ms / 1e3,
        noise=args.noise, contention_model=not args.no_contention, contention_floor=args.contention_floor,
        prefill_slowdown=args.prefill_slowdown, policy_contention=not args.blind_policy,
        overlap_share=args.overlap_share, handoff_delay_s=args.handoff_delay_ms / 1e3, seed=args.seed,
        timeline_dir=args.timeline_dir, stop_below_attainment=args.stop_below, ledger=args.ledger)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    rate = args.rate if args.rate is not None or args.arrivals == "trace" else 5.0
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    try:
        config = config_from_args(args)
        requests = build_workload(args.workload, rate, args.duration, args.seed, args.arrivals, args.data_dir)
        sim = Simulation(config, requests)
    except (ValueError, FileNotFoundError, ValidationError) as exc:
        print(f"bullet simulate: {exc}", file=sys.stderr)
        return 2
    devices = f"{config.tp_size}x " if config.tp_size > 1 else ""
    log(f"[sim] SIMULATED {sim.device_estimator.model.name} on {devices}virtual {sim.device_estimator.hardware.name}, "
        f"policy {config.policy}, "
        f"{args.workload} at {rate if rate else 'trace'} req/s for {args.duration:g}s: {len(requests)} requests")

    def progress(info: dict) -> None:
        log(f"[sim] t={info['t']:7.1f}s of {info['horizon']:.0f}s  finished {info['finished']}/{info['requests']}  "
            f"wall {info['wall_s']:.1f}s")

    result = sim.run(progress=None if args.quiet else progress, progress_every_s=max(10.0, args.duration / 10))
    data = result_dict(result, sim, workload=args.workload, rate=rate, arrivals=args.arrivals)
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        for line in summary_lines(data):
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=2)
            print(f"results: {args.json}")
    return 0
