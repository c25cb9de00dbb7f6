"""The per-kernel sweep on a GPU (Bullet §3.2.4): every kernel class of the served model, timed
with CUDA events on the share being profiled.

On the CPU the sweep reads a clock between the kernels of one forward pass (`kernel_timing`). On a
GPU kernels run asynchronously, so each class is timed on its own: the class's kernel launched once
per layer — each layer with its own weights, so nothing stays in L2 that would not in a real
step — between two events, divided by the layers. The inputs are the real step's: the runner's own
context tables and the tensors the layer before produced.

The steps below are `DecoderLayer.forward` cut at kernel-class boundaries (`layer_steps`); chained,
they must compute exactly what the layer does, which `check_steps_compose_layer` verifies — if the
layer code changes, the check fails instead of the sweep silently timing something else. RoPE runs
through the layer's `rotate` on the step's tables (or `RotaryEmbedding.rotate` on tables reserved
beforehand), so each class can also be captured as a CUDA graph (the timer may replay it: kernel
time without launch gaps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engines.model.attention import paged_attention, write_kv
from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, require_dense_layers

State = dict[str, torch.Tensor]
Step = Callable[[nn.Module, State], State]


@dataclass(frozen=True)
class ClassRun:
    """Launches one kernel class of `case` (once per layer, or once for the per-step classes):
    what the timer times. Named, so logs and test timers can tell the runs apart."""

    kernel_class: str
    case: PrefillCase | DecodeCase
    fn: Callable[[], object]

    def __call__(self) -> object:
        return self.fn()


def layer_steps(bench: ModelBench, ctx, attn_class: str) -> list[tuple[str, Step]]:
    """(kernel class, step) in the order `DecoderLayer.forward` runs them; a step maps the layer's
    tensors so far to the next ones. residual_add appears twice, as in the layer."""
    model, kv = bench.model, bench.runner.kv.tensor

    def input_norm(layer, s):
        return {**s, "h": layer.input_norm(s["x"])}

    def qkv_proj(layer, s):
        return {**s, "qkv": layer.qkv_proj(s["h"])}

    def rope(layer, s):  # the layer's own split and rotation (with a family's q/k norms: Qwen3)
        q, k, v = layer.rotate(s["qkv"], ctx, model.rope.rotate)
        return {**s, "q": q, "k": k, "v": v}

    def attention(layer, s):
        k_cache, v_cache = kv[layer.layer_id, 0], kv[layer.layer_id, 1]
        write_kv(k_cache, v_cache, s["k"], s["v"], ctx.slot_mapping)
        return {**s, "attn": paged_attention(s["q"], s["k"], s["v"], k_cache, v_cache, ctx, layer.scale)}

    def o_proj(layer, s):
        return {**s, "o": layer.o_proj(s["attn"].reshape(s["x"].shape[0], layer.q_size))}

    def add_attention(layer, s):
        return {**s, "x": s["x"] + s["o"]}

    def post_attn_norm(layer, s):
        return {**s, "h": layer.post_attn_norm(s["x"])}

    def gate_up_proj(layer, s):
        gate, up = layer.gate_up_proj(s["h"]).chunk(2, dim=-1)
        return {**s, "gate": gate, "up": up}

    def act(layer, s):
        return {**s, "a": nn.functional.silu(s["gate"]) * s["up"]}

    def down_proj(layer, s):
        return {**s, "d": layer.down_proj(s["a"])}

    def add_mlp(layer, s):
        return {**s, "x": s["x"] + s["d"]}

    return [("input_norm", input_norm), ("qkv_proj", qkv_proj), ("rope", rope), (attn_class, attention),
            ("o_proj", o_proj), ("residual_add", add_attention), ("post_attn_norm", post_attn_norm),
            ("gate_up_proj", gate_up_proj), ("act", act), ("down_proj", down_proj), ("residual_add", add_mlp)]


def _prepare(bench: ModelBench, case: PrefillCase | DecodeCase):
    chunks = bench.chunks(case)
    ids, ctx = bench.runner._context(chunks)  # the runner's own context tables, as in a real step
    bench.model.rope.reserve(int(ctx.positions.max()) + 1)  # once, outside any timed or captured run
    return chunks, ids, ctx


@torch.inference_mode()
def class_runs(bench: ModelBench, case: PrefillCase | DecodeCase) -> dict[str, list[ClassRun]]:
    """For each kernel class of `case`, the callables that launch it once per layer (two for
    residual_add), plus embedding, final norm and LM head once per step."""
    require_dense_layers(bench.config)
    model = bench.model
    _, ids, ctx = _prepare(bench, case)
    attn_class = "attn_decode" if isinstance(case, DecodeCase) else "attn_prefill"
    steps = layer_steps(bench, ctx, attn_class)
    state: State = {"x": model.embed(ids)}
    layer0 = model.layers[0]
    runs: dict[str, list[ClassRun]] = {}
    for name, step in steps:
        inputs = state  # what the layer had computed before this class: the class's real inputs

        def run(step=step, inputs=inputs):
            for layer in model.layers:
                step(layer, inputs)

        runs.setdefault(name, []).append(ClassRun(name, case, run))
        state = step(layer0, state)
    # the rows reaching the LM head, as an index on the device (a list index would copy it from the
    # host inside the timed region)
    rows = torch.tensor([start + n - 1 for start, n in zip(ctx.q_starts, ctx.q_lens)], device=ids.device)
    hidden = state["x"]
    normed = model.norm(hidden.index_select(0, rows))
    head = model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    runs["embedding"] = [ClassRun("embedding", case, lambda: model.embed(ids))]
    runs["final_norm"] = [ClassRun("final_norm", case, lambda: model.norm(hidden.index_select(0, rows)))]
    runs["lm_head"] = [ClassRun("lm_head", case, lambda: nn.functional.linear(normed, head).float())]
    return runs


PER_STEP = ("embedding", "final_norm", "lm_head")


@torch.inference_mode()
def op_times(bench: ModelBench, case: PrefillCase | DecodeCase, time_run: Callable[[ClassRun], float]) -> dict[str, float]:
    """Seconds of one launch of each kernel class (as `kernel_timing.kernel_times` reports them):
    `time_run(run)` is the timer, called inside the share being profiled."""
    layers = bench.model.num_layers
    times = {}
    for name, runs in class_runs(bench, case).items():
        seconds = [time_run(run) for run in runs]
        per_launch = [s if name in PER_STEP else s / layers for s in seconds]
        times[name] = sum(per_launch) / len(per_launch)
    return times


@torch.inference_mode()
def check_steps_compose_layer(bench: ModelBench, case: PrefillCase | DecodeCase) -> None:
    """The steps, chained on the first layer, compute what `DecoderLayer.forward` does, bit for bit."""
    require_dense_layers(bench.config)
    model = bench.model
    _, ids, ctx = _prepare(bench, case)
    attn_class = "attn_decode" if isinstance(case, DecodeCase) else "attn_prefill"
    x = model.embed(ids)
    layer = model.layers[0]
    state: State = {"x": x}
    for _, step in layer_steps(bench, ctx, attn_class):
        state = step(layer, state)
    kv = bench.runner.kv.tensor
    reference = layer(x, ctx, model.rope, kv[0, 0], kv[0, 1])
    if not torch.equal(state["x"], reference):
        raise AssertionError("the GPU kernel sweep no longer follows DecoderLayer.forward: update cuda_ops")
