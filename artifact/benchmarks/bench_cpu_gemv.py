"""A decode step's projections on the CPU: torch's GEMM against the few-row kernel (`engines.model.cpu_gemv`).

  python -m artifact.benchmarks.bench_cpu_gemv [--dtype bfloat16 float32] [--threads 1 2] [--rows 1 4 8 16 32]

Two parts, each timing both sides in the same rounds (alternating, medians; one thread: the thread's
CPU time, several: wall time):

* **projections**: x [rows, K] @ W^T for the weight shapes of SmolLM2-135M (fused QKV, o, fused
  gate/up, down, the tied LM head) and of one Llama-3.1-8B layer (QKV, o, gate/up, down), random
  values, through `torch.nn.functional.linear` and through `cpu_gemv.linear`; also the weights' bytes
  over the time (GB/s).
* **decode steps**: the embedded SmolLM2 GGUF dequantized to bfloat16, one decode step at batch 1, 2 and
  8 over 300-token contexts through the runner (`ModelRunner.forward`, what a worker's step costs),
  as the engine runs it (`float_linear`: bfloat16 batches of at most `cpu_gemv.LINEAR_ROWS` rows in the
  kernel, `--linear-rows` sets another limit; on a CPU with AMX, up to `layers.WEIGHTS_FIRST_ROWS` rows
  weights-first), with the weights-first form off ("row-wise": `layers.WEIGHTS_FIRST_ROWS = 0`), with
  both off (`cpu_gemv.LINEAR_ROWS = 0` too: torch's GEMM for every projection), and in float32.

`--cold-mb N` cycles each projection through copies of its weight, N MiB in all, so every call reads
its weight from memory, as a model bigger than the last-level cache does (default: one copy, which
the cache keeps). `--against PATH` also times another build of the kernel in the same rounds: a
source tree (or its `engines/_cpu_gemv*.so`) built with `python setup.py build_ext --inplace`, e.g.

  git worktree add /tmp/before <commit> && (cd /tmp/before && python setup.py build_ext --inplace)
  python -m artifact.benchmarks.bench_cpu_gemv --against /tmp/before --cold-mb 1024

Writes <results>/cpu_gemv.json (with the CPU's vector flags, torch's version) and cpu_gemv.md
(results dir: BULLET_RESULTS_DIR or artifact/results)."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import torch

from artifact.benchmarks.common import kernel_build, load_kernel_build
from engines.kv_pool import KVPool
from engines.model import cpu_gemv, layers
from engines.model.build import build_model
from engines.runner import ModelRunner, SeqChunk
from engines.weights import load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SHAPES = {  # name -> (N, K): out x in features
    "smollm2 qkv": (576 + 2 * 192, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (2 * 1536, 576),
    "smollm2 down": (576, 1536), "smollm2 lm head": (49152, 576),
    "llama8b qkv": (4096 + 2 * 1024, 4096), "llama8b o": (4096, 4096), "llama8b gate_up": (2 * 14336, 4096),
    "llama8b down": (4096, 14336),
}
PAGE_SIZE, CONTEXT = 16, 300


def _clock():
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, rounds alternating their order (after one warm-up call each)."""
    clock, samples = _clock(), {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = clock()
            fns[name]()
            samples[name].append(clock() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def projections(dtype_name: str, shapes: list[str], rows_list: list[int], repeats: int, cold_mb: float = 0,
                against=None) -> list[dict]:
    """Each shape and row count through torch and the kernel (and `against`, another build of it).
    With `cold_mb`, every call takes the next of that many MiB of weight copies (one cycle shared by
    the sides: a copy is read again only after all the others)."""
    dtype, out = DTYPES[dtype_name], []
    gen = torch.Generator().manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        nbytes = weight.numel() * weight.element_size()
        copies = [weight] + [weight.clone() for _ in range(max(0, math.ceil(cold_mb * 2**20 / nbytes) - 1))]
        turn = itertools.cycle(copies)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            sides = {"torch": lambda: torch.nn.functional.linear(x, next(turn)),
                     "kernel": lambda: cpu_gemv.linear(x, next(turn))}
            if against is not None:
                sides["against"] = lambda: _with_build(against, cpu_gemv.linear, x, next(turn))
            t = _alternate(sides, repeats * (3 if len(copies) > 1 else 1))
            out.append({"part": "projection", "dtype": dtype_name, "threads": torch.get_num_threads(), "shape": name,
                        "rows": rows, "weight_copies": len(copies), "torch_ms": t["torch"] * 1e3,
                        "kernel_ms": t["kernel"] * 1e3, "speedup": t["torch"] / t["kernel"],
                        "torch_gbs": nbytes / t["torch"] / 1e9, "kernel_gbs": nbytes / t["kernel"] / 1e9})
            r = out[-1]
            if against is not None:
                r |= {"against_ms": t["against"] * 1e3, "against_gbs": nbytes / t["against"] / 1e9,
                      "kernel_over_against": t["against"] / t["kernel"]}
            print(f"[bench_cpu_gemv] {dtype_name} {r['threads']}t {name} x{rows}: torch {r['torch_ms']:.3f} ms "
                  f"({r['torch_gbs']:.1f} GB/s), kernel {r['kernel_ms']:.3f} ms ({r['kernel_gbs']:.1f} GB/s), "
                  f"x{r['speedup']:.2f}" + (f"; other build {r['against_ms']:.3f} ms ({r['against_gbs']:.1f} GB/s), "
                                            f"this build x{r['kernel_over_against']:.2f}" if against is not None else ""),
                  flush=True)
        del copies, turn
    return out


def _with_build(build, fn, *args):
    with kernel_build(build):
        return fn(*args)


class _Decode:
    """One model's runner with `batch` rows `CONTEXT` tokens deep on shuffled pages."""

    def __init__(self, weights, dtype: torch.dtype, batch: int):
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.state.items()}
        need = -(-(CONTEXT + 1) // PAGE_SIZE)
        pool = KVPool(weights.config, need * batch + 1, PAGE_SIZE, dtype)
        self.runner = ModelRunner(build_model(weights.config, state), pool)
        pages = torch.randperm(need * batch + 1, generator=torch.Generator().manual_seed(0)).tolist()
        self.chunks = [SeqChunk([100 + i], CONTEXT, pages[i * need:(i + 1) * need]) for i in range(batch)]

    def step(self, gemv_rows: int, weights_first_rows: int | None = None):
        kept = cpu_gemv.LINEAR_ROWS, layers.WEIGHTS_FIRST_ROWS
        cpu_gemv.LINEAR_ROWS = gemv_rows
        if weights_first_rows is not None:
            layers.WEIGHTS_FIRST_ROWS = weights_first_rows
        try:
            self.runner.forward(self.chunks)
        finally:
            cpu_gemv.LINEAR_ROWS, layers.WEIGHTS_FIRST_ROWS = kept


def decode_steps(batches: list[int], repeats: int, against=None, linear_rows: int | None = None) -> list[dict]:
    """Each batch's step with the kernel on (bfloat16 projections of at most `linear_rows` rows, default
    `cpu_gemv.LINEAR_ROWS`), off, and in float32."""
    weights = load_weights(None, "auto", torch.float32, quantization="none")  # the embedded GGUF, dequantized
    out = []
    on = cpu_gemv.LINEAR_ROWS if linear_rows is None else linear_rows
    for batch in batches:
        bf16, fp32 = _Decode(weights, torch.bfloat16, batch), _Decode(weights, torch.float32, batch)
        sides = {"bf16 kernel": lambda: bf16.step(on), "bf16 torch": lambda: bf16.step(0, 0),
                 "bf16 row-wise": lambda: bf16.step(on, 0), "fp32": lambda: fp32.step(on)}
        if against is not None:
            sides["bf16 other build"] = lambda: _with_build(against, bf16.step, on)
        t = _alternate(sides, repeats)
        out.append({"part": "decode", "threads": torch.get_num_threads(), "batch": batch, "linear_rows": on,
                    "kernel_used": batch <= on, "bf16_kernel_ms": t["bf16 kernel"] * 1e3, "bf16_torch_ms": t["bf16 torch"] * 1e3,
                    "fp32_ms": t["fp32"] * 1e3, "speedup": t["bf16 torch"] / t["bf16 kernel"],
                    "bf16_rowwise_ms": t["bf16 row-wise"] * 1e3, "weights_first_gain": t["bf16 row-wise"] / t["bf16 kernel"]})
        r = out[-1]
        if against is not None:
            r |= {"bf16_against_ms": t["bf16 other build"] * 1e3,
                  "kernel_over_against": t["bf16 other build"] / t["bf16 kernel"]}
        print(f"[bench_cpu_gemv] decode b{batch} {r['threads']}t: bf16 kernel {r['bf16_kernel_ms']:.1f} ms, bf16 torch "
              f"{r['bf16_torch_ms']:.1f} ms (x{r['speedup']:.2f}), bf16 row-wise {r['bf16_rowwise_ms']:.1f} ms "
              f"(x{r['weights_first_gain']:.2f}), fp32 {r['fp32_ms']:.1f} ms"
              + (f"; bf16 other build {r['bf16_against_ms']:.1f} ms (this build x{r['kernel_over_against']:.2f})"
                 if against is not None else ""), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    proj = [r for r in rows if r["part"] == "projection"]
    dec = [r for r in rows if r["part"] == "decode"]
    other = any("against_ms" in r for r in proj)
    lines = ["| dtype | threads | weights | rows | torch ms | kernel ms | kernel speedup | torch GB/s | kernel GB/s |"
             + (" other build ms | this build ÷ other |" if other else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if other else "")]
    lines += [f"| {r['dtype']} | {r['threads']} | {r['shape']} | {r['rows']} | {r['torch_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['speedup']:.2f} | {r['torch_gbs']:.1f} | {r['kernel_gbs']:.1f} |"
              + (f" {r['against_ms']:.3f} | {r['kernel_over_against']:.2f} |" if other else "") for r in proj]
    if dec:
        other = any("bf16_against_ms" in r for r in dec)
        lines += ["", "| threads | decode batch | bf16, kernel ms | bf16, torch ms | kernel speedup | bf16, row-wise ms | "
                  "weights-first gain | fp32 ms |" + (" bf16, other build ms | this build ÷ other |" if other else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|---|" if other else "")]
        lines += [f"| {r['threads']} | {r['batch']} | {r['bf16_kernel_ms']:.1f} | {r['bf16_torch_ms']:.1f} | "
                  f"{r['speedup']:.2f} | {r['bf16_rowwise_ms']:.1f} | {r['weights_first_gain']:.2f} | {r['fp32_ms']:.1f} |"
                  + (f" {r['bf16_against_ms']:.1f} | {r['kernel_over_against']:.2f} |" if other else "") for r in dec]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="projections' dtypes")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch thread counts, each measured")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8], help="rows per projection")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                    help=f"weight shapes to time (default: all of {', '.join(SHAPES)})")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8], help="decode steps' batch sizes")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per side (medians reported)")
    ap.add_argument("--no-decode", action="store_true", help="projections only (no model load)")
    ap.add_argument("--linear-rows", type=int, default=None,
                    help="the decode steps' kernel side takes bfloat16 projections of at most this many rows "
                         "(default: cpu_gemv.LINEAR_ROWS, what the engine uses)")
    ap.add_argument("--cold-mb", type=float, default=0,
                    help="cycle each projection through this many MiB of weight copies (beyond the last-level "
                         "cache: every call reads from memory); 0: one copy, cache-warm")
    ap.add_argument("--against", metavar="PATH",
                    help="also time another build of the kernel: a source tree built with `python setup.py "
                         "build_ext --inplace`, or its engines/_cpu_gemv*.so")
    ap.add_argument("--name", default="cpu_gemv", help="results file stem")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    from artifact.benchmarks.bench_llamacpp import cpu_flags  # deferred: the artifact's helpers, not the engine's
    from artifact.benchmarks.common import RESULTS, write_results

    if cpu_gemv._ext is None:
        raise SystemExit("engines._cpu_gemv is not built (python setup.py build_ext --inplace)")
    against = load_kernel_build(args.against) if args.against else None
    threads, rows = torch.get_num_threads(), []
    try:
        for n in args.threads:
            torch.set_num_threads(n)
            for dtype_name in args.dtype:
                rows += projections(dtype_name, args.shapes, args.rows, args.repeats, args.cold_mb, against)
            if not args.no_decode:
                rows += decode_steps(args.batches, args.repeats, against, args.linear_rows)
    finally:
        torch.set_num_threads(threads)
    path = write_results(args.name, {"cpu_flags": cpu_flags(), "torch": torch.__version__, "isa": cpu_gemv.kernel_isa(),
                                     "linear_rows": cpu_gemv.LINEAR_ROWS, "args": vars(args), "results": rows})
    (RESULTS / f"{args.name}.md").write_text(markdown(rows))
    print(markdown(rows))
    print(f"[bench_cpu_gemv] wrote {path}")
    return rows


if __name__ == "__main__":
    main()
