"""A single-process engine: one scheduler decides each step's batch, the runner computes it, the
sampler picks tokens, the finish checker retires requests. The offline `bullet.LLM` and the
`chunked:<budget>` baseline server both drive this loop."""

from __future__ import annotations

import itertools

import torch

from bullet.finish import FinishChecker
from bullet.request import Request
from bullet.schedulers.hybrid import HybridScheduler, Scheduled
from bullet.token_step import record_prompt_logprobs, sample_next
from engines.runner import ModelRunner, SeqChunk
from engines.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot be served as given (the message says why)."""


def validate_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_context: int,
                    pool_tokens: int) -> None:
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must lie in [0, {vocab_size})")
    if len(prompt_ids) >= max_context:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the model's context length is {max_context}")
    if len(prompt_ids) + 1 > pool_tokens:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the KV pool holds {pool_tokens}")
    try:
        params.check_vocab(vocab_size)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: HybridScheduler, finish: FinishChecker):
        self.runner, self.scheduler, self.finish = runner, scheduler, finish
        self.vocab_size = runner.model.config.vocab_size
        self.requests: dict[str, Request] = {}
        self._rids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                    uid: int | None = None, arrival: float | None = None) -> Request:
        validate_prompt(prompt_ids, params, self.vocab_size, self.runner.max_context,
                        self.scheduler.allocator.total_pages * self.scheduler.allocator.page_size)
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = Request(rid=rid, prompt_ids=list(prompt_ids), params=params)
        if uid is not None:
            req.uid = uid
        if arrival is not None:
            req.arrival = arrival
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort(self, rid: str, message: str = "aborted") -> Request | None:
        req = self.requests.pop(rid, None)
        if req is not None and not req.finished:
            self.scheduler.release(req)
            req.finish({"type": "abort", "message": message})
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that produced a token or finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        chunks = [self._chunk(s) for s in batch]
        out = self.runner.forward(chunks)
        to_sample: list[tuple[Request, int]] = []
        done_now: list[Request] = []
        row = 0
        for i, (s, chunk) in enumerate(zip(batch, chunks)):
            req = s.req
            if chunk.logits == "all":
                record_prompt_logprobs(req, chunk.start, out.all_logits[i])
            req.num_cached += s.num_tokens
            if chunk.logits != "none":
                if req.num_cached == req.seq_len:
                    if req.params.max_new_tokens == 0:
                        done_now.append(req)
                    else:
                        to_sample.append((req, row))
                row += 1
        if to_sample:
            self._sample(out.last_logits, to_sample)
        for req in done_now:
            self._retire(req, {"type": "length", "length": 0})
        return [r for r, _ in to_sample] + done_now

    def _chunk(self, s: Scheduled) -> SeqChunk:
        req, start = s.req, s.req.num_cached
        completes = start + s.num_tokens == req.seq_len
        wants_all = req.params.prompt_logprobs and start < len(req.prompt_ids)
        mode = "all" if wants_all else ("last" if completes else "none")
        return SeqChunk(req.all_ids[start : start + s.num_tokens], start, req.page_table, mode)

    def _sample(self, logits: torch.Tensor, picks: list[tuple[Request, int]]) -> None:
        reqs = [r for r, _ in picks]
        for req in sample_next(logits[[i for _, i in picks]], reqs, self.finish):
            self._retire(req, req.finish_reason)

    def _retire(self, req: Request, reason: dict) -> None:
        self.scheduler.release(req)
        if not req.finished:
            req.finish(reason)
        self.requests.pop(req.rid, None)
