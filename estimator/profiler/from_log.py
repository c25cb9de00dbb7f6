"""An estimator profile rebuilt from what `bullet profile --device cuda` (or `bullet launch --policy
bullet` on a GPU, which measures the same quick plan at start-up) *prints*, for a run whose profile
file did not come back but whose log did.

    python -m estimator.profiler.from_log LOG --gpu "NVIDIA H200" --backend green-ctx \\
        --model llama-3.1-8b --out estimator/reference/data/h200-llama-3.1-8b-green-ctx.json

The printed lines are, in order (`cuda_measure`, `cuda_sweep`):
  "24 SMs: 166 TFLOP/s, 1771 GB/s; 40 SMs: ..."        GEMM and copy rate per share
  "kernels of prefill[512] on 24 SMs: 2.62 ms per layer-set"   a kernel sweep: the sum over kernel classes
  "prefill[2048] x4L on 40 SMs: 21.75 ms"              an end-to-end step (phase sample)
  "decode[32x1024] on 40 SMs beside prefill[512] on 92 SMs: 71.81 ms"    a step beside the other phase
                                                       (logs before 2026-12-02 do not say the other's SMs)

From them the same calibration as the profiler's own (`fit.build_estimator`) is fitted, except that
every alpha is a function of size (interpolated in log size): the phase calibration follows the
printed steps instead of one residual factor per phase and share, because the kernel split below is
assumed. What a log cannot give back, and how it is filled (each written into the profile's notes):
* per-kernel-class times: a sweep prints only their sum, so the sum is divided among the classes in
  proportion to their roofline times on that share (one alpha for every kernel of a sweep; the
  end-to-end steps then calibrate each phase as the profiler's own fit does);
* rates are printed to 3-4 significant digits (the hardware description carries that rounding);
* the shares a backend can grant: taken from `--min-partition` / `--partition-step` (green contexts on
  compute capability 9.0: 8 and 8), the memory size from the GPU's spec-sheet description."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engines.model_config import ModelConfig
from estimator.calibration import PHASES, Sample
from estimator.estimator import Estimator
from estimator.hardware import DTYPE_BYTES
from estimator.ops import ALL_CLASSES, LAYER_TOKEN_CLASSES
from estimator.profile import EstimatorProfile, Provenance
from estimator.profiler.cuda_probe import gpu_hardware
from estimator.profiler.fit import build_estimator


# alpha by size, interpolated in log size, for every kind: a kernel's alpha (one per sweep here) and a
# phase's (through the printed steps) then carry over between the profiled shares; the profiler's
# own piecewise curves are in absolute time, which does not (see `profile_from_log`)
LOG_CURVES = {kind: "log" for kind in (*ALL_CLASSES, *PHASES)}
_RATE = re.compile(r"(\d+) SMs: ([\d.]+) TFLOP/s, ([\d.]+) GB/s")
_SWEEP = re.compile(r"^kernels of (\S+) on (\d+) SMs: ([\d.]+) ms per layer-set$")
_STEP = re.compile(r"^(prefill\[[\d+]+\](?: x\d+L)?|decode\[\d+x\d+\]) on (\d+) SMs(?: beside (\S+)(?: on (\d+) SMs)?)?: ([\d.]+) ms$")
_PREFILL = re.compile(r"^prefill\[([\d+]+)\](?: x(\d+)L)?$")
_DECODE = re.compile(r"^decode\[(\d+)x(\d+)\]$")


def parse_case(label: str) -> dict:
    """A state label as the profiler prints it -> the fields of its phase `Sample`."""
    m = _PREFILL.match(label)
    if m:
        layers = int(m.group(2)) if m.group(2) else None
        return {"kind": "prefill", "prefill_lens": tuple(int(x) for x in m.group(1).split("+")),
                "num_layers": layers, "include_head": layers is None}
    m = _DECODE.match(label)
    if m:
        batch, context = int(m.group(1)), int(m.group(2))
        return {"kind": "decode", "decode_batch": batch, "decode_context": batch * context}
    raise ValueError(f"not a profiler state label: {label!r}")


def co_running(label: str) -> int:
    """What a co-running sample records of the other phase: a prefill's tokens, a decode's batch."""
    case = parse_case(label)
    return sum(case["prefill_lens"]) if case["kind"] == "prefill" else case["decode_batch"]


def parse_log(lines: list[str]) -> tuple[dict[int, float], dict[int, float], list[tuple], list[Sample]]:
    """(FLOP/s per share, bytes/s per share, sweeps as (label, units, seconds), phase samples)."""
    flops: dict[int, float] = {}
    bandwidth: dict[int, float] = {}
    sweeps, phases = [], []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        rates = _RATE.findall(line)
        if rates and "TFLOP/s" in line and " on " not in line:
            for units, tflops, gbs in rates:
                flops[int(units)], bandwidth[int(units)] = float(tflops) * 1e12, float(gbs) * 1e9
            continue
        m = _SWEEP.match(line)
        if m:
            sweeps.append((m.group(1), int(m.group(2)), float(m.group(3)) * 1e-3))
            continue
        m = _STEP.match(line)
        if m:
            label, units, beside, co_units, ms = m.groups()
            phases.append(Sample(units=int(units), seconds=float(ms) * 1e-3, **parse_case(label),
                                 co_running=co_running(beside) if beside else 0, co_units=int(co_units or 0)))
    if not flops or not phases:
        raise ValueError("no profiler output found (rates line and step lines)")
    return flops, bandwidth, sweeps, phases


def padding_in_log(lines: list[str]) -> bool | None:
    """What the profiler's decode-padding probe concluded (`padding.decide_padding`'s line), or None
    where the log has no such line (profilers before it declared decode padded)."""
    for line in lines:
        line = line.strip()
        if line.startswith("decode attention"):
            if "priced as padded" in line:
                return True
            if "summed context" in line:
                return False
    return None


def sweep_samples(raw: Estimator, label: str, units: int, seconds: float) -> list[Sample]:
    """Op samples of one kernel sweep whose classes add up to `seconds`, divided in proportion to
    each class's roofline time of one launch (what the log lost: the split among the classes)."""
    case = parse_case(label)
    decode = case["kind"] == "decode"
    rows = case["decode_batch"] if decode else sum(case["prefill_lens"])
    outputs = case["decode_batch"] if decode else len(case["prefill_lens"])
    shapes = [Sample(kind=k, units=units, seconds=1.0, prefill_lens=(rows,)) for k in LAYER_TOKEN_CLASSES]
    shapes += [Sample(kind="embedding", units=units, seconds=1.0, prefill_lens=(rows,)),
               Sample(kind="final_norm", units=units, seconds=1.0, prefill_lens=(rows,)),
               Sample(kind="lm_head", units=units, seconds=1.0, prefill_lens=(outputs,))]
    if decode:
        shapes.append(Sample(kind="attn_decode", units=units, seconds=1.0, decode_batch=case["decode_batch"],
                             decode_context=case["decode_context"]))
    else:
        shapes.append(Sample(kind="attn_prefill", units=units, seconds=1.0, prefill_lens=case["prefill_lens"]))
    k = raw.kernels
    per_launch = [k.srm(k.sample_op(s), units) / k.sample_op(s).count for s in shapes]
    scale = seconds / sum(per_launch)
    return [s.model_copy(update={"seconds": t * scale}) for s, t in zip(shapes, per_launch)]


def profile_from_log(lines: list[str], model: ModelConfig, gpu: str, total_sms: int, backend: str,
                     min_partition: int, partition_step: int, dtype: str = "bf16",
                     provenance: Provenance | None = None, notes: list[str] | None = None) -> EstimatorProfile:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    flops, bandwidth, sweeps, phases = parse_log(lines)
    hardware = gpu_hardware(gpu, total_sms, dtype, flops, bandwidth, min_partition=min_partition,
                            partition_step=partition_step, backend=backend)
    # without the probe's line, what the profiler that printed the log declared (padded): the rebuilt
    # profile then prices decode as the server that printed it did
    padded = padding_in_log(lines)
    hardware = hardware.model_copy(update={"decode_attention_padded": True if padded is None else padded})
    raw = Estimator(model, hardware, dtype=dtype)
    ops = [s for label, units, seconds in sweeps for s in sweep_samples(raw, label, units, seconds)]
    # The kernel split above is assumed, so the printed steps carry the shape: the phase calibration
    # follows them (alpha by batch size) instead of one residual per share. And every curve is alpha in
    # log size: a curve in absolute time (the profiler's piecewise kernel curves) blended between two
    # profiled shares reads one share's time at another's, which bends predictions between the shares
    # (decode[1] came out 50 % slower on 56 SMs than on 40 or 72).
    estimator = build_estimator(model, hardware, dtype, ops + phases, curves=LOG_CURVES)
    units = sorted(flops)
    filled = [
        f"rebuilt from the profiler's printed log by estimator.profiler.from_log: rates on {units} SMs, "
        f"{len(sweeps)} kernel sweeps, {sum(not s.co_running for s in phases)} solo and "
        f"{sum(bool(s.co_running) for s in phases)} co-running steps",
        "not in the log, filled: each sweep's per-kernel-class times (only their sum is printed) divided in "
        "proportion to the classes' roofline times on that share; rates as printed (3-4 significant digits); "
        f"feasible shares min {min_partition} / step {partition_step} SMs (the backend's granularity, given); "
        "memory size from the spec-sheet description; so the phase calibration follows the printed steps "
        "(alpha by batch size, in log size) rather than one residual factor per phase and share",
    ]
    return EstimatorProfile.from_estimator(estimator, [*(notes or []), *filled], provenance)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path, help="the printed profiler output (other lines are skipped)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="llama-3.1-8b", help="built-in model config the profile was measured on")
    p.add_argument("--gpu", required=True, help='CUDA device name, e.g. "NVIDIA H200"')
    p.add_argument("--sms", type=int, required=True, help="SMs of the whole GPU")
    p.add_argument("--backend", required=True, help="partition backend the shares were measured under")
    p.add_argument("--min-partition", type=int, required=True)
    p.add_argument("--partition-step", type=int, required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--torch-version", default="unknown")
    p.add_argument("--bullet-version", default="unknown")
    p.add_argument("--measured-at", default="unknown", help="when the log was printed")
    p.add_argument("--duration-s", type=float, default=0.0)
    p.add_argument("--note", action="append", default=[], help="provenance to keep (repeatable)")
    args = p.parse_args(argv)
    model = ModelConfig.builtin(args.model)
    provenance = Provenance(model=f"{model.name}-from-log", model_source=None, load_format="dummy", dtype=args.dtype,
                            cores=[], cpu=f"{args.gpu} ({args.sms} SMs) via {args.backend}",
                            bullet_version=args.bullet_version, torch_version=args.torch_version, plan="quick",
                            measured_at=args.measured_at, duration_s=args.duration_s)
    profile = profile_from_log(args.log.read_text().splitlines(), model, args.gpu, args.sms, args.backend,
                               args.min_partition, args.partition_step, args.dtype, provenance, args.note)
    profile.write(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
