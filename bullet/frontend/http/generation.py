"""Running one request for an HTTP handler: submit, follow its outputs as text, and abort it in
both workers if the handler goes away (client disconnected, server shutting down)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from bullet.frontend.client import RequestState
from bullet.frontend.http.errors import APIError
from bullet.frontend.http.text import TextAssembler
from bullet.frontend.serving import ServingRuntime
from bullet.types.validation import RequestError
from engines.sampling_params import SamplingParams


@dataclass
class Update:
    state: RequestState
    delta: str  # text that became visible with this update
    text: str  # all visible text so far (final: trimmed at a stop string)

    @property
    def done(self) -> bool:
        return self.state.done


class ClientGone(Exception):
    pass


def check_fits(runtime: ServingRuntime, input_ids: list[int], params: SamplingParams, *,
               prompt_field: str = "text", max_field: str = "max_new_tokens") -> None:
    """400s that name the field the client sent: an empty or out-of-vocabulary prompt, one longer
    than the context, or a generation budget that cannot fit in the context after the prompt (a
    request for 10**9 tokens is a client bug, not something to run for minutes and cut short)."""
    config = runtime.model.config
    ctx, vocab, n = config.max_position_embeddings, config.vocab_size, len(input_ids)
    if n == 0:
        raise APIError(f"{prompt_field} is empty", param=prompt_field)
    if any(not 0 <= t < vocab for t in input_ids):
        raise APIError(f"{prompt_field}: token ids must lie in [0, {vocab})", param=prompt_field)
    if n >= ctx:
        raise APIError(f"{prompt_field}: the prompt has {n} tokens, but the model's context length is {ctx} "
                       f"tokens (prompt and output together)", param=prompt_field)
    if n + params.max_new_tokens > ctx:
        raise APIError(f"{max_field} is {params.max_new_tokens}, but the prompt's {n} tokens leave room for at most "
                       f"{ctx - n} new tokens in the model's context length of {ctx}", param=max_field)


def require_tokenizer(runtime: ServingRuntime, instead: str, param: str):
    """The server's tokenizer, or a 400 for a request that needs one on a server without one (dummy
    weights served without --tokenizer-path): `instead` says what the client can send instead."""
    if runtime.tokenizer is None:
        raise APIError(f"this server has no tokenizer (dummy weights without --tokenizer-path): {instead}", param=param)
    return runtime.tokenizer


def check_text_options(runtime: ServingRuntime, params: SamplingParams, stop_field: str = "stop") -> None:
    """Stop strings are matched on text: without a tokenizer they could never match (400, not ignored)."""
    if params.stop:
        require_tokenizer(runtime, "stop strings cannot be matched; give stop_token_ids instead", stop_field)


def check_batch_size(runtime: ServingRuntime, count: int, field: str) -> None:
    """400 for a request with more prompts (samples included) than the server ever holds at once:
    checked before tokenizing, so a body of 100,000 tiny prompts costs nothing."""
    cap = runtime.args.max_queued_requests
    if count > cap:
        raise APIError(f"the request holds {count} prompts (samples included), more than the server holds at once "
                       f"(--max-queued-requests {cap}); send it in parts", param=field)


async def submit_all(runtime: ServingRuntime, jobs: list[tuple], why: str = "another prompt of the request was "
                     "rejected") -> list[RequestState]:
    """Submit every (input ids, params, rid, group, priority) job of one HTTP request, or none: a rejected job,
    a full server or a cancelled handler (the client went away) aborts those already submitted."""
    check_batch_size(runtime, len(jobs), "text")
    cap, held = runtime.args.max_queued_requests, len(runtime.client.inflight)
    if held + len(jobs) > cap:
        raise APIError(f"the server is at capacity: {held} requests in flight (--max-queued-requests {cap}); "
                       "try again shortly", status=503, type_="server_error", headers={"Retry-After": "1"})
    states: list[RequestState] = []
    try:
        for job in jobs:
            states.append(await submit(runtime, *job))
    except BaseException:
        for st in states:
            await runtime.client.abort(st, why)
        raise
    return states


async def submit(runtime: ServingRuntime, input_ids: list[int], params: SamplingParams,
                 rid: str | None = None, group: str | None = None, priority: int | None = None) -> RequestState:
    if not runtime.healthy:
        raise APIError(f"the server is {runtime.status}; try again shortly", status=503, type_="server_error",
                       headers={"Retry-After": "5"})
    try:
        return await runtime.client.submit(input_ids, params, rid, group, priority or 0)
    except RequestError as exc:
        raise APIError(str(exc)) from exc


async def follow(runtime: ServingRuntime, state: RequestState) -> AsyncIterator[Update]:
    """Updates until the request finishes (with no text on a server without a tokenizer). Closing
    this generator early aborts the request."""
    asm = TextAssembler(runtime.tokenizer, state.params.stop, state.params.skip_special_tokens)
    try:
        async for st in runtime.client.stream(state):
            delta = asm.update(st.output_ids, st.finish_reason)
            yield Update(st, delta, asm.visible)
    finally:
        if not state.done:
            await runtime.client.abort(state, "the client disconnected")


async def run_to_completion(request: Request, updates: AsyncIterator[Update], poll_s: float = 0.5) -> Update:
    """The final update; aborts (raises ClientGone) if the HTTP client disconnects first."""

    async def drain() -> Update:
        last = None
        async for u in updates:
            last = u
        return last

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            await updates.aclose()


def latency(state: RequestState) -> float:
    return (state.finish_time or time.monotonic()) - state.arrival


async def run_all(request: Request, runtime: ServingRuntime, states: list[RequestState]) -> list[Update]:
    """Final updates of several requests; if the client disconnects, every one of them is aborted
    (not only the first to notice) before ClientGone is raised."""
    tasks = [asyncio.ensure_future(run_to_completion(request, follow(runtime, st))) for st in states]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:  # the first ClientGone ends the wait; stop the other watchers too
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in states:
            if not st.done:
                await runtime.client.abort(st, "the client disconnected")
        raise
