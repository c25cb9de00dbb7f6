"""Every Triton kernel variant a runner can launch, launched once before serving.

Triton compiles a kernel on the first launch of each variant (`engines.triton_compiles`): its
front end, LLVM and ptxas run on the host inside that launch, so inside a served step the compile
is a latency spike no scheduler predicted. The variants a runner's steps can reach are few and
known from its configuration:

* paged decode attention: one per split count (`TritonPagedKernels.split_buckets`: powers of two
  up to what its longest context and its SMs allow; the page table's width is not specialised);
* paged extend attention: 64- and 128-row query blocks (a chunk of up to 64 new tokens, or more),
  in its own step and as the chunk part of a mixed step (`paged_attention.split_mixed`, which
  also sends the decode rows to the decode kernel);
* the fused layer stages (RMSNorm, RoPE, SwiGLU): one each, whatever the step's size;
* the MoE experts: 16- and 64-row blocks (`triton_moe.block_rows`).

`warm_kernels` runs one small step for each through the runner itself, so every argument has
the layout a served step gives it (the model's q is a view of its RoPE output, a mixed step's
rows are slices of it, ...). Every step writes its tokens' K/V to one scratch page (repeated in
the page tables), which no request owns: the values computed mean nothing and are dropped. It
costs a dozen small steps. Whether it covered everything is measured on a GPU by the compile
counter (compiles after `mark_serving`), and on a CPU by the tests, which compare the launch keys
of every step a configuration can take with the keys of these."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from engines.runner import ModelRunner, SeqChunk

log = logging.getLogger("engines.kernel_warmup")
LONG_CHUNK = 65  # new tokens: past 64 the extend kernel takes 128-row query blocks


@dataclass
class WarmStep:
    what: str
    chunks: list[SeqChunk]
    splits: int | None = None  # decode split count forced for the step


@dataclass
class WarmReport:
    steps: list[str] = field(default_factory=list)
    splits: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"steps": len(self.steps), "split_counts": self.splits, "seconds": round(self.seconds, 3)}


def longest_context(runner: ModelRunner) -> int:
    """The most tokens one sequence's context can hold: the model's context or the whole pool."""
    return min(runner.max_context, runner.kv.num_slots)


def moe_prompt_tokens(runner: ModelRunner) -> int:
    """Tokens a step needs for the MoE kernels' large blocks (0: a dense model, or no kernels)."""
    top_k = getattr(runner.model.config, "num_experts_per_tok", 0)
    if not getattr(runner.model.config, "num_experts", 0) or not top_k:
        return 0
    try:
        from engines.model.triton_moe import SMALL_BLOCK_MAX_ROWS  # deferred: triton is optional
    except ImportError:
        return 0
    return SMALL_BLOCK_MAX_ROWS // top_k + 1


def warm_steps(runner: ModelRunner, scratch_page: int) -> list[WarmStep]:
    """The steps `warm_kernels` runs (see the module's docstring), each within the model's context."""
    ps, limit = runner.page_size, longest_context(runner)

    def chunk(new: int, start: int) -> SeqChunk:
        return SeqChunk([0] * new, start, [scratch_page] * -(-(start + new) // ps))

    if limit < 3:
        raise ValueError(f"a warm-up needs contexts of 3 tokens, the runner holds {limit}")
    long = min(LONG_CHUNK, limit - 1)
    prompt = min(max(long, moe_prompt_tokens(runner)), limit)
    steps = [WarmStep(f"prompt of {prompt} tokens", [chunk(prompt, 0)]),
             WarmStep("chunk of 2 after a prefix", [chunk(2, 1)]),
             WarmStep(f"chunk of {long} after a prefix", [chunk(long, 1)]),
             # a mixed step in both orders: the decode part and the chunk part each first once
             WarmStep("decode row, then a chunk", [chunk(1, 1), chunk(2, 1)]),
             WarmStep("chunk, then a decode row", [chunk(2, 1), chunk(1, 1)]),
             WarmStep(f"decode row beside a chunk of {long}", [chunk(1, 1), chunk(long, 1)]),
             # rows of one kind apart: that kind's q rows are gathered (a copy) instead of a slice
             WarmStep("decode rows apart", [chunk(1, 1), chunk(2, 1), chunk(1, 1)]),
             WarmStep("chunks apart", [chunk(2, 1), chunk(1, 1), chunk(2, 1)])]
    kernels = runner.kernels
    buckets = getattr(kernels, "split_buckets", None)
    if buckets is None or not hasattr(kernels, "forced_splits"):
        return steps + [WarmStep("decode", [chunk(1, 1)])]
    kv_heads = runner.kv.tensor.shape[2]
    for s in buckets(kv_heads, limit, runner.device):
        steps.append(WarmStep(f"decode, {s} split(s)", [chunk(1, 1)], s))
    return steps


def warm_kernels(runner: ModelRunner, scratch_page: int) -> WarmReport:
    """Run every warm-up step (`warm_steps`) on `runner`, on the caller's current stream; the
    scratch page must be one no request owns."""
    if not 0 <= scratch_page < runner.kv.num_slots // runner.page_size:
        raise ValueError(f"scratch page {scratch_page} is outside the KV pool")
    report, began = WarmReport(), time.perf_counter()
    for step in warm_steps(runner, scratch_page):
        forced = runner.kernels.forced_splits(step.splits) if step.splits is not None else nullcontext()
        with forced:
            runner.forward(step.chunks)
        report.steps.append(step.what)
        if step.splits is not None:
            report.splits.append(step.splits)
    if runner.device.type == "cuda":
        import torch

        torch.cuda.current_stream(runner.device).synchronize()  # compiled and run, not only queued
    report.seconds = time.perf_counter() - began
    log.info("kernel warm-up: %d steps in %.2f s (decode split counts %s)", len(report.steps), report.seconds,
             report.splits or "-")
    return report
