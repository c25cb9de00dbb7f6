"""The mixture-of-experts CPU path against a dense model of the same active parameters.

  python -m artifact.benchmarks.bench_moe [--dtype float32 bfloat16] [--threads 1 2] [--repeats 5] [--grouped] [--row-form]
                                         [--untiled] [--rowwise] [--against PATH] [--balanced-routing]

Two models with dummy weights, built from Hugging Face style configs through the engine's own config
and model code: a Qwen3-MoE (every layer sparse: `--experts` SwiGLU experts of width
`--moe-intermediate`, `--top-k` per token, picks renormalised) and a dense Qwen3 with the same
attention, hidden size, layers and vocabulary whose SwiGLU is `top_k x moe_intermediate` wide. A
token then computes with the same parameters in both (the same FLOPs), except the MoE's router, a
`hidden x experts` GEMM per layer that the dense model has no counterpart for: it is counted against
the MoE (the JSON gives its share of the active parameters: 0.8 % at the defaults).

The defaults scale Qwen3-30B-A3B (hidden 2048, 48 layers, 32 q heads and 4 KV heads of 128, 128
experts, top-8, expert width 768, vocabulary 151936) down to a size one run measures in a few
minutes on two cores, keeping its ratios: 128 experts and top-8 (so a batch touches as many distinct
experts), expert width / hidden 0.375 (384 / 1024), q width twice the hidden size and 8 q heads per
KV head (16 and 2 of 128), the MLP's active parameters twice the attention's, and an LM head of
~11 % of the active parameters (vocabulary 12288).

Each step runs through the engine's runner as a CPU worker builds it (`ModelRunner(model, pool)`,
its default attention path), on pages handed out in a shuffled order: prefill of one prompt of
`--prompt` tokens, and one decode step at each of `--batches` (every row `--context` tokens deep).
Rounds alternate the two models; the medians are reported. On one thread the clock is the thread's
CPU time (what other processes' load does not inflate); on several, wall time.

Per step it reports MoE / dense time and whether the goal (at most 1.5x) is met, beside the ratio of
the bytes the step reads (weights it touches plus the KV cache): a decode row reads its top-k
experts, as many bytes as the dense MLP, but a batch of rows picks up to `--experts` distinct ones —
counted per layer in an extra, untimed step. At decode the MoE's experts run in the C kernel
(`engines.model.cpu_gemv`); at prefill, in bfloat16 on a CPU with AMX, all of them in the same kernel
on the tiles, elsewhere the experts that few rows picked. `--grouped` also times the MoE with the kernel
off (`engines.model.moe.CPU_KERNEL_TOKENS = KERNEL_EXPERT_ROWS = TILE_EXPERT_ROWS = 0`: the grouped torch
path with its few-row forms), `--untiled` with only the tiles off (`TILE_EXPERT_ROWS = 0`), `--row-form`
with the kernel and the few-row forms off (also `COLUMN_ROWS`, `NATIVE_BF16_ROWS`, `WEIGHTS_FIRST_ROWS`:
every expert as x @ W^T through MKL/oneDNN), `--rowwise` with only `WEIGHTS_FIRST_ROWS` off, in the same
rounds; `--against PATH`
the MoE with another build of the C kernel (a source tree built with `python setup.py build_ext
--inplace`, e.g. a `git worktree` of an older commit), in the same rounds. `--balanced-routing` draws
each token's picks uniformly at random instead of taking the dummy router's. Writes
<results>/moe.json (with the CPU's vector flags, torch's version and the thread count; results dir:
BULLET_RESULTS_DIR or artifact/results) and <results>/moe.md (the table)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from artifact.benchmarks.common import kernel_build, load_kernel_build
from engines.kv_pool import KVPool
from engines.model import moe
from engines.model.build import build_model
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk
from engines.weights.dummy import dummy_weights

GOAL = 1.5  # MoE step time / dense step time, at most
PAGE_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# engines.model.moe's CPU forms of the experts: the C kernel's batch limit, the grouped path's few-row forms
KNOBS = ("CPU_KERNEL_TOKENS", "KERNEL_EXPERT_ROWS", "COLUMN_ROWS", "NATIVE_BF16_ROWS", "WEIGHTS_FIRST_ROWS",
         "TILE_EXPERT_ROWS")
# the MoE's other sides, timed in the same rounds when asked: name -> (flag, knobs set to 0, label)
OTHER_FORMS = {"moe_grouped": ("grouped", ("CPU_KERNEL_TOKENS", "KERNEL_EXPERT_ROWS", "TILE_EXPERT_ROWS"), "grouped path"),
               "moe_untiled": ("untiled", ("TILE_EXPERT_ROWS",), "without AMX tiles"),
               "moe_rows": ("row_form", KNOBS, "row form only"),
               "moe_against": ("against", (), "other kernel build"),
               "moe_rowwise": ("rowwise", ("WEIGHTS_FIRST_ROWS",), "bf16 experts row-wise")}


def configs(args) -> dict[str, ModelConfig]:
    """The MoE config and its dense twin (same attention, hidden, layers, vocabulary)."""
    common = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
              "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": False}
    sparse = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "intermediate_size": args.top_k * args.moe_intermediate, "num_experts": args.experts,
              "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_intermediate,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], **common}
    dense = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
             "intermediate_size": args.top_k * args.moe_intermediate, **common}
    return {"moe": ModelConfig.from_hf_dict(sparse, "moe"), "dense": ModelConfig.from_hf_dict(dense, "dense")}


class Side:
    """One model and its runner; steps return their time in seconds."""

    def __init__(self, config: ModelConfig, state: dict, args, knobs: dict | None = None):
        pages = max(-(-args.prompt // PAGE_SIZE), max(args.batches) * -(-(args.context + 1) // PAGE_SIZE)) + 1
        self.config = config
        self.runner = ModelRunner(build_model(config, state), KVPool(config, pages, PAGE_SIZE, state["norm.weight"].dtype))
        self.pages = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).tolist()
        gen = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(100, config.vocab_size, (args.prompt,), generator=gen).tolist()
        self.tokens = torch.randint(100, config.vocab_size, (max(args.batches),), generator=gen).tolist()
        self.context = args.context
        # the experts' CPU forms (engines.model.moe), as this side runs them
        self.knobs = knobs or {k: getattr(moe, k) for k in KNOBS}
        self.build = None  # another build of the C kernel this side runs (`--against`), or this tree's
        self.balanced = args.balanced_routing

    def shared(self, knobs: dict) -> "Side":
        """The same model and pool, its experts run in other forms ({knob: 0}: off)."""
        twin = object.__new__(Side)
        twin.__dict__.update(self.__dict__, knobs=knobs)
        return twin

    def chunks(self, step: str, arg: int) -> list[SeqChunk]:
        if step == "prefill":
            return [SeqChunk(self.prompt[:arg], 0, self.pages[: -(-arg // PAGE_SIZE)])]
        need = -(-(self.context + 1) // PAGE_SIZE)
        return [SeqChunk([self.tokens[i]], self.context, self.pages[i * need : (i + 1) * need]) for i in range(arg)]

    def run(self, step: str, arg: int) -> float:
        """One step (a decode step's rows sit on context the pool's pages hold: its values do not
        change the work)."""
        chunks, clock = self.chunks(step, arg), _clock()
        kept = {k: getattr(moe, k) for k in KNOBS}
        for k, v in self.knobs.items():
            setattr(moe, k, v)
        try:
            with kernel_build(self.build) if self.build is not None else contextlib.nullcontext(), \
                    balanced_routing(self.balanced):
                t = clock()
                self.runner.forward(chunks)
                return clock() - t
        finally:
            for k, v in kept.items():
                setattr(moe, k, v)

    def experts_touched(self, step: str, arg: int) -> list[int]:
        """Distinct experts each sparse layer ran in one (untimed) step; [] for the dense model."""
        seen: list[int] = []
        hooks = [m.register_forward_pre_hook(lambda _m, a: seen.append(int(a[2].unique().numel())))
                 for m in self.runner.model.modules() if isinstance(m, moe.Experts)]
        try:
            with balanced_routing(self.balanced):
                self.runner.forward(self.chunks(step, arg))
        finally:
            for h in hooks:
                h.remove()
        return seen


@contextlib.contextmanager
def balanced_routing(enabled: bool):
    """`--balanced-routing`: the router's logits replaced by seeded standard normal draws, so each token
    picks top-k experts uniformly at random — what a trained router's load balancing aims for. The
    dummy router does not: its logits share the hidden states' common direction, and a 512-token prompt
    concentrates on ~53 experts per layer. The same draws in every call, so every side sees the same
    routing."""
    if not enabled:
        yield
        return
    real = moe.route

    def route(logits, top_k, renormalize):
        draws = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
        return real(draws.to(logits.dtype), top_k, renormalize)

    moe.route = route
    try:
        yield
    finally:
        moe.route = real


def _clock():
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def steps(args) -> list[tuple[str, str, int]]:
    return [(f"prefill_{args.prompt}", "prefill", args.prompt)] + [(f"decode_b{b}", "decode", b) for b in args.batches]


def step_bytes(config: ModelConfig, step: str, arg: int, touched: list[int], elem: int, context: int) -> float:
    """Bytes a step reads: attention projections, the MLP weights it touches (the dense MLP, or the
    router and the experts some row picked), the LM head, and the KV cache attention reads."""
    h, layers = config.hidden_size, config.num_hidden_layers
    attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
    if config.is_moe:
        mlp = sum(h * config.num_experts + n * 3 * h * config.moe_intermediate_size for n in touched)
    else:
        mlp = layers * 3 * h * config.intermediate_size
    rows = arg if step == "decode" else 0
    kv = rows * (context + 1) * layers * 2 * config.kv_size * elem  # a prefill reads its own K/V as it computes them
    return float((layers * attention + mlp + config.vocab_size * h) * elem + kv)


def measure(sides: dict[str, Side], args, dtype_name: str) -> list[dict]:
    elem = torch.tensor([], dtype=DTYPES[dtype_name]).element_size()
    rows = []
    for key, step, arg in steps(args):
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for side in sides.values():
            side.run(step, arg)  # warm-up
        for r in range(args.repeats):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                samples[name].append(sides[name].run(step, arg))
        touched = sides["moe"].experts_touched(step, arg)
        moe_ms, dense_ms = (statistics.median(samples[n]) * 1e3 for n in ("moe", "dense"))
        bytes_ = {n: step_bytes(s.config, step, arg, touched if n == "moe" else [], elem, args.context)
                  for n, s in sides.items()}
        ratio = moe_ms / dense_ms
        before = {}
        for name in OTHER_FORMS:
            if name in sides:
                other_ms = statistics.median(samples[name]) * 1e3
                before |= {f"{name}_ms": other_ms, f"{name}_ratio": other_ms / dense_ms}
        rows.append({"dtype": dtype_name, "threads": torch.get_num_threads(), "step": key, "moe_ms": moe_ms,
                     "dense_ms": dense_ms, "ratio": ratio, "goal_met": ratio <= GOAL, **before,
                     "experts_touched_per_layer": statistics.mean(touched),
                     "bytes_ratio": bytes_["moe"] / bytes_["dense"], "moe_bytes": bytes_["moe"],
                     "dense_bytes": bytes_["dense"],
                     "samples_ms": {n: [s * 1e3 for s in v] for n, v in samples.items()}})
        print(f"[bench_moe] {dtype_name} {torch.get_num_threads()}t {key}: moe {moe_ms:.1f} ms, dense "
              f"{dense_ms:.1f} ms, x{ratio:.2f} (bytes x{rows[-1]['bytes_ratio']:.2f})"
              + "".join(f"; {label} {before[f'{n}_ms']:.1f} ms, x{before[f'{n}_ratio']:.2f}"
                        for n, (_, _, label) in OTHER_FORMS.items() if n in sides),
              flush=True)
    return rows


def active_shares(cfg: ModelConfig) -> dict:
    active = cfg.num_parameters(active=True) - cfg.vocab_size * cfg.hidden_size  # the embedding computes nothing
    router = cfg.num_hidden_layers * cfg.hidden_size * cfg.num_experts
    return {"active_params": active, "router_params": router, "router_share": router / active,
            "total_params": cfg.num_parameters()}


def markdown(rows: list[dict]) -> str:
    others = [(n, label) for n, (_, _, label) in OTHER_FORMS.items() if rows and all(f"{n}_ms" in r for r in rows)]
    head = "| dtype | threads | step | MoE ms | dense ms | MoE / dense | goal <= 1.5x | experts / layer | bytes MoE / dense |"
    lines = [head + "".join(f" {label} ms | its MoE / dense |" for _, label in others), "|---" * (9 + 2 * len(others)) + "|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['threads']} | {r['step']} | {r['moe_ms']:.1f} | {r['dense_ms']:.1f} | "
                     f"{r['ratio']:.2f} | {'met' if r['goal_met'] else 'NOT met'} | "
                     f"{r['experts_touched_per_layer']:.1f} | {r['bytes_ratio']:.2f} |"
                     + "".join(f" {r[f'{n}_ms']:.1f} | {r[f'{n}_ratio']:.2f} |" for n, _ in others))
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch thread counts, each measured")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per model and step (medians reported)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=12288)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384, help="expert width; the dense MLP is top-k times it")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=256, help="tokens each decode row attends over")
    ap.add_argument("--grouped", action="store_true",
                    help="also time the MoE with the C kernel off (moe.CPU_KERNEL_TOKENS = moe.KERNEL_EXPERT_ROWS "
                         "= moe.TILE_EXPERT_ROWS = 0): every expert on the grouped torch path, in the same rounds")
    ap.add_argument("--untiled", action="store_true",
                    help="also time the MoE with its prefill's experts off the AMX tiles (moe.TILE_EXPERT_ROWS = 0; "
                         "the same as the MoE side where the CPU has no AMX or the dtype is float32), in the same rounds")
    ap.add_argument("--row-form", action="store_true",
                    help="also time the MoE with the C kernel and the grouped path's few-row forms off (every "
                         "expert as x @ W^T through MKL/oneDNN: moe.CPU_KERNEL_TOKENS = moe.KERNEL_EXPERT_ROWS = moe.COLUMN_ROWS = "
                         "moe.NATIVE_BF16_ROWS = moe.WEIGHTS_FIRST_ROWS = moe.TILE_EXPERT_ROWS = 0), in the same rounds")
    ap.add_argument("--balanced-routing", action="store_true",
                    help="the MoE's picks drawn uniformly at random per token (seeded; a trained router's balance) "
                         "instead of the dummy router's, which concentrates a 512-token prompt on ~53 of 128 experts per layer")
    ap.add_argument("--rowwise", action="store_true",
                    help="also time the MoE with moe.WEIGHTS_FIRST_ROWS = 0 (on a CPU with AMX, bfloat16 experts "
                         "of 5-256 rows as x @ W^T instead of weights-first), in the same rounds")
    ap.add_argument("--against", metavar="PATH",
                    help="also time the MoE with another build of the C kernel, in the same rounds: a source tree "
                         "built with `python setup.py build_ext --inplace` (e.g. a `git worktree` of an older "
                         "commit), or its engines/_cpu_gemv*.so")
    ap.add_argument("--name", default="moe", help="results file stem")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    from artifact.benchmarks.bench_llamacpp import cpu_flags  # deferred: the artifact's helpers, not the engine's
    from artifact.benchmarks.common import RESULTS, print_table, write_results

    cfgs = configs(args)
    rows: list[dict] = []
    for dtype_name in args.dtype:
        # the same values in both dtypes: fp32 draws (engines.weights.dummy), cast
        sides = {name: Side(cfg, dummy_weights(cfg, DTYPES[dtype_name]), args) for name, cfg in cfgs.items()}
        for name, (flag, off, _) in OTHER_FORMS.items():
            if getattr(args, flag):
                sides[name] = sides["moe"].shared({**sides["moe"].knobs, **{k: 0 for k in off}})
        if args.against:
            sides["moe_against"].build = load_kernel_build(args.against)
        for threads in args.threads:
            torch.set_num_threads(threads)
            rows += measure(sides, args, dtype_name)
        del sides
    meta = {"cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": args.threads, "goal": GOAL,
            "configs": {n: c.model_dump(mode="json") for n, c in cfgs.items()}, "moe_params": active_shares(cfgs["moe"]),
            "dense_active_params": cfgs["dense"].num_parameters() - cfgs["dense"].vocab_size * args.hidden,
            "args": vars(args), "results": rows}
    path = write_results(args.name, meta)
    (RESULTS / f"{args.name}.md").write_text(markdown(rows))
    print_table([{**r, "goal": "met" if r["goal_met"] else "NOT met"} for r in rows],
                ["dtype", "threads", "step", "moe_ms", "dense_ms", "ratio", "goal", "experts_touched_per_layer",
                 "bytes_ratio"] + [f"{n}_{c}" for n, (flag, _, _) in OTHER_FORMS.items() if getattr(args, flag)
                                   for c in ("ms", "ratio")],
                title=f"MoE vs dense of the same active parameters ({path})")
    return rows


if __name__ == "__main__":
    main()
