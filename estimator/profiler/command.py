"""The profiler's command line — `bullet profile`, and `python -m estimator.profiler`, which is what
`ensure_profile` runs in a child process: measure this CPU and the served model for the latency
estimator (Bullet §3.2.4)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from engines.cpuset import parse_id_list
from engines.help_format import DefaultsHelpFormatter
from estimator.profiler.prediction_errors import calibration_fit_rows

NAME = "profile"
HELP = "measure this CPU and the model so the estimator predicts real prefill/decode latencies here"
DESCRIPTION = ("Probes compute and bandwidth per core count, times the model's kernels and end-to-end prefill and "
               "decode steps at every core count, each phase beside the other on the complementary cores, and each "
               "beside the other on the same cores (what a core both workers hold costs); "
               "calibrates the estimator (Bullet Eq. 2, contention D_{p,sl}) and writes the profile that "
               "`bullet launch --policy bullet` loads. --quick takes about a minute, the full plan a few minutes.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="a .gguf file, an HF directory, or a config for --load-format dummy "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (as the server will run)")
    p.add_argument("--quantization", default="none", choices=["none", "w8a8_int8", "fp8"],
                   help="the weights as the server serves them (a quantized GGUF is served w8a8_int8 by default on a CPU; "
                   "fp8: the projections in FP8, as `bullet launch --quantization fp8` serves them)")
    p.add_argument("--cores", default=None, help="CPU cores to profile on, e.g. '0-1' (default: all allowed)")
    p.add_argument("--output", default=None, help="profile JSON to write (default: the cache path the server reads, "
                   "under $BULLET_CACHE_DIR/profiles or ~/.cache/bullet/profiles)")
    p.add_argument("--quick", action="store_true", help="fewer states and repeats: about a minute")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")


def run(args: argparse.Namespace) -> int:
    from engines.weights import ModelLoadError  # deferred: `bullet --help` lists commands without torch
    from estimator.profiler.cache import default_profile_path, estimator_dtype, model_cache_name  # deferred: as above
    from estimator.profiler.measure import measure_profile  # deferred: as above

    try:
        cores = sorted(parse_id_list(args.cores)) if args.cores else None
        dtype = estimator_dtype(args.dtype)
        core_ids = cores or sorted(os.sched_getaffinity(0))
        output = args.output or default_profile_path(model_cache_name(args.model_path, args.load_format), dtype, core_ids,
                                                     args.quantization)
    except (ModelLoadError, ValueError, KeyError) as exc:
        print(f"bullet profile: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    log = (lambda line: print(f"[bullet profile] {line}", file=sys.stderr, flush=True)) if args.no_progress else None
    try:
        profile = measure_profile(args.model_path, args.load_format, dtype, core_ids, args.quick, output,
                                  progress=not args.no_progress, log=log, quantization=args.quantization)
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        print(f"bullet profile: {exc}", file=sys.stderr)
        return 1
    _summary(profile, output, time.monotonic() - start)
    return 0


def _summary(profile, output, seconds: float) -> None:
    hw, contention = profile.hardware, profile.contention
    print(f"profile of {profile.model.name} ({profile.dtype}) on {hw.name}: {output}")
    for k in range(hw.units):
        print(f"  {k + 1} core(s): GEMM {hw.compute_rate(k + 1, profile.dtype) / 1e9:6.1f} GFLOP/s, "
              f"bandwidth {hw.bandwidth(k + 1) / 1e9:5.1f} GB/s")
    for point in contention.decode_bandwidth:
        print(f"  D_p,sl: decode on {point.units} core(s) beside a {point.prefill_tokens}-token prefill keeps "
              f"{100 * point.fraction:.0f} % of its bandwidth")
    for point in contention.prefill_slowdown:
        print(f"  prefill beside a decode batch of {point.decode_batch}: x{point.factor:.3f}")
    for group, mape, worst, n in calibration_fit_rows(profile):
        print(f"  fit on the calibration samples, {group}: MAPE {mape:.1f} % (max {worst:.1f} %, {n} samples)")
    print(f"  measured in {seconds:.0f} s ({profile.provenance.plan} plan)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m estimator.profiler", description=DESCRIPTION,
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C reaches a server's profiling child too: one line, not a traceback
        print("profile: interrupted; nothing was written", file=sys.stderr)
        return 130
