"""The estimator against the paper and against measurements:
1. Bullet Table 2 (wave-quantization idle %, Llama-3.1-8B prefill on A100) from the tile model;
2. calibration accuracy: two samples per kernel class (128 and 4096 tokens) predicting every other
   token count of the Vidur A100 profiles of Llama-3-8B and Llama-2-7B (MAPE per kernel and for the
   layer's linear total, tokens >= 64 and all), plus the held-out numbers.md attention and
   end-to-end points with the shipped A100 profile;
3. prediction cost: mean and P99 per call of `decode_time` / `prefill_time` for realistic states;
4. the local CPU as the probe measures it (quick sizes; --skip-cpu-probe to leave it out).

    python artifact/benchmarks/bench_estimator.py [--calls 100000] [--shared-data ../shared/data]

Writes artifact/results/estimator.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engines.model_config import ModelConfig  # noqa: E402
from estimator.profile import load_estimator
from estimator.profiler.cpu_probe import ProbeSizes, probe_cpu
from estimator.reference.data import (  # noqa: E402
    A100_LLAMA3_8B_DECODE_MS,
    A100_LLAMA3_8B_PREFILL_MS,
    llama2_7b,
    load_vidur_ops,
    vidur_csv_path,
)
from estimator.reference.profiles import (  # noqa: E402
    DEFAULT_SHARED_DATA,
    SAMPLE_TOKENS,
    SHIPPED_PROFILE,
    attention_errors,
    vidur_errors,
    vidur_estimator,
)
from estimator.waves import TABLE2_COLUMNS, TABLE2_PAPER, prefill_idle_table  # noqa: E402

RESULTS = Path(os.environ.get("BULLET_RESULTS_DIR", ROOT / "artifact" / "results"))


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
               "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(json.dumps({"machine": machine, **payload}, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*[f"{row[c]:.2f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns])
    Console(width=max(120, Console().width)).print(table)


def table2() -> list[dict]:
    rows = []
    for row in prefill_idle_table(ModelConfig.builtin("llama-3.1-8b"), units=108):
        ours, paper = row.as_tuple(), TABLE2_PAPER[row.seq_len]
        entry = {"seq_len": row.seq_len}
        for name, value, ref in zip(TABLE2_COLUMNS, ours, paper):
            entry[name] = round(value, 2)
            entry[f"{name}_paper"] = ref
            entry[f"{name}_diff"] = round(value - ref, 2)
        rows.append(entry)
    return rows


def calibration_accuracy(shared_data: Path) -> dict:
    models = {"llama-3-8b": ModelConfig.builtin("llama-3.1-8b"), "llama-2-7b": llama2_7b()}
    result = {}
    for name, model in models.items():
        path = vidur_csv_path(shared_data, name)
        measured = load_vidur_ops(path)
        estimator = vidur_estimator(path, model=model)
        result[name] = {
            "tokens_ge_64": vidur_errors(estimator, measured, 108, min_tokens=64),
            "all_tokens": vidur_errors(estimator, measured, 108, min_tokens=1),
            "token_counts": len(next(iter(measured.values()))),
        }
    return result


def held_out_points() -> dict:
    shipped = load_estimator(SHIPPED_PROFILE)
    attention = [{"state": s, "measured_ms": m, "predicted_ms": round(p, 3), "error_pct": round(100 * (p - m) / m, 1)}
                 for s, m, p in attention_errors(shipped)]
    end_to_end = []
    for tokens, ms in A100_LLAMA3_8B_PREFILL_MS.items():
        p = 1e3 * shipped.prefill_time([tokens], 108, include_head=False)
        end_to_end.append({"state": f"prefill {tokens}", "measured_ms": ms, "predicted_ms": round(p, 2),
                           "error_pct": round(100 * (p - ms) / ms, 1)})
    for (batch, ctx), ms in A100_LLAMA3_8B_DECODE_MS.items():
        p = 1e3 * shipped.decode_time(batch, batch * ctx, 108, include_head=False)
        end_to_end.append({"state": f"decode {batch}x{ctx}", "measured_ms": ms, "predicted_ms": round(p, 2),
                           "error_pct": round(100 * (p - ms) / ms, 1)})
    return {"attention": attention, "end_to_end": end_to_end,
            "samples_used": "attention: prefill 1024, 4096; decode 1x1024, 128x1024. "
                            "end to end: decode 1x1024 and 128x1024 are phase samples"}


def _stats(samples_ns: list[int], timer_ns: float) -> dict:
    s = sorted(x - timer_ns for x in samples_ns)
    return {"mean_us": round(statistics.fmean(s) / 1e3, 3), "p50_us": round(s[len(s) // 2] / 1e3, 3),
            "p99_us": round(s[int(len(s) * 0.99)] / 1e3, 3), "calls": len(s)}


def prediction_cost(calls: int, seed: int = 0) -> dict:
    """Per-call cost, timer overhead subtracted. Units vary every call (the scheduler's search);
    'cold' draws a new prompt length every call, so nothing is cached for it."""
    est = load_estimator(SHIPPED_PROFILE)
    rng = random.Random(seed)
    contexts = [rng.randint(200, 4000) for _ in range(64)]
    summary = (64, sum(contexts))
    prompts = [rng.randint(100, 3000) for _ in range(4)]
    units = [rng.randrange(2, 109, 2) for _ in range(calls)]
    new_lengths = [rng.randint(1, 16384) for _ in range(calls)]
    clock = time.perf_counter_ns
    timer = statistics.fmean(-(clock() - clock()) for _ in range(10000))
    cases = {
        "decode batch 64, per-request contexts (list)": lambda u, i: est.decode_time_for(contexts, u),
        "decode batch 64, (batch, total context)": lambda u, i: est.decode_time(*summary, u),
        "decode batch 64 beside a 2048-token prefill": lambda u, i: est.decode_time(*summary, u, co_prefill_tokens=2048),
        "prefill 4 requests, 4 layers": lambda u, i: est.prefill_time(prompts, u, num_layers=4, include_head=False),
        "prefill 4 requests, whole model": lambda u, i: est.prefill_time(prompts, u),
        "prefill, new length every call (cold)": lambda u, i: est.prefill_time([new_lengths[i]], u),
    }
    result = {}
    for name, fn in cases.items():
        for i in range(1000):
            fn(units[i], i)
        samples = []
        for i, u in enumerate(units):
            t0 = clock()
            fn(u, i)
            samples.append(clock() - t0)
        result[name] = _stats(samples, timer)
    result["timer_overhead_us"] = round(timer / 1e3, 3)
    return result


def cpu_probe() -> dict:
    spec = probe_cpu(sizes=ProbeSizes.quick(), progress=False)
    return spec.model_dump(mode="json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--shared-data", type=Path, default=DEFAULT_SHARED_DATA)
    parser.add_argument("--skip-cpu-probe", action="store_true")
    args = parser.parse_args()

    payload: dict = {"table2": table2()}
    print_table([{"seq_len": r["seq_len"], **{c: f"{r[c]:.2f} ({r[c + '_paper']})" for c in TABLE2_COLUMNS}}
                 for r in payload["table2"]], ["seq_len", *TABLE2_COLUMNS],
                "Bullet Table 2: SM idle % from wave quantization, ours (paper)")

    if args.shared_data.is_dir():
        payload["calibration"] = calibration_accuracy(args.shared_data)
        payload["calibration_samples_tokens"] = list(SAMPLE_TOKENS)
        kinds = list(payload["calibration"]["llama-3-8b"]["tokens_ge_64"])
        rows = [{"kernel": k, **{f"{m} {r}": payload["calibration"][m][r][k]
                                 for m in payload["calibration"] for r in ("tokens_ge_64", "all_tokens")}}
                for k in kinds]
        print_table(rows, ["kernel"] + [c for c in rows[0] if c != "kernel"],
                    f"Calibration MAPE %, 2 samples per kernel ({SAMPLE_TOKENS[0]} and {SAMPLE_TOKENS[1]} tokens)")
    else:
        print(f"(no shared data at {args.shared_data}: calibration accuracy skipped)")

    payload["held_out"] = held_out_points()
    print_table(payload["held_out"]["attention"] + payload["held_out"]["end_to_end"],
                ["state", "measured_ms", "predicted_ms", "error_pct"],
                "numbers.md points (32 layers, A100, shipped profile)")

    payload["prediction_cost"] = prediction_cost(args.calls)
    cost_rows = [{"call": k, **v} for k, v in payload["prediction_cost"].items() if isinstance(v, dict)]
    print_table(cost_rows, ["call", "mean_us", "p50_us", "p99_us", "calls"],
                f"Prediction cost per call (timer overhead {payload['prediction_cost']['timer_overhead_us']} us "
                "subtracted; paper: 10.2 us mean, 25.8 us P99)")

    if not args.skip_cpu_probe:
        payload["cpu"] = cpu_probe()
        cpu = payload["cpu"]
        print(f"local CPU: {cpu['units']} cores, GEMM fp32 {[round(x / 1e9, 1) for x in cpu['measured_flops']['fp32']]} "
              f"GFLOP/s, matrix-vector {[round(x / 1e9, 1) for x in cpu['measured_bandwidth']]} GB/s, "
              f"N_d = {cpu['bandwidth_inflection']} cores")
    print(f"wrote {write_results('estimator', payload)}")


if __name__ == "__main__":
    main()
