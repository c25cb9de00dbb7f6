"""Runs a loop core's steps on the model, synchronously: the layers of a prefill batch, a decode
iteration, a hybrid batch — then the sampling that ends them. The core's callback runs before
`run_*` returns, with the seconds the model's layers took (what the policy observes).

On a GPU every step runs inside `stream.step()`: all its kernels (layers, KV writes, sampling, the
copies of its tables) launch on the stream the worker's partition restricts, and the step's time is
read after that stream has finished. Decode-only steps — a decode iteration, or a hybrid step whose
items are all one-token decodes — go through `decode_forward` (CUDA-graph replays where the
partition allows them, `bullet.partition.decode_graphs`); the rest run on the runner eagerly.

A decode or hybrid step whose batch has constrained requests, and a prefill batch's last layer group
(which samples the first tokens), computes their grammar masks in a helper thread while the layers
run (xgrammar fills a mask without holding the GIL, and the masks depend only on the tokens already
sampled): the step then waits only for what the mask work took beyond the layers."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

from bullet.loops.base import HybridItem
from bullet.partition.launch_stream import WorkerStream
from bullet.policies.views import InflightPrefill
from bullet.types.finish import FinishChecker
from bullet.types.request import Request
from bullet.workers.sampling import grammar_masks, record_prompt_logprobs, sample_next
from engines.grammar import Grammars
from engines.runner import LayerwiseState, ModelRunner, SeqChunk, StepOutput


@dataclass
class _Masks:
    """`grammar_masks` of a step's requests, once its layers have run (None: none constrained)."""

    ready: tuple[list, dict[int, str]] | None = None


class ModelExecutor:
    def __init__(self, runner: ModelRunner, finish: FinishChecker, stream: WorkerStream | None = None,
                 decode_forward: Callable[[list[SeqChunk]], StepOutput] | None = None,
                 grammars: Grammars | None = None):
        self.runner, self.finish = runner, finish
        self.grammars = grammars  # this process's compiled grammars (None: no tokenizer, none can be applied)
        self.stream = stream  # None: a CPU worker, nothing to bind
        self.decode_forward = decode_forward or runner.forward
        # a decode step runs layer by layer on the runner (a CPU worker), calling the core's
        # `between_layers` hook; with a `decode_forward` (a GPU worker) it is one call — a CUDA-graph
        # replay — and the hook is never called
        self.layerwise_decode = decode_forward is None
        self._mask_thread: ThreadPoolExecutor | None = None  # started by the first constrained decode step

    @contextmanager
    def _masks_beside(self, batch: Sequence[Request]):
        """The grammar masks of `batch`'s constrained requests, filled in the helper thread while the
        block runs; `.ready` holds them once it has ended (None: no request is constrained). The
        helper is done with the requests before the block's exit, even one that raised."""
        masks = _Masks()
        job: Future | None = None
        if any(r.params.constraint is not None for r in batch):
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            job = self._mask_thread.submit(grammar_masks, list(batch), self.grammars,
                                           self.runner.model.config.vocab_size)
        try:
            yield masks
        finally:
            masks.ready = job.result() if job is not None else None

    def _on_stream(self):
        return self.stream.step() if self.stream is not None else nullcontext()

    def _wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # kernels are launched asynchronously: the step ends when they do

    def run_prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None,
                    on_done: Callable[[float], None]) -> None:
        with self._on_stream():
            seconds = self._prefill(batch, layers, finishing)
        on_done(seconds)

    def _prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None) -> float:
        if batch.state is None:  # its first layer group (a preempted batch keeps its state meanwhile)
            # each request's tokens after its cached prefix, attending to the prefix's pages
            chunks = [SeqChunk(r.all_ids[start:start + n], start, r.page_table,
                               "all" if r.params.prompt_logprobs else "last")
                      for r, start, n in zip(batch.requests, batch.starts, batch.lengths)]
            batch.state = self.runner.start(chunks)
        state: LayerwiseState = batch.state
        t0 = time.perf_counter()
        # the last layer group samples the first tokens: their grammar masks (and a new grammar's
        # matcher) are made beside its layers
        with self._masks_beside(finishing or []) as masks:
            self.runner.run_layers(state, layers)
            self._wait()
        seconds = time.perf_counter() - t0
        if finishing is not None:
            out = self.runner.finish(state)
            rows = {id(r): i for i, r in enumerate(batch.requests)}
            for i, req in enumerate(batch.requests):
                if i in out.all_logits:
                    record_prompt_logprobs(req, 0, out.all_logits[i])
            if finishing:
                sample_next(out.last_logits[[rows[id(r)] for r in finishing]], list(finishing), self.finish,
                            self.grammars, masks.ready)
            batch.state = None
        return seconds

    def run_decode(self, batch: Sequence[Request], on_done: Callable[[float], None],
                   between_layers: Callable[[int], None] | None = None) -> None:
        with self._on_stream():
            chunks = [SeqChunk([r.output_ids[-1]], r.seq_len - 1, r.page_table) for r in batch]
            t0 = time.perf_counter()
            with self._masks_beside(batch) as masks:
                if between_layers is not None and self.layerwise_decode:
                    out = self.runner.forward(chunks, between_layers)
                else:
                    out = self.decode_forward(chunks)
            sample_next(out.last_logits, list(batch), self.finish, self.grammars, masks.ready)
            self._wait()
            seconds = time.perf_counter() - t0
        on_done(seconds)

    def run_hybrid(self, items: Sequence[HybridItem], on_done: Callable[[float], None]) -> None:
        with self._on_stream():
            seconds = self._hybrid(items)
        on_done(seconds)

    def _hybrid(self, items: Sequence[HybridItem]) -> float:
        chunks = [SeqChunk(i.req.all_ids[i.start : i.start + i.num_tokens], i.start, i.req.page_table, i.logits)
                  for i in items]
        t0 = time.perf_counter()
        decode_only = all(i.num_tokens == 1 and i.logits == "last" for i in items)
        sampled = [i.req for i in items if i.logits != "none" and i.sample]
        with self._masks_beside(sampled) as masks:
            out = self.decode_forward(chunks) if decode_only else self.runner.forward(chunks)
        rows, to_sample = 0, []
        for k, item in enumerate(items):
            if item.logits == "all":
                record_prompt_logprobs(item.req, item.start, out.all_logits[k])
            if item.logits != "none":
                if item.sample:
                    to_sample.append((item.req, rows))
                rows += 1
        if to_sample:  # in the order of `sampled`, which the masks follow
            sample_next(out.last_logits[[row for _, row in to_sample]], [r for r, _ in to_sample], self.finish,
                        self.grammars, masks.ready)
        self._wait()
        return time.perf_counter() - t0
