"""Runs a loop core's steps on the model, synchronously: the layers of a prefill batch, a decode
iteration, a hybrid batch — then the sampling that ends them. The core's callback runs before
`run_*` returns, with the seconds the model's layers took (what the policy observes)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from bullet.core.finish import FinishChecker
from bullet.core.request import Request
from bullet.loops.base import HybridItem
from bullet.schedulers.views import InflightPrefill
from bullet.workers.sampling import record_prompt_logprobs, sample_next
from engines.runner import LayerwiseState, ModelRunner, SeqChunk


class ModelExecutor:
    def __init__(self, runner: ModelRunner, finish: FinishChecker):
        self.runner, self.finish = runner, finish
        self._layers: LayerwiseState | None = None  # the in-flight prefill batch between layer groups
        self._batch: InflightPrefill | None = None

    def run_prefill(self, batch: InflightPrefill, layers: int, finishing: Sequence[Request] | None,
                    on_done: Callable[[float], None]) -> None:
        if batch is not self._batch or batch.layers_done == 0:
            chunks = [SeqChunk(r.prompt_ids, 0, r.page_table, "all" if r.params.prompt_logprobs else "last")
                      for r in batch.requests]
            self._layers, self._batch = self.runner.start(chunks), batch
        t0 = time.perf_counter()
        self.runner.run_layers(self._layers, layers)
        seconds = time.perf_counter() - t0
        if finishing is not None:
            out = self.runner.finish(self._layers)
            rows = {id(r): i for i, r in enumerate(batch.requests)}
            for i, req in enumerate(batch.requests):
                if i in out.all_logits:
                    record_prompt_logprobs(req, 0, out.all_logits[i])
            if finishing:
                sample_next(out.last_logits[[rows[id(r)] for r in finishing]], list(finishing), self.finish)
            self._layers = self._batch = None
        on_done(seconds)

    def run_decode(self, batch: Sequence[Request], on_done: Callable[[float], None]) -> None:
        chunks = [SeqChunk([r.output_ids[-1]], r.seq_len - 1, r.page_table) for r in batch]
        t0 = time.perf_counter()
        out = self.runner.forward(chunks)
        sample_next(out.last_logits, list(batch), self.finish)
        on_done(time.perf_counter() - t0)

    def run_hybrid(self, items: Sequence[HybridItem], on_done: Callable[[float], None]) -> None:
        chunks = [SeqChunk(i.req.all_ids[i.start : i.start + i.num_tokens], i.start, i.req.page_table, i.logits)
                  for i in items]
        t0 = time.perf_counter()
        out = self.runner.forward(chunks)
        rows, to_sample = 0, []
        for k, item in enumerate(items):
            if item.logits == "all":
                record_prompt_logprobs(item.req, item.start, out.all_logits[k])
            if item.logits != "none":
                if item.sample:
                    to_sample.append((item.req, rows))
                rows += 1
        if to_sample:
            sample_next(out.last_logits[[row for _, row in to_sample]], [r for r, _ in to_sample], self.finish)
        on_done(time.perf_counter() - t0)
