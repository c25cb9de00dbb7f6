"""Running one request for an HTTP handler: submit, follow its outputs as text, and abort it in
both workers if the handler goes away (client disconnected, server shutting down)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request

from bullet.engine import RequestError
from bullet.http.errors import APIError
from bullet.http.text import TextAssembler
from bullet.runtime.client import RequestState
from bullet.runtime.serving import ServingRuntime
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


async def submit(runtime: ServingRuntime, input_ids: list[int], params: SamplingParams,
                 rid: str | None = None) -> RequestState:
    if not runtime.healthy:
        raise APIError(f"the server is {runtime.status}; try again shortly", status=503, type_="server_error")
    try:
        return await runtime.client.submit(input_ids, params, rid)
    except RequestError as exc:
        raise APIError(str(exc)) from exc


async def follow(runtime: ServingRuntime, state: RequestState) -> AsyncIterator[Update]:
    """Updates until the request finishes. Closing this generator early aborts the request."""
    asm = TextAssembler(runtime.tokenizer, state.params.stop, state.params.skip_special_tokens)
    try:
        async for st in runtime.client.stream(state):
            delta = asm.update(st.output_ids, st.finish_reason)
            yield Update(st, delta, asm.visible)
    finally:
        if not state.done:
            await runtime.client.abort(state.rid, "the client disconnected")


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
