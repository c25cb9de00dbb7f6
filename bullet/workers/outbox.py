"""A worker's outputs as messages: new tokens and finished requests to the frontend, prefilled
requests to decode. Each request remembers how many output tokens were already reported
(`Request.reported`), so every message carries exactly the new ones, from whichever worker."""

from __future__ import annotations

from typing import Sequence

from bullet.types.messages import Evict, GenerateRequest, Handoff, Recompute, Release, RequestOutput
from bullet.types.request import Request, Status
from bullet.workers.io import WorkerIO


def request_from_generate(msg: GenerateRequest) -> Request:
    return Request(rid=msg.rid, prompt_ids=msg.input_ids, params=msg.params, uid=msg.uid, arrival=msg.arrival,
                   priority=msg.priority)


def request_from_recompute(msg: Recompute) -> Request:
    """A request decode handed back: prefill computes its prompt and outputs again, from the start."""
    return Request(rid=msg.rid, prompt_ids=msg.prompt_ids, params=msg.params, uid=msg.uid, arrival=msg.arrival,
                   output_ids=list(msg.output_ids), output_logprobs=list(msg.output_logprobs),
                   output_top_logprobs=list(msg.output_top_logprobs), first_token_time=msg.first_token_time,
                   reported=msg.reported, priority=msg.priority)


def request_from_handoff(msg: Handoff) -> Request:
    """The request as decode continues it: prompt K/V in its pages, first token already reported."""
    return Request(rid=msg.rid, prompt_ids=msg.prompt_ids, params=msg.params, uid=msg.uid, arrival=msg.arrival,
                   output_ids=list(msg.output_ids), page_table=list(msg.page_table),
                   num_cached=len(msg.prompt_ids) + len(msg.output_ids) - 1,  # all but the token just sampled
                   shared_pages=msg.shared_pages, status=Status.RUNNING, output_logprobs=list(msg.output_logprobs),
                   output_top_logprobs=list(msg.output_top_logprobs), first_token_time=msg.first_token_time,
                   reported=len(msg.output_ids), priority=msg.priority)


class MessageOutbox:
    def __init__(self, io: WorkerIO, worker: str):
        self.io, self.worker = io, worker

    def output(self, req: Request) -> RequestOutput:
        start = req.reported
        req.reported = len(req.output_ids)
        return RequestOutput(
            uid=req.uid, start=start, token_ids=req.output_ids[start:], logprobs=req.output_logprobs[start:],
            top_logprobs=req.output_top_logprobs[start:],
            prompt_logprobs=req.prompt_logprobs if start == 0 and req.params.prompt_logprobs else None,
            prompt_top_logprobs=(req.prompt_top_logprobs if start == 0 and req.params.prompt_logprobs
                                 and req.params.top_logprobs_num else None),
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens, finish_reason=req.finish_reason, worker=self.worker)

    def handed_off(self, req: Request) -> None:
        # decode first: once the frontend has the first token, decode already has the request
        self.io.send_handoff(Handoff(
            rid=req.rid, uid=req.uid, prompt_ids=req.prompt_ids, output_ids=req.output_ids,
            page_table=req.page_table, params=req.params, arrival=req.arrival,
            first_token_time=req.first_token_time, output_logprobs=req.output_logprobs,
            output_top_logprobs=req.output_top_logprobs, shared_pages=req.shared_pages, priority=req.priority))
        self.io.send_outputs([self.output(req)])

    def tokens(self, reqs: Sequence[Request]) -> None:
        self.io.send_outputs([self.output(r) for r in reqs])

    def finished(self, req: Request) -> None:
        self.io.send_outputs([self.output(req)])

    def recompute(self, req: Request) -> None:
        self.io.send_recompute(Recompute(
            rid=req.rid, uid=req.uid, prompt_ids=req.prompt_ids, output_ids=req.output_ids, params=req.params,
            arrival=req.arrival, first_token_time=req.first_token_time, output_logprobs=req.output_logprobs,
            output_top_logprobs=req.output_top_logprobs, reported=req.reported, priority=req.priority))

    def release(self, req: Request) -> None:
        self.io.send_to_prefill(Release(uid=req.uid, token_ids=req.all_ids[:req.num_cached], page_table=req.page_table,
                                        shared_pages=req.shared_pages))

    def want_pages(self, num_pages: int) -> None:
        self.io.send_to_prefill(Evict(pages=num_pages))
