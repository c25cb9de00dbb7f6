"""Estimator profiles built from public A100 measurements, and their validation.

Calibration uses two samples per kernel: 128 tokens (the bandwidth-bound side of a GEMM) and 4096
tokens (the compute-bound side), both chosen before looking at the errors, the same for every kernel
and both models. Everything else in the measured files is held out for validation.

    python -m estimator.reference.profiles [--shared-data DIR]
    python -m estimator.reference.profiles --h200

regenerate the shipped profile `estimator/reference/data/a100-llama-3-8b.json` from `shared/data`, and
the H200 one rebuilt from the first GPU run's printed profile kept beside it (`h200_profile`).

The H200 profile the simulator uses (`H200_PROFILE`) is the one `bullet profile --device cuda` wrote
on a later run (its notes say which); the rebuilt one (`H200_LOG_PROFILE`) stays as the check of
`estimator.profiler.from_log`."""

from __future__ import annotations

import argparse
from pathlib import Path

from engines.model_config import ModelConfig
from estimator.calibration import Calibration, Sample
from estimator.estimator import Estimator
from estimator.hardware import HardwareSpec
from estimator.profile import EstimatorProfile, Provenance
from estimator.profiler.from_log import profile_from_log
from estimator.reference.data import (
    A100_LLAMA3_8B_DECODE_ATTENTION_MS,
    A100_LLAMA3_8B_DECODE_MS,
    A100_LLAMA3_8B_LAYERS,
    A100_LLAMA3_8B_PREFILL_ATTENTION_MS,
    VIDUR_COLUMNS,
    VIDUR_LAYER_COLUMNS,
    load_vidur_ops,
    vidur_csv_path,
    vidur_model_config,
)

SAMPLE_TOKENS = (128, 4096)
PREFILL_ATTENTION_SAMPLES = (1024, 4096)  # prompt lengths, batch 1
DECODE_ATTENTION_SAMPLES = ((1, 1024), (128, 1024))  # (batch, context per request)
# End-to-end decode steps (numbers.md, linear + attention, no LM head) as phase samples: the kernel
# samples start at 128 rows, below which GEMMs are weight-bound at a different efficiency.
DECODE_PHASE_SAMPLES = ((1, 1024), (128, 1024))
SHIPPED_PROFILE = Path(__file__).parent / "data" / "a100-llama-3-8b.json"
# Measured on a GPU by `bullet profile --device cuda --quick` (gpu_check's profile step; decode steps
# as CUDA-graph replays, decode padding and hybrid steps measured): the simulator's H200
H200_PROFILE = Path(__file__).parent / "data" / "h200-llama-3.1-8b-green-ctx-profiled.json"
# The H200 of the first GPU run, rebuilt from its printed profile by `estimator.profiler.from_log`
# (the log beside it; its notes say what was filled in): decode timed eagerly, no hybrid steps
H200_LOG_PROFILE = Path(__file__).parent / "data" / "h200-llama-3.1-8b-green-ctx.json"
H200_LOG = H200_LOG_PROFILE.with_suffix(".log")
H200_PROVENANCE = (
    "first GPU run: NVIDIA H200 (132 SMs, 143771 MiB), driver 580.159.04 / CUDA 13.0, torch 2.11.0+cu130, "
    "Python 3.12.3; dummy Llama-3.1-8B weights in bf16; partition backend green-ctx; MPS daemon on; measured "
    "2026-11-26 by `bullet launch --policy bullet` at start-up (the quick GPU plan); decode steps timed eagerly, "
    "not as the CUDA-graph replays the server then ran")
DEFAULT_SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def vidur_samples(measured: dict[str, dict[int, float]], units: int, tokens=SAMPLE_TOKENS) -> list[Sample]:
    return [Sample(kind=kind, units=units, seconds=by_tokens[t], prefill_lens=(t,))
            for kind, by_tokens in measured.items() for t in tokens]


def a100_attention_samples(units: int = 108) -> list[Sample]:
    """Per-layer FlashInfer attention latencies (numbers.md sums over 32 layers, divided back)."""
    per_layer = 1e-3 / A100_LLAMA3_8B_LAYERS
    prefill = [Sample(kind="attn_prefill", units=units, prefill_lens=(s,),
                      seconds=A100_LLAMA3_8B_PREFILL_ATTENTION_MS[s] * per_layer) for s in PREFILL_ATTENTION_SAMPLES]
    decode = [Sample(kind="attn_decode", units=units, decode_batch=b, decode_context=b * c,
                     seconds=A100_LLAMA3_8B_DECODE_ATTENTION_MS[(b, c)] * per_layer) for b, c in DECODE_ATTENTION_SAMPLES]
    return prefill + decode


def a100_decode_phase_samples(units: int = 108) -> list[Sample]:
    return [Sample(kind="decode", units=units, decode_batch=b, decode_context=b * c, include_head=False,
                   seconds=A100_LLAMA3_8B_DECODE_MS[(b, c)] * 1e-3) for b, c in DECODE_PHASE_SAMPLES]


def vidur_estimator(csv_path: Path, hardware: HardwareSpec | None = None, tokens=SAMPLE_TOKENS,
                    model: ModelConfig | None = None, with_attention: bool = False) -> Estimator:
    hardware = hardware or HardwareSpec.builtin("a100")
    measured = load_vidur_ops(csv_path)
    samples = vidur_samples(measured, hardware.units, tokens)
    if with_attention:
        samples += a100_attention_samples(hardware.units)
    return Estimator(model or vidur_model_config(csv_path), hardware, Calibration(samples=samples))


def a100_llama3_8b_profile(shared_data: Path) -> EstimatorProfile:
    csv_path = vidur_csv_path(shared_data, "llama-3-8b")
    estimator = vidur_estimator(csv_path, model=ModelConfig.builtin("llama-3.1-8b"), with_attention=True)
    estimator.calibration.samples.extend(a100_decode_phase_samples())
    estimator.refit()
    return EstimatorProfile.from_estimator(estimator, notes=[
        f"kernel samples: Vidur A100 operator profile of Meta-Llama-3-8B (MIT), tokens {list(SAMPLE_TOKENS)}",
        "attention samples: FlashInfer A100 latencies summed in shared/reference/numbers.md, per layer",
        f"decode phase samples: numbers.md decode steps {list(DECODE_PHASE_SAMPLES)} (batch, context)",
        "no contention table: not measured on a GPU yet",
    ])


def h200_profile() -> EstimatorProfile:
    """The H200 profile, rebuilt from the profiler output its run printed (`estimator.profiler.from_log`)."""
    provenance = Provenance(model="llama-3.1-8b-dummy", load_format="dummy", dtype="bf16", cores=[],
                            cpu="NVIDIA H200 (132 SMs) via green-ctx", bullet_version="0.2.0",
                            torch_version="2.11.0+cu130", plan="quick", measured_at="2026-11-26 04:42:14",
                            duration_s=57.1)
    return profile_from_log(H200_LOG.read_text().splitlines(), ModelConfig.builtin("llama-3.1-8b"), "NVIDIA H200",
                            132, "green-ctx", min_partition=8, partition_step=8, dtype="bf16",
                            provenance=provenance, notes=[H200_PROVENANCE])


# ---- validation ---------------------------------------------------------------------------------

def vidur_errors(estimator: Estimator, measured: dict[str, dict[int, float]], units: int,
                 min_tokens: int = 64) -> dict[str, float]:
    """MAPE (%) of each kernel class and of the layer's linear total (the Vidur columns but the
    embedding, each once) over every profiled token count >= min_tokens."""
    kernels = estimator.kernels
    errors: dict[str, list[float]] = {}
    totals: dict[int, list[float]] = {}
    for kind, by_tokens in measured.items():
        for tokens, seconds in by_tokens.items():
            if tokens < min_tokens:
                continue
            op = kernels.sample_op(Sample(kind=kind, units=units, seconds=seconds, prefill_lens=(tokens,)))
            predicted = kernels.op_time(op, units) / op.count
            errors.setdefault(kind, []).append(abs(predicted - seconds) / seconds)
            if kind in {VIDUR_COLUMNS[c] for c in VIDUR_LAYER_COLUMNS}:
                pair = totals.setdefault(tokens, [0.0, 0.0])
                pair[0] += predicted
                pair[1] += seconds
    result = {kind: 100.0 * sum(e) / len(e) for kind, e in errors.items()}
    result["linear_total"] = 100.0 * sum(abs(p - m) / m for p, m in totals.values()) / len(totals)
    return result


def attention_errors(estimator: Estimator, units: int = 108) -> list[tuple[str, float, float]]:
    """(state, measured ms, predicted ms) of every numbers.md attention point, 32 layers."""
    rows = []
    k, layers = estimator.kernels, A100_LLAMA3_8B_LAYERS
    for s, ms in A100_LLAMA3_8B_PREFILL_ATTENTION_MS.items():
        rows.append((f"prefill {s}", ms, 1e3 * layers * k.prefill_attention_time([s], s, units)))
    for (b, c), ms in A100_LLAMA3_8B_DECODE_ATTENTION_MS.items():
        rows.append((f"decode {b}x{c}", ms, 1e3 * layers * k.decode_attention_time(b, b * c, units)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared-data", type=Path, default=DEFAULT_SHARED_DATA)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--h200", action="store_true", help="the first run's H200 profile, from its log")
    args = parser.parse_args()
    if args.h200:
        args.out = args.out or H200_LOG_PROFILE
        h200_profile().write(args.out)
    else:
        args.out = args.out or SHIPPED_PROFILE
        a100_llama3_8b_profile(args.shared_data).write(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
