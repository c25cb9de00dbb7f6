"""The engine's prefill and decode steps on a device, against what the device allows.

  python -m artifact.benchmarks.bench_engine_gpu --device cuda --load-format dummy --model-path llama-3.1-8b \
      --dtype bfloat16 [--output FILE] [--repeats N] [--prefill-tokens 2048] [--decode 1x1024,32x1024,128x512]
  python -m artifact.benchmarks.bench_engine_gpu --device cpu --load-format dummy --model-path smollm2-135m

First the device's own rates (`artifact.benchmarks.device_rates`): copy bandwidth and the GEMM rate in
the serving dtype. Then, through the engine's runner — `ModelRunner.forward`, and for graphs on
`DecodeGraphs.forward` over `TorchCudaGraphs`, what a decode worker replays:
* prefill of one prompt (2048 tokens): its model FLOPs (2 x projection parameters x tokens, causal
  attention 2 x layers x n^2 x heads x head_dim, one LM-head row) / time, as a share of the GEMM rate;
* prefill of prompts of lengths not run before (first call, then again), under the runner's attention
  backends and under torch's choice: what a per-shape set-up (cuDNN's graphs) adds to each prompt;
* decode steps at 1x1024, 32x1024 and 128x512 (batch x context), graphs off and on, each against its
  memory floor: (weight bytes + KV bytes read) / copy bandwidth, the weights every projection and the
  LM head (the embedding rows a step reads are negligible), the KV every sequence's context;
* mixed steps (a fresh prompt chunk beside decode rows, what the chunked baselines run): 512 tokens
  beside 128x512 and 1024 beside 32x1024, with the decode rows on the decode kernel (the runner's
  split, `engines.model.paged_attention.split_mixed`) and with one extend kernel over every row (as
  before the split), side by side;
* the layer's small stages fused (`engines.model.fused`: RMSNorm, RoPE, SwiGLU one kernel each) and
  as torch lines (`BULLET_FUSED_KERNELS=0`), side by side: a short prefill (128 tokens, where
  launches dominate), the long one and each decode step with graphs on (captured anew per setting).
A step is timed on the host clock from the call to the end of its kernels (what a worker pays:
Python, launches, the graph's table copies), the median of `--repeats`.

Before any of it the runner's kernels are warmed as a serving worker warms them
(`engines.kernel_warmup`); the JSON's `kernels` says how many Triton compiles the sections still
caused after that (the goal: none — each variant a step can launch was warmed) and which fused
kernel, if any, failed and fell back to torch lines, and why (`engines.kernel_fallbacks`).

The JSON is rewritten after every section (atomically: a reader never sees half a file), with
`sections_done` and `complete`: a run stopped by a time cap, or killed, keeps every section it
finished.

The goals of issue 24 (8B bf16 on a GPU, graphs on): decode <= 1.5x its floor at 1x1024 and <= 2x at
32x1024 and 128x512; prefill of 2048 tokens >= 70 % of the GEMM rate. They are judged (met / not met)
for the steps of those sizes.

On a CPU the default sizes are tiny (prefill 32; decode 1x32, 2x32, 4x16) so a test runs it end to
end in seconds, and graphs on runs `DecodeGraphs` over a stand-in that re-runs the captured body (no
CUDA graph: it exercises the padding and static tables; its time means nothing).

Dummy weights are drawn here, on the device, in the shapes of the engine's model (the config's
architecture built on the meta device: `float_shapes`): the same model the server builds, without
drawing 8 G random numbers on a CPU."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

from artifact.benchmarks.bench_engine import model_shape
from artifact.benchmarks.device_rates import copy_bandwidth, gemm_rate, median, synchronize, wall_seconds
from engines import kernel_fallbacks
from engines.cuda_graphs import DecodeGraphs, TorchCudaGraphs
from engines.kernel_warmup import warm_kernels
from engines.kv_pool import KVPool
from engines.model import fused
from engines.model.build import build_model, float_shapes
from engines.runner import ModelRunner, SeqChunk
from engines.triton_compiles import COUNTER
from engines.weights.resolve import dummy_config

PAGE_SIZE = 16
FUSED_DEFAULT = fused.ENABLED  # what BULLET_FUSED_KERNELS said: restored after the side-by-side
DECODE_GOALS = {(1, 1024): 1.5, (32, 1024): 2.0, (128, 512): 2.0}  # x the memory floor, graphs on
PREFILL_GOAL = 0.70, 2048  # share of the GEMM rate, at this many tokens
SIZES = {"cuda": {"prefill": 2048, "decode": "1x1024,32x1024,128x512", "mixed": "512+128x512,1024+32x1024",
                  "copy_mib": 1024, "gemm_n": 8192, "repeats": 10},
         "cpu": {"prefill": 32, "decode": "1x32,2x32,4x16", "mixed": "16+4x16", "copy_mib": 32, "gemm_n": 256,
                 "repeats": 3}}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class RerunGraphs:
    """A `GraphApi` for the CPU: a 'graph' re-runs the body it captured on whatever its static tables
    hold — what a replay computes, without CUDA."""

    def capture(self, body):
        body()  # the warm-up run TorchCudaGraphs makes too

        class Graph:
            def replay(self):
                return body()

            def release(self):
                pass

        return Graph()


def device_state(config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the model's own shapes, drawn on `device` (norms 1, the rest N(0, 0.02))."""
    shapes = float_shapes(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            state[name] = torch.randn(shape, dtype=dtype, device=device, generator=gen).mul_(0.02)
    return state


def parse_decode(spec: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(x) for x in item.lower().split("x")) for item in spec.split(",") if item.strip()]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"--decode wants BATCHxCONTEXT[,...], e.g. 1x1024,32x1024; got {spec!r}")
    return cases


def parse_mixed(spec: str) -> list[tuple[int, int, int]]:
    """PROMPTxBATCHxCONTEXT cases written PROMPT+BATCHxCONTEXT, e.g. 512+128x512."""
    try:
        cases = []
        for item in filter(str.strip, spec.split(",")):
            prompt, rest = item.split("+")
            cases.append((int(prompt), *parse_decode(rest)[0]))
    except (ValueError, argparse.ArgumentTypeError):
        cases = []
    if not cases or any(min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"--mixed wants PROMPT+BATCHxCONTEXT[,...], e.g. 512+128x512; got {spec!r}")
    return cases


class Bench:
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device, prefill: int,
                 decode: list[tuple[int, int]], seed: int = 0, mixed: list[tuple[int, int, int]] = (),
                 config=None, transform: Callable[[dict], dict] | None = None):
        """`config`: the model's (default: `model_path`'s); `transform`: what the drawn state becomes
        before the model is built around it (e.g. its projections quantized)."""
        self.config = config if config is not None else dummy_config(model_path)
        self.device, self.dtype = device, dtype
        pages = max([-(-prefill // PAGE_SIZE)] + [b * -(-(c + 1) // PAGE_SIZE) for b, c in decode]
                    + [-(-p // PAGE_SIZE) + b * -(-(c + 1) // PAGE_SIZE) for p, b, c in mixed]) + 1
        state = device_state(self.config, dtype, device, seed)
        model = build_model(self.config, transform(state) if transform is not None else state, device)
        # paged on every device: decode graphs read the paged-attention tables (the CPU's "graphs" rerun the step)
        self.runner = ModelRunner(model, KVPool(self.config, pages, PAGE_SIZE, dtype, device), device, paged=True)
        # pages in a shuffled order, as a pool hands them out after a while; the last one is the graphs' scratch
        order = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages, self.scratch_slot = order, (pages - 1) * PAGE_SIZE
        self.max_batch = max(b for b, _ in decode) if decode else 1
        self.rng = torch.Generator().manual_seed(seed + 1)
        COUNTER.install()  # counts from here: the warm-up's compiles, then any the sections still cause
        self.warm_up = warm_kernels(self.runner, pages - 1).as_dict()
        COUNTER.mark_serving()

    def kernels(self) -> dict:
        """Triton compiles (before and after the warm-up) and kernel fallbacks so far."""
        snap = COUNTER.snapshot()
        return {"warm_up": self.warm_up,
                "triton_compiles": {"counted": snap["installed"], "warm_up": snap["before_serving"],
                                    "after_warm_up": snap["while_serving"], "kernels_after_warm_up": snap["serving_kernels"]},
                "fallbacks": kernel_fallbacks.fallbacks()}

    def ids(self, n: int) -> list[int]:
        return torch.randint(100, self.config.vocab_size, (n,), generator=self.rng).tolist()

    def prefill_chunks(self, n: int) -> list[SeqChunk]:
        return [SeqChunk(self.ids(n), 0, self.pages[: -(-n // PAGE_SIZE)])]

    def decode_chunks(self, batch: int, context: int) -> list[SeqChunk]:
        chunks, k = [], 0
        for token in self.ids(batch):
            need = -(-(context + 1) // PAGE_SIZE)
            chunks.append(SeqChunk([token], context, self.pages[k : k + need]))
            k += need
        return chunks

    def mixed_chunks(self, prompt: int, batch: int, context: int) -> list[SeqChunk]:
        """Decode rows, then a fresh prompt chunk on pages of its own (the chunked baselines' order:
        running requests first, new prompts after)."""
        decode = self.decode_chunks(batch, context)
        used = sum(len(c.page_table) for c in decode)
        return decode + [SeqChunk(self.ids(prompt), 0, self.pages[used : used + -(-prompt // PAGE_SIZE)])]

    def graphs(self) -> DecodeGraphs:
        api = TorchCudaGraphs() if self.device.type == "cuda" else RerunGraphs()
        return DecodeGraphs(self.runner, self.scratch_slot, api, max_batch=self.max_batch)


def prefill_flops(shape: dict, n: int) -> float:
    h = shape["heads"] * shape["head_dim"]
    return 2.0 * shape["projection_params"] * n + 2.0 * shape["layers"] * n * n * h + 2.0 * shape["head_params"]


def decode_bytes(shape: dict, batch: int, context: int, elem: int) -> float:
    weights = (shape["projection_params"] + shape["head_params"]) * elem
    kv = batch * (context + 1) * shape["layers"] * 2 * shape["kv_size"] * elem
    return float(weights + kv)


def mixed_steps(bench: Bench, mixed: list[tuple[int, int, int]], repeats: int) -> list[dict]:
    """Each mixed step with the runner's split and with one extend over every row, in turn."""
    rows = []
    try:
        for prompt, batch, context in mixed:
            chunks, row = bench.mixed_chunks(prompt, batch, context), {"prompt": prompt, "batch": batch, "context": context}
            for name, split in (("split_ms", True), ("one_extend_ms", False)):
                bench.runner.split_mixed = split
                row[name] = median(wall_seconds(lambda: bench.runner.forward(chunks), bench.device, repeats, warmup=2)) * 1e3
            row["one_extend_x_split"] = row["one_extend_ms"] / row["split_ms"]
            rows.append(row)
            print(f"[bench] mixed {prompt} + {batch}x{context}: split {row['split_ms']:.2f} ms, one extend "
                  f"{row['one_extend_ms']:.2f} ms ({row['one_extend_x_split']:.2f}x)", flush=True)
    finally:
        bench.runner.split_mixed = True
    return rows


def fused_stages(bench: Bench, prefill: int, decode: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Steps with the layer's small stages fused and as torch lines, in turn (graphs recaptured)."""
    short = min(128, prefill)
    steps = [(f"prefill {short}", bench.prefill_chunks(short), False),
             (f"prefill {prefill}", bench.prefill_chunks(prefill), False)]
    steps += [(f"decode {b}x{c} graphs on", bench.decode_chunks(b, c), True) for b, c in decode]
    rows = [{"step": name} for name, _, _ in steps]
    try:
        for key, enabled in (("fused_ms", True), ("torch_lines_ms", False)):
            fused.ENABLED = enabled
            graphs = bench.graphs()
            for row, (_, chunks, graphed) in zip(rows, steps):
                run = (lambda: graphs.forward(chunks)) if graphed else (lambda: bench.runner.forward(chunks))
                if graphed and graphs.shape_for(chunks) is None:
                    row["error"] = "no graph bucket for this step"
                    continue
                row[key] = median(wall_seconds(run, bench.device, repeats, warmup=2)) * 1e3
            graphs.release()
    finally:
        fused.ENABLED = FUSED_DEFAULT
    for row in rows:
        if "fused_ms" in row and "torch_lines_ms" in row:
            row["torch_lines_x_fused"] = row["torch_lines_ms"] / row["fused_ms"]
            print(f"[bench] {row['step']}: fused {row['fused_ms']:.2f} ms, torch lines {row['torch_lines_ms']:.2f} ms "
                  f"({row['torch_lines_x_fused']:.2f}x)", flush=True)
    return rows


def measure(bench: Bench, prefill: int, decode: list[tuple[int, int]], repeats: int, rates: dict,
            mixed: list[tuple[int, int, int]] = (), done: Callable[[str, dict], None] = lambda name, out: None) -> dict:
    """Every section in turn; `done(name, out)` after each, with the sections measured so far."""
    shape, dev = model_shape(bench.config), bench.device
    elem = torch.empty((), dtype=bench.dtype).element_size()
    chunks = bench.prefill_chunks(prefill)
    seconds = median(wall_seconds(lambda: bench.runner.forward(chunks), dev, max(3, repeats // 2)))
    flops = prefill_flops(shape, prefill)
    out = {"prefill": {"tokens": prefill, "ms": seconds * 1e3, "model_tflop": flops / 1e12,
                       "tflops": flops / seconds / 1e12, "of_gemm": flops / seconds / rates["gemm_flops"]}}
    print(f"[bench] prefill {prefill}: {seconds * 1e3:.2f} ms, {out['prefill']['of_gemm']:.0%} of the GEMM rate", flush=True)
    done("prefill", out)
    out["new_lengths"] = new_length_prefills(bench, prefill)
    for backends, r in out["new_lengths"].items():
        print(f"[bench] prefill of a new length ({backends}): first {r['first_ms']:.2f} ms, again "
              f"{r['again_ms']:.2f} ms (medians of {len(r['lengths'])} lengths)", flush=True)
    done("new_lengths", out)
    out["decode"] = []
    graphs = bench.graphs()
    for batch, context in decode:
        floor = decode_bytes(shape, batch, context, elem) / rates["copy_bytes_s"]
        for mode in ("off", "on"):
            row = {"batch": batch, "context": context, "graphs": mode, "floor_ms": floor * 1e3}
            chunks = bench.decode_chunks(batch, context)
            if mode == "on" and graphs.shape_for(chunks) is None:
                row["error"] = "no graph bucket for this step (runs eagerly)"
            else:
                step = (lambda: graphs.forward(chunks)) if mode == "on" else (lambda: bench.runner.forward(chunks))
                seconds = median(wall_seconds(step, dev, repeats, warmup=2))
                row.update(ms=seconds * 1e3, tok_s=batch / seconds, over_floor=seconds / floor)
            out["decode"].append(row)
            print(f"[bench] decode {batch}x{context} graphs {mode}: "
                  + (f"{row['ms']:.2f} ms, {row['over_floor']:.2f}x the floor ({row['floor_ms']:.2f} ms)" if "ms" in row
                     else row["error"]), flush=True)
        done("decode", out)  # after each size: a cap in the middle keeps the sizes done
    graphs.release()
    out["mixed"] = mixed_steps(bench, list(mixed), repeats)
    done("mixed", out)
    out["fused"] = fused_stages(bench, prefill, decode, repeats)
    done("fused", out)
    return out


def new_length_prefills(bench: Bench, prefill: int, count: int = 4) -> dict:
    """A prompt of a length not run before, then the same prompt again, timed per call: under the
    runner's own attention backends and under torch's choice (which may build a cuDNN graph per new
    length, `engines.runner.PROMPT_ATTENTION_BACKENDS`), in turn, each on its own lengths."""
    own = bench.runner.sdpa_backends
    lengths = {"runner's backends": [prefill // 2 + 2 * i + 1 for i in range(count)],
               "torch's choice": [prefill // 2 + 2 * i + 2 for i in range(count)]}
    times: dict[str, dict[str, list[float]]] = {k: {"first": [], "again": []} for k in lengths}
    try:
        for i in range(count):
            for name, chosen in lengths.items():
                bench.runner.sdpa_backends = own if name == "runner's backends" else None
                chunks = bench.prefill_chunks(chosen[i])
                first, again = wall_seconds(lambda: bench.runner.forward(chunks), bench.device, 2, warmup=0)
                times[name]["first"].append(first)
                times[name]["again"].append(again)
    finally:
        bench.runner.sdpa_backends = own
    return {name: {"lengths": lengths[name], "first_ms": median(t["first"]) * 1e3, "again_ms": median(t["again"]) * 1e3}
            for name, t in times.items()}


def goals(result: dict) -> list[dict]:
    """The issue's goals for the steps of their sizes in `result` (none for other sizes, nor for
    the sections a cut-short run did not reach)."""
    out = []
    for row in result.get("decode", []):
        limit = DECODE_GOALS.get((row["batch"], row["context"]))
        if limit is not None and row["graphs"] == "on":
            ratio = row.get("over_floor")
            out.append({"goal": f"decode {row['batch']}x{row['context']}, graphs on", "measured": ratio,
                        "target": f"<= {limit:g}x floor", "met": ratio is not None and ratio <= limit, "unit": "x"})
    p = result.get("prefill")
    if p and p["tokens"] == PREFILL_GOAL[1]:
        out.append({"goal": f"prefill {p['tokens']} tokens", "measured": p["of_gemm"] * 100,
                    "target": f">= {PREFILL_GOAL[0]:.0%} of GEMM rate", "met": p["of_gemm"] >= PREFILL_GOAL[0], "unit": "%"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model-path", default="llama-3.1-8b", help="a built-in config name or config.json (dummy weights)")
    ap.add_argument("--load-format", default="dummy", choices=["dummy"], help="dummy only: the weights' values do not matter")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument("--decode", type=parse_decode, default=None, help="BATCHxCONTEXT,... (default: per device)")
    ap.add_argument("--mixed", type=parse_mixed, default=None,
                    help="PROMPT+BATCHxCONTEXT,... mixed steps, split and one extend (default: per device)")
    ap.add_argument("--seed", type=int, default=0)
    add_run_args(ap, "engine_gpu.json")
    args = ap.parse_args(argv)
    if not ready(args, "bench_engine_gpu"):
        return 2
    from artifact.benchmarks.common import RESULTS, machine, print_table  # deferred: rich, only to report

    sizes, device, dtype = SIZES[args.device], torch.device(args.device), DTYPES[args.dtype]
    prefill = args.prefill_tokens or sizes["prefill"]
    decode = args.decode or parse_decode(sizes["decode"])
    mixed = args.mixed or parse_mixed(sizes["mixed"])
    repeats = args.repeats or sizes["repeats"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    path = args.output or RESULTS / "engine_gpu.json"
    payload = {"machine": machine(),
               "config": {"model": args.model_path, "dtype": args.dtype, "device": name, "page_size": PAGE_SIZE,
                          "repeats": repeats, "threads": torch.get_num_threads()},
               "model": model_shape(dummy_config(args.model_path)), "sections_done": [], "complete": False,
               "graphs_note": "" if device.type == "cuda" else
               "Graphs on, on a CPU: the captured body re-run (no CUDA graph); its time means nothing."}
    bench = None

    def done(section: str, result: dict) -> None:
        if section not in payload["sections_done"]:
            payload["sections_done"].append(section)
        payload.update(result)
        payload["goals"] = goals(payload)
        if bench is not None:
            payload["kernels"] = bench.kernels()
        write_atomically(path, payload)

    stream = torch.cuda.Stream() if device.type == "cuda" else None  # graphs cannot be captured on the default stream
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        rates = {"copy_bytes_s": copy_bandwidth(device, sizes["copy_mib"] << 20),
                 "gemm_flops": gemm_rate(device, dtype, sizes["gemm_n"])}
        print(f"[bench] copy {rates['copy_bytes_s'] / 1e9:.0f} GB/s, "
              f"{args.dtype} GEMM {rates['gemm_flops'] / 1e12:.1f} TFLOP/s", flush=True)
        done("rates", {"rates": {"copy_gbs": rates["copy_bytes_s"] / 1e9, "copy_mib": sizes["copy_mib"],
                                 "gemm_tflops": rates["gemm_flops"] / 1e12, "gemm_n": sizes["gemm_n"]}})
        bench = Bench(args.model_path, dtype, device, prefill, decode, args.seed, mixed)
        done("warm_up", {})
        result = measure(bench, prefill, decode, repeats, rates, mixed, done)
        synchronize(device)
    payload["complete"] = True
    done("fused", result)
    rows = [{"step": f"prefill {prefill}", "graphs": "-", "ms": result["prefill"]["ms"], "floor ms": "-",
             "ratio": f"{result['prefill']['of_gemm']:.0%} of GEMM"}]
    rows += [{"step": f"decode {r['batch']}x{r['context']}", "graphs": r["graphs"], "ms": r.get("ms", "-"),
              "floor ms": r["floor_ms"], "ratio": f"{r['over_floor']:.2f}x floor" if "over_floor" in r else r.get("error")}
             for r in result["decode"]]
    rows += [{"step": f"mixed {r['prompt']} + {r['batch']}x{r['context']}", "graphs": "-", "ms": r["split_ms"],
              "floor ms": "-", "ratio": f"one extend {r['one_extend_x_split']:.2f}x"} for r in result["mixed"]]
    rows += [{"step": f"{r['step']} (fused stages)", "graphs": "-", "ms": r.get("fused_ms", "-"), "floor ms": "-",
              "ratio": f"torch lines {r['torch_lines_x_fused']:.2f}x" if "torch_lines_x_fused" in r else r.get("error")}
             for r in result["fused"]]
    print_table(rows, ["step", "graphs", "ms", "floor ms", "ratio"], title=f"{args.model_path} {args.dtype} on {name} ({path})")
    for g in payload["goals"]:
        measured = "-" if g["measured"] is None else f"{g['measured']:.2f} {g['unit']}"
        print(f"[bench] goal {g['goal']}: {measured} ({g['target']}): {'met' if g['met'] else 'NOT met'}")
    compiles = payload["kernels"]["triton_compiles"]
    print(f"[bench] Triton compiles: {compiles['warm_up']} in the warm-up, {compiles['after_warm_up']} after it"
          + (f" ({', '.join(compiles['kernels_after_warm_up'])})" if compiles["kernels_after_warm_up"] else "")
          + ("" if compiles["counted"] else " (not counted: triton is interpreted or absent)"))
    for f in payload["kernels"]["fallbacks"]:
        print(f"[bench] kernel fallback: {f['kernel']} -> {f['instead']} ({f['error']})")
    return 0


def add_run_args(ap: argparse.ArgumentParser, default_output: str) -> None:
    """The flags every device benchmark takes: --repeats, --threads, --output."""
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (a CPU run; default: torch's)")
    ap.add_argument("--output", type=Path, default=None, help=f"JSON file (default: artifact/results/{default_output})")


def ready(args: argparse.Namespace, prog: str) -> bool:
    """False (said why) for --device cuda without a CUDA device; else torch's threads set as asked."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: --device cuda but torch sees no CUDA device (use --device cpu for the tiny run)")
        return False
    if args.threads:
        torch.set_num_threads(args.threads)
    return True


def write_atomically(path: Path, payload: dict) -> None:
    """The JSON in a temporary file renamed over `path`: a run killed mid-write leaves the previous
    version whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
