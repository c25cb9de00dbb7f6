"""The frontend's client of the two workers: submit tokenized requests to the prefill worker, merge the
outputs that stream back from both workers, abort, and fail everything when a worker dies.

Outputs carry the index of their first token, so updates from prefill (the first token) and decode
(the rest) can arrive in either order; a request is done once its finish reason has arrived and
every token before it has too."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from bullet.types.finish import Abort, FinishReason
from bullet.types.messages import (
    AbortRequest,
    FlushCache,
    GenerateRequest,
    MalformedMessage,
    OutputBatch,
    RequestOutput,
    decode,
    encode,
)
from bullet.shared.endpoints import Endpoints
from bullet.types.validation import RequestError, validate_prompt
from engines.sampling_params import SamplingParams

log = logging.getLogger("bullet.client")


@dataclass
class RequestState:
    rid: str
    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None  # per prompt position: [(token id, logprob), ...] or None
    group: str | None = None  # the client's rid that several samples (n > 1) share
    cached_tokens: int = 0  # prompt tokens the prefix cache held when it was prefilled
    cancelled: bool = False  # aborted at the client's request (/abort_request): not a server failure
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each output token
    _pending: dict[int, RequestOutput] = field(default_factory=dict)
    _final: tuple[int, FinishReason] | None = None  # (number of tokens, reason) once announced
    _updated: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_json(self) -> dict | None:
        """The finish reason in SGLang's JSON shape (the HTTP edge)."""
        return None if self.finish_reason is None else self.finish_reason.to_json()


class RuntimeClient:
    def __init__(self, vocab_size: int, max_context: int, pool_tokens: int, has_decode_worker: bool = True):
        self.vocab_size, self.max_context, self.pool_tokens = vocab_size, max_context, pool_tokens
        self.has_decode_worker = has_decode_worker  # False for the single-process chunked baseline
        self.ctx = zmq.asyncio.Context(1)
        self.inflight: dict[str, RequestState] = {}  # by the client's rid (unique among requests in flight)
        self.by_uid: dict[int, RequestState] = {}  # by the server's id, which outputs and aborts carry
        self._uids = itertools.count(1)
        self._rids = itertools.count(1)
        self._inbox = self._to_prefill = self._to_decode = None
        self._recv_task: asyncio.Task | None = None
        self.on_finish = None  # optional callback(RequestState), e.g. metrics

    async def start(self, endpoints: Endpoints) -> None:
        self._inbox = self.ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._inbox.bind(endpoints.frontend_in)
        self.connect_workers(endpoints)
        self._recv_task = asyncio.get_running_loop().create_task(self._receive())

    def connect_workers(self, endpoints: Endpoints) -> None:
        """(Re)connect to a worker incarnation; messages for a dead one are dropped, not resent."""
        for sock in (self._to_prefill, self._to_decode):
            if sock is not None:
                sock.close(linger=0)
        self._to_prefill = self.ctx.socket(zmq.PUSH)
        self._to_prefill.connect(endpoints.prefill_in)
        self._to_decode = None
        if self.has_decode_worker:
            self._to_decode = self.ctx.socket(zmq.PUSH)
            self._to_decode.connect(endpoints.decode_in)

    async def close(self) -> None:
        if self._recv_task:
            self._recv_task.cancel()
        for sock in (self._inbox, self._to_prefill, self._to_decode):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                     group: str | None = None, priority: int = 0) -> RequestState:
        validate_prompt(input_ids, params, self.vocab_size, self.max_context, self.pool_tokens)
        rid = rid or f"r{next(self._rids)}-{int(time.time() * 1000) % 10**8}"
        if rid in self.inflight:
            raise RequestError(f"request id {rid!r} is already in flight")
        state = RequestState(rid=rid, uid=next(self._uids), prompt_ids=list(input_ids), params=params,
                             arrival=time.monotonic(), group=group)
        self.inflight[rid] = state
        self.by_uid[state.uid] = state
        try:
            await self._to_prefill.send(encode(GenerateRequest(rid=rid, uid=state.uid, input_ids=state.prompt_ids,
                                                               params=params, arrival=state.arrival,
                                                               priority=priority)))
        except BaseException:  # cancelled (the client went away) or the socket failed: forget it, leak nothing
            self._finish(state, Abort(message="not submitted"))
            raise
        return state

    async def stream(self, state: RequestState) -> AsyncIterator[RequestState]:
        """Yields the (cumulative) state after each update, ending with the finished state."""
        while True:
            await state._updated.wait()
            state._updated.clear()
            yield state
            if state.done:
                return

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> RequestState:
        state = await self.submit(input_ids, params, rid)
        async for _ in self.stream(state):
            pass
        return state

    async def abort(self, state: RequestState, message: str = "aborted by the client") -> None:
        """Abort one request (addressed by the server's id: its rid may already name a newer one)."""
        if state.done:
            return
        # finished here first: a handler cancelled while the messages go out must not leave it in flight
        self._finish(state, Abort(message=message))
        msg = encode(AbortRequest(uid=state.uid, message=message))
        # both workers: the request may be queued, in prefill, in transit, or decoding
        await self._to_prefill.send(msg)
        if self._to_decode is not None:
            await self._to_decode.send(msg)

    async def flush_cache(self) -> None:
        """Ask the worker that owns the prefix cache (prefill, or the unified worker) to empty it."""
        await self._to_prefill.send(encode(FlushCache()))

    def find(self, rid: str) -> list[RequestState]:
        """The requests in flight that a client's rid names: its own, or its samples' (n > 1)."""
        return [s for s in self.inflight.values() if s.rid == rid or s.group == rid]

    async def cancel(self, states: list[RequestState], message: str) -> None:
        """Abort at the client's request: the requests end normally, with an abort finish reason."""
        for state in states:
            if not state.done:
                state.cancelled = True
                await self.abort(state, message)

    def fail_all(self, message: str) -> list[int]:
        """Finish every in-flight request with an error; returns their page-owner ids."""
        uids = [s.uid for s in self.inflight.values()]
        for state in list(self.inflight.values()):
            self._finish(state, Abort(message=message))
        return uids

    # -- outputs -------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            data = await self._inbox.recv()
            try:
                batch = decode(data)
                if not isinstance(batch, OutputBatch):
                    raise MalformedMessage(f"a {type(batch).__name__} is not an output batch")
                for out in batch.outputs:
                    state = self.by_uid.get(out.uid)
                    if state is not None:  # else: finished or failed already (e.g. a late abort ack)
                        self._merge(state, out)
            except (MalformedMessage, ValueError, IndexError, TypeError) as exc:
                # garbage (or a bug) on the socket must never stop the frontend from hearing outputs
                log.warning("dropped a malformed output message (%d bytes): %s", len(data), exc)

    def _merge(self, state: RequestState, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        if out.prompt_top_logprobs is not None:
            state.prompt_top_logprobs = out.prompt_top_logprobs
        if out.start == 0 and out.cached_tokens:  # the first prefill's (not a recomputation's)
            state.cached_tokens = out.cached_tokens
        if out.finish_reason is not None:
            state._final = (out.start + len(out.token_ids), out.finish_reason)
        if out.token_ids:
            state._pending[out.start] = out
        now = time.monotonic()
        while len(state.output_ids) in state._pending:
            part = state._pending.pop(len(state.output_ids))
            state.token_times.extend([now] * len(part.token_ids))
            state.output_ids.extend(part.token_ids)
            state.output_logprobs.extend(part.logprobs)
            state.output_top_logprobs.extend(part.top_logprobs)
        if state.output_ids and state.first_token_time is None:
            state.first_token_time = now
        if state._final is not None and len(state.output_ids) >= state._final[0]:
            self._finish(state, state._final[1])
        else:
            state._updated.set()

    def _finish(self, state: RequestState, reason: FinishReason) -> None:
        if state.done:
            return
        state.finish_reason, state.finish_time = reason, time.monotonic()
        self.inflight.pop(state.rid, None)
        self.by_uid.pop(state.uid, None)
        state._updated.set()
        if self.on_finish is not None:
            self.on_finish(state)
