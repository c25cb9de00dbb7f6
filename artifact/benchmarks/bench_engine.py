"""The engine's steps against their roofline, and next to `transformers`.

  python artifact/benchmarks/bench_engine.py [--modes int8 fp32 bf16] [--threads N] [--rounds R]
                                             [--baseline-src DIR] [--no-transformers] [--where]

For each serving mode of the embedded SmolLM2 GGUF — `int8` (W8A8, what `--dtype auto` serves on a
CPU), `fp32` and `bf16` (dequantized; `--dtype float32|bfloat16` picks one of these alone) — it measures prefill of one 128- and one 512-token prompt and one
decode step at batch 1, 8 and 32 over realistic contexts (each row's context drawn evenly from
0.25x to 1.75x of 300 tokens, as a ShareGPT batch spreads them; KV pages shuffled), through the
runner (`ModelRunner.forward`, what a worker's step costs). Each is put against its roofline on
this machine, measured first:

* bandwidth: a cold fp32 matrix-vector product over 512 MB (one core saturates it here);
* compute: a 2048 x 576 x 2048 GEMM in the mode's arithmetic (fp32 or bf16 matmul, or fbgemm int8);
* roofline(step) = max(bytes read / bandwidth, FLOPs / compute), bytes = the weights a step reads
  (every projection and the LM head; the embedding rows are negligible) plus the KV read by
  attention; FLOPs = 2 x projection parameters x tokens + attention. Ratio = measured / roofline.

`--baseline-src DIR` runs the same fp32 measurements on another source tree (e.g. the previous
commit's `engines/`, unpacked with `git archive HEAD engines | tar -x -C DIR`) in a subprocess, in
the same run. `transformers` (fp32, greedy one-token steps on its KV cache at batch 1/8/32
with 128-token prompts) is the external reference. On one thread the clock is the thread's CPU time
(what another process's load does not inflate); on several, wall time. Rounds alternate the
systems and medians are reported. `--where` then profiles each step of the first mode (torch
profiler, self time per op) and prints its wall time split into op categories — projections, KV
gather, attention math, activation quantization, elementwise — and the rest, Python and dispatch
between ops. Writes artifact/results/engine.json and the tables."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# engines/ is imported from whichever tree is first on sys.path: the baseline's in `--worker`
from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.runner import ModelRunner, SeqChunk
from engines.weights import load_weights
from engines.weights.resolve import default_gguf_path

ROOT = Path(__file__).resolve().parents[2]
PREFILL_LENS = (128, 512)
BATCHES = (1, 8, 32)
CONTEXT = 300
# mode -> (quantization, compute dtype[, KV pool dtype]); int8-kv16: the int8 model over a float16 pool
MODES = {"int8": ("w8a8_int8", torch.float32), "fp32": ("none", torch.float32), "bf16": ("none", torch.bfloat16),
         "int8-kv16": ("w8a8_int8", torch.float32, torch.float16)}


def _clock():
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


# -- the engine, through engines/ only (so that an older tree runs the same code) -------------------
class EngineBench:
    def __init__(self, quantization: str, dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None):
        import inspect

        kw = {"quantization": quantization} if "quantization" in inspect.signature(load_weights).parameters else {}
        if quantization != "none" and not kw:
            raise SystemExit(f"this source tree has no quantization {quantization!r}")
        w = load_weights(None, "auto", dtype, **kw)
        self.config, self.SeqChunk, ps = w.config, SeqChunk, 16
        pages = -(-max(BATCHES) * (2 * CONTEXT + 64) // ps) + max(PREFILL_LENS) // ps + 8
        self.runner = ModelRunner(build_model(w.config, w.state), KVPool(w.config, pages, ps, kv_dtype or dtype))
        self.perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.ps, self.clock = ps, _clock()

    def contexts(self, b: int) -> list[int]:
        return [CONTEXT] if b == 1 else [int(CONTEXT * (0.25 + 1.5 * i / (b - 1))) for i in range(b)]

    def decode(self, b: int) -> float:
        chunks, k = [], 0
        for i, n in enumerate(self.contexts(b)):
            pages = -(-(n + 1) // self.ps)
            chunks.append(self.SeqChunk([100 + i], n, self.perm[k : k + pages]))
            k += pages
        self.runner.forward(chunks)
        t = self.clock()
        self.runner.forward(chunks)
        return self.clock() - t

    def prefill(self, n: int) -> float:
        ids = torch.randint(200, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        pages = -(-n // self.ps)
        chunk = [self.SeqChunk(ids, 0, self.perm[-pages:])]  # the pool's last pages: decode uses the first
        t = self.clock()
        self.runner.forward(chunk)
        return self.clock() - t


def engine_tasks() -> list[tuple[str, str, int]]:
    return [(f"prefill_{n}", "prefill", n) for n in PREFILL_LENS] + [(f"decode_b{b}", "decode", b) for b in BATCHES]


# -- the machine's roofline --------------------------------------------------------------------------
def measure_machine() -> dict:
    clock, out = _clock(), {}
    w = torch.randn(32768, 4096)  # 512 MB: beyond any cache
    x = torch.randn(4096)
    torch.mv(w, x)
    out["bandwidth_gbs"] = max(w.numel() * 4 / _timed(clock, lambda: torch.mv(w, x)) / 1e9 for _ in range(3))
    del w
    a, b = torch.randn(2048, 576), torch.randn(2048, 576)
    flops = 2 * 2048 * 576 * 2048
    out["fp32_gflops"] = max(flops / _timed(clock, lambda: torch.nn.functional.linear(a, b)) / 1e9 for _ in range(5))
    ab, bb = a.bfloat16(), b.bfloat16()
    out["bf16_gflops"] = max(flops / _timed(clock, lambda: torch.nn.functional.linear(ab, bb)) / 1e9 for _ in range(3))
    from engines.quant.int8 import Int8Linear, fbgemm_available, quantize_weight  # deferred: absent from a baseline tree

    if fbgemm_available():
        lin = Int8Linear(576, 2048)
        lin.qweight, lin.scale = quantize_weight(b)
        lin(a)
        out["int8_gops"] = max(flops / _timed(clock, lambda: lin(a)) / 1e9 for _ in range(5))
    return out


def _timed(clock, fn) -> float:
    t = clock()
    fn()
    return clock() - t


def roofline(task: str, arg: int, mode: str, machine: dict, cfg: dict, contexts: list[int]) -> float:
    """Seconds a step needs at this machine's bandwidth and compute rate (see the module doc)."""
    layers, h, kvd = cfg["layers"], cfg["heads"] * cfg["head_dim"], cfg["kv_size"]
    rate = machine[{"int8": "int8_gops", "int8-kv16": "int8_gops", "bf16": "bf16_gflops"}.get(mode, "fp32_gflops")] * 1e9
    bw = machine["bandwidth_gbs"] * 1e9
    proj, head = cfg["projection_params"], cfg["head_params"]
    elem = {"int8": 1, "int8-kv16": 1, "bf16": 2}.get(mode, 4)
    weight_bytes = (proj + head) * elem
    if task == "prefill":  # one LM-head row; causal QK^T and PV: 2 x (n^2 / 2) x 2 x H x D per layer
        return max((2 * arg * proj + 2 * head + 2 * layers * arg * arg * h) / rate, weight_bytes / bw)
    ctx = sum(contexts)
    kv_bytes = ctx * layers * 2 * kvd * (2 if mode in ("bf16", "int8-kv16") else 4)
    flops = 2 * arg * (proj + head) + 4 * layers * ctx * h
    return max(flops / rate, (weight_bytes + kv_bytes) / bw)


def model_shape(config) -> dict:
    h, i = config.hidden_size, config.intermediate_size
    per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i
    return {"layers": config.num_hidden_layers, "heads": config.num_attention_heads, "head_dim": config.head_dim,
            "kv_size": config.kv_size, "projection_params": per_layer * config.num_hidden_layers,
            "head_params": config.vocab_size * h}


# -- where a step's time goes ---------------------------------------------------------------------------
# op name (torch profiler, self time) -> what it does in our step; the rest of the wall time is Python and
# dispatch between ops (the runner, the model's layer loop, building the step's context)
CATEGORIES = (("projections (GEMM)", ("linear", "addmm", "aten::mm", "matmul", "quantized::")),
              ("KV gather/scatter", ("index_select", "index_copy", "gather", "index_put", "aten::index")),
              ("attention math", ("baddbmm", "aten::bmm", "softmax", "scaled_dot_product", "cpu_attention")),
              ("activation quantize", ("abs", "amax", "aten::div", "clamp", "round")),
              ("norms, RoPE, SiLU, residual", ("norm", "rsqrt", "silu", "mul", "add", "cat", "neg", "pow", "mean")))


def _category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(k in op for k in keys):
            return name
    return "other ops (views, copies, allocation)"


def where_time_goes(bench: "EngineBench", task: str, arg: int, repeats: int = 3) -> dict:
    """Self CPU time of each op category over `repeats` profiled steps, as shares of the wall time,
    and what no op accounts for (Python and dispatch)."""
    from torch.profiler import ProfilerActivity, profile  # deferred: only --where profiles

    getattr(bench, task)(arg)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(repeats):
            getattr(bench, task)(arg)
        wall = time.perf_counter() - t
    wall_us = wall * 1e6  # ops and wall clock both span every forward (bench.decode runs two, times one)
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        cat = _category(event.key)
        shares[cat] = shares.get(cat, 0.0) + event.self_cpu_time_total
    out = {k: v / wall_us for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}
    out["Python and dispatch (no op)"] = max(0.0, 1.0 - sum(out.values()))
    out["step ms"] = wall * 1e3 / repeats / (2 if task == "decode" else 1)
    return out


# -- transformers, the external reference --------------------------------------------------------------
class Reference:
    def __init__(self):
        from transformers import AutoModelForCausalLM

        path = default_gguf_path()
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.clock = _clock()

    @torch.inference_mode()
    def prefill(self, n: int) -> float:
        ids = torch.randint(200, 40000, (1, n), generator=torch.Generator().manual_seed(n))
        t = self.clock()
        self.model(ids)
        return self.clock() - t

    def _step(self, tokens: torch.Tensor, cache=None):
        """One forward with the KV cache; returns (cache, next greedy tokens). transformers 5 names the
        cache `cache` (`past_key_values` warns, and goes in 5.40); 4.x knows only `past_key_values`."""
        kwargs = {} if cache is None else {self._cache_arg: cache}
        out = self.model(tokens, use_cache=True, **kwargs)
        cache = out.cache if self._cache_arg == "cache" else out.past_key_values
        return cache, out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode(self, b: int) -> float:
        cache, tok = self._step(torch.randint(200, 40000, (b, 128), generator=torch.Generator().manual_seed(b)))
        cache, tok = self._step(tok, cache)  # warm-up step
        t = self.clock()
        self._step(tok, cache)
        return self.clock() - t


# -- driving ---------------------------------------------------------------------------------------------
def run_rounds(systems: dict, rounds: int) -> dict:
    samples = {name: {key: [] for key, _, _ in engine_tasks()} for name in systems}
    for key, method, arg in engine_tasks():
        for sys_ in systems.values():
            getattr(sys_, method)(arg)  # warm-up
        for r in range(rounds):
            order = list(systems.items()) if r % 2 == 0 else list(systems.items())[::-1]
            for name, sys_ in order:
                samples[name][key].append(getattr(sys_, method)(arg))
        print(f"[bench] {key}: " + ", ".join(f"{n} {statistics.median(samples[n][key]) * 1e3:.1f} ms"
                                               for n in systems), flush=True)
    return samples


def baseline_worker(rounds: int) -> None:
    """`--worker`: the fp32 engine of whatever tree is first on sys.path; prints JSON samples."""
    bench = EngineBench("none")
    print(json.dumps(run_rounds({"baseline": bench}, rounds)["baseline"]))


def run_baseline(src: str, rounds: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, __file__, "--worker", "--rounds", str(rounds), "--threads", str(threads)],
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline run failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["int8", "fp32"], choices=list(MODES))
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="measure this float mode alone")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-src", default=None, help="a source tree whose engines/ runs the fp32 baseline")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--where", action="store_true",
                    help="also profile each step of the first mode and print where its time goes (op categories)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return baseline_worker(args.rounds)
    if args.dtype:
        args.modes = ["fp32" if args.dtype == "float32" else "bf16"]
    from artifact.benchmarks.bench_llamacpp import cpu_flags  # deferred: keeps --worker free of the artifact's imports
    from artifact.benchmarks.common import print_table, write_results

    machine = measure_machine()
    print(f"[bench] machine: {machine}", flush=True)
    systems = {mode: EngineBench(*MODES[mode]) for mode in args.modes}
    if not args.no_transformers:
        systems["transformers"] = Reference()
    samples = run_rounds(systems, args.rounds)
    if args.baseline_src:
        samples["baseline fp32"] = run_baseline(args.baseline_src, args.rounds, torch.get_num_threads())
    first = next(iter(s for s in systems.values() if isinstance(s, EngineBench)))
    cfg = model_shape(first.config)
    rows, results = [], {}
    for name, per_task in samples.items():
        mode = name if name in MODES else "fp32"
        results[name] = {}
        for key, method, arg in engine_tasks():
            seconds = statistics.median(per_task[key])
            ctx = first.contexts(arg) if method == "decode" else []
            if name == "transformers" and method == "decode":
                ctx = [128] * arg
            roof = roofline(method, arg, mode, machine, cfg, ctx)
            results[name][key] = {"ms": seconds * 1e3, "tok_s": arg / seconds, "roofline_ms": roof * 1e3,
                                  "over_roofline": seconds / roof, "samples_ms": [s * 1e3 for s in per_task[key]]}
            rows.append({"system": name, "step": key, "ms": seconds * 1e3, "tok/s": arg / seconds,
                         "roofline ms": roof * 1e3, "x roofline": seconds / roof})
    where = {}
    if args.where:  # profiled apart from the timed rounds: the profiler's own cost would inflate them
        for key, method, arg in engine_tasks():
            where[key] = where_time_goes(first, method, arg)
        cats = sorted({c for w in where.values() for c in w if c != "step ms"}, key=lambda c: -where["decode_b8"].get(c, 0))
        print_table([{"step": k, "ms": w["step ms"], **{c: f"{100 * w.get(c, 0):.0f} %" for c in cats}}
                     for k, w in where.items()], ["step", "ms", *cats],
                    title=f"where the time goes: {args.modes[0]}, share of wall time (torch profiler, self time)")
    path = write_results("engine", {"threads": torch.get_num_threads(), "context": CONTEXT, "cpu_flags": cpu_flags(),
                                    "machine_rates": machine, "model": cfg, "results": results, "where": where})
    print_table(rows, ["system", "step", "ms", "tok/s", "roofline ms", "x roofline"],
                title=f"engine steps vs roofline, {torch.get_num_threads()} threads ({path})")


if __name__ == "__main__":
    main()
