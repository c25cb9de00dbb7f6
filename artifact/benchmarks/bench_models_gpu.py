"""The other models and formats on a device: FP8 GEMMs against bf16 at Llama-3.1-8B's shapes, and
decode steps of Qwen3 dense, Qwen3-MoE and FP8 Llama against their memory floors.

  python -m artifact.benchmarks.bench_models_gpu --device cuda [--models qwen3-32b,qwen3-30b-a3b,llama-3.1-8b:fp8]
      [--decode 1x1024,32x1024] [--gemm-tokens 2048] [--repeats 10] [--output FILE]
  python -m artifact.benchmarks.bench_models_gpu --device cpu     # tiny shapes: proves the benchmark runs

Sections, each written to the JSON as soon as it is measured (a run stopped by a cap keeps them):

* **FP8 GEMMs** — the four projections of a Llama-3.1-8B layer (q/k/v, o, gate/up, down) at
  `--gemm-tokens` rows: `F.linear` in the serving dtype (bf16 on a GPU), `torch._scaled_mm` on e4m3 operands with one scale per row
  of each (the kernel alone), and the engine's `Fp8Linear` (the kernel plus quantizing the activation
  per row, what a served step pays), and where the device runs torch's block-scaled recipe (Hopper) the
  weight in 128 x 128 blocks as an FP8 checkpoint stores it (`Fp8Linear` with its block-scaled GEMM,
  the activation quantized per 1 x 128 group). Rates are model FLOPs (2 x M x N x K) over the median time; the
  ratio is the four shapes' FLOPs over their summed times.
* **Models** — per `--models` entry (`NAME[:fp8]`: a built-in config or a config.json, dummy weights
  drawn on the device, `:fp8` its projections quantized to e4m3 per row at load, what
  `--quantization fp8` serves): decode at each `--decode` size through the engine's runner, eager and
  replayed from CUDA graphs, against the step's memory floor — the bytes it must read (every
  projection and the LM head as stored, the KV of every sequence's context) over the device's copy
  bandwidth. For a mixture of experts the floor counts only the experts the step's tokens picked:
  counted per layer in an eager run of the same step (the router's real choices on these weights),
  beside the count uniform routing would give. One prefill of `--prefill-tokens` per model too.
  Models run one after another, each freed before the next (Qwen3-32B in bf16 is 65 GB).

Goals (issue 41; judged only for the sizes and models named): `_scaled_mm` >= 1.6x the bf16 GEMM
rate at the 8B shapes; Qwen3-30B-A3B decode with graphs <= 2.5x its floor (active bytes).

On a CPU the defaults are tiny Qwen3 dense, Qwen3-MoE and FP8 configs (the 8B/30B/32B shapes'
architectures, shrunk) so a test runs every section in seconds; "graphs on" there re-runs the
captured body and its time means nothing, nor do the CPU's FP8 rates."""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch.nn.functional as F
from torch import nn

from artifact.benchmarks.bench_engine_gpu import DTYPES, Bench, add_run_args, parse_decode, ready, write_atomically
from artifact.benchmarks.device_rates import copy_bandwidth, median, synchronize, wall_seconds
from engines import kernel_fallbacks
from engines.model.moe import Experts
from engines.model_config import ModelConfig
from engines.quant import fp8, fp8_blockwise
from engines.triton_compiles import COUNTER
from engines.weights.resolve import dummy_config

FP8_GOAL = 1.6, "llama-3.1-8b"  # _scaled_mm over bf16, at this model's projection shapes
MOE_GOAL = 2.5, "qwen3-30b-a3b"  # x the active-bytes floor, graphs on
SIZES = {"cuda": {"models": "qwen3-32b,qwen3-30b-a3b,llama-3.1-8b:fp8", "gemm_model": "llama-3.1-8b",
                  "decode": "1x1024,32x1024", "prefill": 2048, "gemm_tokens": 2048, "copy_mib": 1024, "repeats": 10},
         "cpu": {"models": "tiny-qwen3,tiny-qwen3-moe,tiny-llama:fp8", "gemm_model": "tiny-llama",
                 "decode": "1x32,4x32", "prefill": 32, "gemm_tokens": 64, "copy_mib": 32, "repeats": 3}}
# the CPU's stand-ins: each built-in's architecture at a size a test runs in seconds
TINY = {"tiny-qwen3": "qwen3-32b", "tiny-qwen3-moe": "qwen3-30b-a3b", "tiny-llama": "llama-3.1-8b"}


def tiny_config(name: str) -> ModelConfig:
    base = ModelConfig.builtin(TINY[name])
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048)
    if base.is_moe:
        small.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0, 1))
    return base.model_copy(update=small)


def model_config(name: str) -> ModelConfig:
    return tiny_config(name) if name in TINY else dummy_config(name)


def parse_models(spec: str) -> list[tuple[str, str]]:
    """NAME[:fp8],... -> [(name, quantization)]."""
    out = []
    for item in filter(str.strip, spec.split(",")):
        name, _, quant = item.strip().partition(":")
        if quant not in ("", "fp8"):
            raise argparse.ArgumentTypeError(f"--models: {item!r}: the only form after ':' is fp8")
        out.append((name, quant or "none"))
    if not out:
        raise argparse.ArgumentTypeError("--models wants NAME[:fp8][,...]")
    return out


# -- FP8 GEMMs -----------------------------------------------------------------------------------------

def projection_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of a layer's dense projections, fused as the engine fuses them."""
    h, i = config.hidden_size, config.intermediate_size
    return [("qkv_proj", config.q_size + 2 * config.kv_size, h), ("o_proj", h, config.q_size),
            ("gate_up_proj", 2 * i, h), ("down_proj", h, i)]


def fp8_linear(weight: torch.Tensor) -> fp8.Fp8Linear:
    """The engine's FP8 projection around `weight`, quantized per row."""
    q, scale = fp8.quantize_weight(weight)
    layer = fp8.Fp8Linear(weight.shape[1], weight.shape[0], bk=weight.shape[1]).to(weight.device)
    layer.weight.copy_(q)
    layer.weight_scale_inv.copy_(scale)
    return layer


def block_linear(weight: torch.Tensor) -> fp8.Fp8Linear:
    """The engine's FP8 projection around `weight` quantized in 128 x 128 blocks (an FP8 checkpoint's
    form), prepared as a load prepares it: the block-scaled GEMM where the device runs it."""
    n, k = weight.shape
    wq, rows = fp8_blockwise.quantize_blocks(weight)
    layer = fp8.Fp8Linear(k, n, bk=128).to(weight.device)
    layer.weight.copy_(wq)
    layer.weight_scale_inv.copy_(rows)
    layer.prepare()
    return layer


def fp8_gemms(config: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    gen, label = torch.Generator(device=device).manual_seed(0), str(dtype).removeprefix("torch.")
    rows, totals = [], {"float": 0.0, "scaled_mm": 0.0, "fp8_linear": 0.0}
    flops_all = 0.0
    # block-scaled (128 x 128) weights, an FP8 checkpoint's form: timed where the device runs their GEMM
    blocked = fp8_blockwise.works_on(device) and all(n % 128 == 0 == k % 128 for _, n, k in projection_shapes(config))
    if blocked:
        totals["block_linear"] = 0.0
    for name, n, k in projection_shapes(config):
        x = torch.randn(tokens, k, dtype=dtype, device=device, generator=gen)
        w = torch.randn(n, k, dtype=dtype, device=device, generator=gen).mul_(0.02)
        layer = fp8_linear(w)
        xq, sx = fp8.quantize_rows_dynamic(x)
        wq, sw = layer.weight, layer.weight_scale_inv.view(1, -1)
        runs = {"float": lambda: F.linear(x, w),
                "scaled_mm": lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=dtype),
                "fp8_linear": lambda: layer(x)}
        if blocked:
            block = block_linear(w)
            runs["block_linear"] = lambda: block(x)
        flops = 2.0 * tokens * n * k
        row = {"proj": name, "m": tokens, "n": n, "k": k}
        for key, run in runs.items():
            seconds = median(wall_seconds(run, device, repeats, warmup=2))
            totals[key] += seconds
            row[f"{key}_ms"], row[f"{key}_tflops"] = seconds * 1e3, flops / seconds / 1e12
        row["scaled_mm_x_float"] = row["float_ms"] / row["scaled_mm_ms"]
        row["fp8_linear_x_float"] = row["float_ms"] / row["fp8_linear_ms"]
        if blocked:
            row["block_linear_x_float"] = row["float_ms"] / row["block_linear_ms"]
        rows.append(row)
        flops_all += flops
        print(f"[models] {name} {tokens}x{n}x{k}: {label} {row['float_tflops']:.1f} TFLOP/s, _scaled_mm "
              f"{row['scaled_mm_tflops']:.1f} ({row['scaled_mm_x_float']:.2f}x), Fp8Linear {row['fp8_linear_tflops']:.1f} "
              f"({row['fp8_linear_x_float']:.2f}x)"
              + (f", block-scaled {row['block_linear_x_float']:.2f}x" if blocked else ""), flush=True)
        del x, w, layer, xq
    return {"tokens": tokens, "dtype": label, "rows": rows,
            "tflops": {key: flops_all / s / 1e12 for key, s in totals.items()},
            "scaled_mm_x_float": totals["float"] / totals["scaled_mm"],
            "fp8_linear_x_float": totals["float"] / totals["fp8_linear"],
            "block_linear_x_float": totals["float"] / totals["block_linear"] if blocked else None,
            "block_note": "" if blocked else "block-scaled GEMM not timed: this device does not run torch's "
                                             "1x128 by 128x128 recipe (engines.quant.fp8_blockwise.works_on)"}


# -- decode against the floor --------------------------------------------------------------------------

def quantize_fp8(config: ModelConfig):
    def transform(state: dict) -> dict:
        return fp8.quantize_state(config, state)
    return transform


class ExpertCounter:
    """Distinct experts each sparse layer's tokens picked in the forwards run while it is open."""

    def __init__(self, model: nn.Module):
        self.touched: dict[str, int] = {}
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules()
                        if isinstance(m, Experts)]

    def _hook(self, name: str):
        def record(module, args, output):
            self.touched[name] = int(torch.unique(args[2]).numel())
        return record

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def weight_bytes(model: nn.Module, touched: dict[str, int] | None) -> dict:
    """Bytes a decode step reads of the weights: every projection as stored (FP8 with its scales), the
    experts `touched` picked (all where None), the LM head (the embedding, when tied); not the
    embedding's rows nor the norms (a few KB)."""
    dense = experts = all_experts = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
            full = mod.gate_up_proj.nbytes + mod.down_proj.nbytes
            picked = mod.gate_up_proj.shape[0] if touched is None else touched.get(name, 0)
            experts += full * picked / mod.gate_up_proj.shape[0]
            all_experts += full
        elif isinstance(mod, (nn.Linear, fp8.Fp8Linear)):
            dense += sum(t.nbytes for t in (mod.weight, getattr(mod, "weight_scale_inv", None), mod.bias) if t is not None)
    if getattr(model, "tied_head", False):
        dense += model.embed_tokens.weight.nbytes
    return {"dense": float(dense), "experts": float(experts), "all_experts": float(all_experts)}


def kv_bytes(bench: Bench, batch: int, context: int) -> float:
    kv = bench.runner.kv.tensor
    c = bench.config
    return float(batch * (context + 1) * c.num_hidden_layers * 2 * c.kv_size * kv.element_size())


def model_decode(name: str, quant: str, dtype: torch.dtype, device: torch.device, prefill: int,
                 decode: list[tuple[int, int]], repeats: int, copy_bytes_s: float) -> dict:
    from estimator.ops import expected_experts  # deferred: the estimator, only for its routing arithmetic

    config = model_config(name)
    COUNTER.mark_warming()  # this model's warm-up compiles are its own, not compiles after a warm-up
    before = COUNTER.snapshot()
    bench = Bench(name, dtype, device, prefill, decode, config=config,
                  transform=quantize_fp8(config) if quant == "fp8" else None)
    out = {"model": name, "quantization": quant, "dtype": str(dtype).removeprefix("torch."),
           "params_b": config.num_parameters() / 1e9, "active_params_b": config.num_parameters(active=True) / 1e9,
           "moe": config.is_moe, "warm_up_s": bench.warm_up.get("seconds"), "decode": []}
    warmed = COUNTER.snapshot()
    chunks = bench.prefill_chunks(prefill)
    out["prefill"] = {"tokens": prefill,
                      "ms": median(wall_seconds(lambda: bench.runner.forward(chunks), device, max(3, repeats // 2))) * 1e3}
    graphs = bench.graphs()
    for batch, context in decode:
        chunks = bench.decode_chunks(batch, context)
        counter = ExpertCounter(bench.runner.model)
        try:
            eager = median(wall_seconds(lambda: bench.runner.forward(chunks), device, repeats, warmup=2))
        finally:
            counter.close()
        weights = weight_bytes(bench.runner.model, counter.touched if config.is_moe else None)
        floor = (weights["dense"] + weights["experts"] + kv_bytes(bench, batch, context)) / copy_bytes_s
        row = {"batch": batch, "context": context, "floor_ms": floor * 1e3, "eager_ms": eager * 1e3,
               "eager_over_floor": eager / floor, "weight_gb": (weights["dense"] + weights["experts"]) / 1e9}
        if config.is_moe:
            layers = len(counter.touched)
            row["experts_touched_per_layer"] = sum(counter.touched.values()) / max(1, layers)
            row["experts_uniform_per_layer"] = expected_experts(batch, config.num_experts, config.num_experts_per_tok)
            row["expert_gb_of_all"] = weights["experts"] / max(1.0, weights["all_experts"])
        if graphs.shape_for(chunks) is None:
            row["error"] = "no graph bucket for this step (runs eagerly)"
        else:
            seconds = median(wall_seconds(lambda: graphs.forward(chunks), device, repeats, warmup=2))
            row.update(graphs_ms=seconds * 1e3, over_floor=seconds / floor)
        out["decode"].append(row)
        print(f"[models] {name}{':' + quant if quant != 'none' else ''} decode {batch}x{context}: eager "
              f"{row['eager_ms']:.2f} ms, graphs " + (f"{row['graphs_ms']:.2f} ms = {row['over_floor']:.2f}x the floor "
              f"({row['floor_ms']:.2f} ms)" if "graphs_ms" in row else row["error"])
              + (f"; {row['experts_touched_per_layer']:.1f} experts a layer" if config.is_moe else ""), flush=True)
    graphs.release()
    end = COUNTER.snapshot()
    out["kernels"] = {"counted": end["installed"], "warm_up_compiles": warmed["total"] - before["total"],
                      "compiles_after_warm_up": end["while_serving"] - warmed["while_serving"],
                      "fallbacks": kernel_fallbacks.fallbacks()}
    return out


def goals(payload: dict) -> list[dict]:
    out = []
    gemm = payload.get("fp8_gemm")
    if gemm and payload["config"].get("gemm_model") == FP8_GOAL[1]:
        ratio = gemm["scaled_mm_x_float"]
        out.append({"goal": f"FP8 GEMM at {FP8_GOAL[1]} shapes ({gemm['tokens']} rows)", "measured": ratio,
                    "target": f">= {FP8_GOAL[0]:g}x {gemm['dtype']}",
                    "met": gemm["dtype"] == "bfloat16" and ratio >= FP8_GOAL[0], "unit": "x"})
    for m in payload.get("models", []):
        if m.get("model") != MOE_GOAL[1] or m.get("quantization") != "none":
            continue
        for row in m.get("decode", []):
            ratio = row.get("over_floor")
            out.append({"goal": f"{m['model']} decode {row['batch']}x{row['context']}, graphs on", "measured": ratio,
                        "target": f"<= {MOE_GOAL[0]:g}x active-bytes floor",
                        "met": ratio is not None and ratio <= MOE_GOAL[0], "unit": "x"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", type=parse_models, default=None,
                    help="NAME[:fp8],... built-in configs or config.json paths, dummy weights (default: per device)")
    ap.add_argument("--gemm-model", default=None, help="whose projection shapes the FP8 GEMMs take (default: per device)")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--decode", type=parse_decode, default=None, help="BATCHxCONTEXT,... (default: per device)")
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument("--gemm-tokens", type=int, default=None, help="rows of the FP8/bf16 GEMMs (default: per device)")
    add_run_args(ap, "models_gpu.json")
    args = ap.parse_args(argv)
    if not ready(args, "bench_models_gpu"):
        return 2
    from artifact.benchmarks.common import RESULTS, machine, print_table  # deferred: rich, only to report

    sizes, device = SIZES[args.device], torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    models = args.models or parse_models(sizes["models"])
    decode = args.decode or parse_decode(sizes["decode"])
    repeats = args.repeats or sizes["repeats"]
    gemm_model = args.gemm_model or sizes["gemm_model"]
    path = args.output or RESULTS / "models_gpu.json"
    payload = {"machine": machine(),
               "config": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "gemm_model": gemm_model,
                          "models": [f"{n}:{q}" for n, q in models], "threads": torch.get_num_threads()},
               "sections_done": [], "complete": False, "models": [], "errors": []}
    if device.type != "cuda":
        payload["note"] = "On a CPU: tiny stand-in configs; graphs re-run the captured body; no time here means anything."

    def done(section: str) -> None:
        payload["sections_done"].append(section)
        payload["goals"] = goals(payload)
        write_atomically(path, payload)

    stream = torch.cuda.Stream() if device.type == "cuda" else None  # graphs cannot be captured on the default stream
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        copy_bytes_s = copy_bandwidth(device, sizes["copy_mib"] << 20)
        payload["rates"] = {"copy_gbs": copy_bytes_s / 1e9, "copy_mib": sizes["copy_mib"]}
        print(f"[models] copy {copy_bytes_s / 1e9:.0f} GB/s", flush=True)
        done("rates")
        payload["fp8_gemm"] = fp8_gemms(model_config(gemm_model), args.gemm_tokens or sizes["gemm_tokens"], dtype,
                                        device, repeats)
        done("fp8_gemm")
        for name, quant in models:
            try:  # one model failing (a kernel this GPU cannot run, memory) leaves the others measured
                payload["models"].append(model_decode(name, quant, dtype, device, args.prefill_tokens or sizes["prefill"],
                                                      decode, repeats, copy_bytes_s))
            except Exception as exc:  # recorded in the JSON and the report, never silent
                payload["errors"].append({"model": f"{name}:{quant}", "error": f"{type(exc).__name__}: {exc}"})
                print(f"[models] {name}:{quant} failed: {type(exc).__name__}: {exc}", flush=True)
            gc.collect()  # the model's weights (65 GB for Qwen3-32B) go before the next one's are drawn
            if device.type == "cuda":
                torch.cuda.empty_cache()
            done(f"model {name}:{quant}")
        synchronize(device)
    payload["complete"] = True
    done("complete")
    g = payload["fp8_gemm"]
    rows = [{"what": f"{r['proj']} {r['m']}x{r['n']}x{r['k']} {g['dtype']}", "ms": r["float_ms"],
             "ratio": f"_scaled_mm {r['scaled_mm_x_float']:.2f}x, Fp8Linear {r['fp8_linear_x_float']:.2f}x {g['dtype']}"}
            for r in g["rows"]]
    for m in payload["models"]:
        for r in m["decode"]:
            rows.append({"what": f"{m['model']}{':fp8' if m['quantization'] == 'fp8' else ''} decode "
                                 f"{r['batch']}x{r['context']}", "ms": r.get("graphs_ms", r["eager_ms"]),
                         "ratio": f"{r['over_floor']:.2f}x floor" if "over_floor" in r else r.get("error", "-")})
    print_table(rows, ["what", "ms", "ratio"], title=f"models and formats on {payload['config']['device']} ({path})")
    for goal in payload["goals"]:
        measured = "-" if goal["measured"] is None else f"{goal['measured']:.2f}{goal['unit']}"
        print(f"goal {goal['goal']}: {measured} ({goal['target']}): "
              f"{'met' if goal['met'] else 'NOT met'}")
    for err in payload["errors"]:
        print(f"error {err['model']}: {err['error']}")
    return 1 if payload["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
