"""Per-kernel latencies of the served model, measured inside a real forward pass (the op sweep of
Bullet §3.2.4, on the CPU).

Timing a kernel alone in a loop would keep its weights in cache (a layer's QKV matrix is ~1 MB);
inside the model every layer streams its own weights from memory. So the sweep runs the model's
own layers in order, one kernel class at a time, with a clock read between kernels — the same
modules and functions `DecoderLayer.forward` calls, in the same order. The result is checked
against the real forward (`check_matches_model`): if the layer code changes, the check fails
instead of the sweep silently timing something else.

Kernel classes are those of `estimator.ops`; attention includes writing the new K/V (its bytes
are in the attention op's count)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from estimator.profiler.workload import DecodeCase, ModelBench, PrefillCase, require_dense_layers


def _timed_layer(layer, x: torch.Tensor, ctx, rope, k_cache, v_cache, attn_class: str,
                 out: dict[str, float], clock: Callable[[], float]) -> torch.Tensor:
    """`DecoderLayer.forward`, with the time of every kernel class added to `out`."""
    t0 = clock()
    h = layer.input_norm(x)
    t1 = clock()
    qkv = layer.qkv_proj(h)
    t2 = clock()
    q, k, v = layer.rotate(qkv, ctx, rope)
    t3 = clock()
    attn = layer.attend(q, k, v, ctx, k_cache, v_cache)
    t4 = clock()
    o = layer.o_proj(attn)
    t5 = clock()
    x = x + o
    t6 = clock()
    h = layer.post_attn_norm(x)
    t7 = clock()
    gate_up = layer.gate_up_proj(h)
    t8 = clock()
    a = layer.act(gate_up)
    t9 = clock()
    d = layer.down_proj(a)
    t10 = clock()
    x = x + d
    t11 = clock()
    for name, seconds in (("input_norm", t1 - t0), ("qkv_proj", t2 - t1), ("rope", t3 - t2), (attn_class, t4 - t3),
                          ("o_proj", t5 - t4), ("residual_add", t6 - t5 + t11 - t10), ("post_attn_norm", t7 - t6),
                          ("gate_up_proj", t8 - t7), ("act", t9 - t8), ("down_proj", t10 - t9)):
        out[name] += seconds
    return x


def sweep_clock(units: int) -> Callable[[], float]:
    """On one core the step is one thread (torch runs intra-op work inline), so that thread's CPU
    time is the kernel's time without the moments another process held the core. On several
    cores the work is spread over OpenMP threads: wall time (callers filter disturbed sweeps)."""
    return time.thread_time if units == 1 else time.perf_counter


@torch.inference_mode()
def kernel_times(bench: ModelBench, case: PrefillCase | DecodeCase,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, float], torch.Tensor]:
    """Seconds of one launch of each kernel class for `case` (layer kernels averaged over the
    layers; embedding, final norm and LM head once), and the logits, for `check_matches_model`."""
    require_dense_layers(bench.config)
    runner, model = bench.runner, bench.model
    decode = isinstance(case, DecodeCase)
    chunks = bench.chunks(case)
    t0 = clock()
    ids, ctx = runner._context(chunks)  # the runner's own context tables, as in a real step
    hidden = model.embed(ids)
    t1 = clock()
    totals: dict[str, float] = defaultdict(float)
    attn_class = "attn_decode" if decode else "attn_prefill"
    kv = runner.kv.tensor
    for layer in model.layers:
        hidden = _timed_layer(layer, hidden, ctx, model.rope, kv[layer.layer_id, 0], kv[layer.layer_id, 1],
                              attn_class, totals, clock)
    rows = [start + n - 1 for start, n in zip(ctx.q_starts, ctx.q_lens)]
    t2 = clock()
    normed = model.norm(hidden[rows])
    t3 = clock()
    # as `LlamaModel.compute_logits`: the int8 model's head is its own (untied, quantized) projection
    logits = (nn.functional.linear(normed, model.embed_tokens.weight) if model.tied_head else model.lm_head(normed)).float()
    t4 = clock()
    layers = model.num_layers
    times = {name: seconds / layers for name, seconds in totals.items()}
    # residual_add runs twice per layer: one launch is half the layer's total
    times["residual_add"] /= 2
    times.update(embedding=t1 - t0, final_norm=t3 - t2, lm_head=t4 - t3)
    return times, logits


def check_matches_model(bench: ModelBench, case: PrefillCase | DecodeCase) -> None:
    """The timed forward computes what the real one does (bit for bit: same ops, same order)."""
    _, logits = kernel_times(bench, case)
    reference = bench.runner.forward(bench.chunks(case)).last_logits
    if not torch.equal(logits, reference):
        raise AssertionError("the kernel sweep no longer follows DecoderLayer.forward: update local_kernels")
