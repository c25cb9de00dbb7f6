"""Server-sent events for one or more requests, and two guarantees: a stream which ends early
(client gone, server stopping) leaves nothing running in the workers, and a stream whose request
failed says so — it never ends with a bare `[DONE]`.

Starlette runs the body generator in a task that it cancels when the client disconnects. If that
happens before the generator has started (a client that hangs up right after sending), the
generator's own `finally` never runs; so the response itself aborts every unfinished request once
it is over, however it ended.

A request the server failed (a worker died or its step raised) ends with the endpoint's own error
event. Anything else that goes wrong while the events are produced — an exception in the handler,
in detokenizing, in following a request — ends the stream with an error event too, in the shape
SGLang and the OpenAI clients read (`data: {"error": {"message", "type", "code"}}`), then `[DONE]`;
the status line was sent long before, so this event is the only way the client can learn it."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from bullet.frontend.client import RequestState
from bullet.frontend.http.errors import APIError, stream_error_event
from bullet.frontend.http.generation import Update, follow

log = logging.getLogger("bullet.http")


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


async def ending_with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; a failure while producing them becomes an error event before it."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except APIError as exc:
        yield sse(stream_error_event(exc.message, exc.status))
    except Exception as exc:  # not CancelledError (the client left): nobody would read the event
        log.exception("a streamed response failed")
        yield sse(stream_error_event(f"internal error: {type(exc).__name__}: {exc}", 500))
    yield DONE


class EventStream(StreamingResponse):
    """`events` (without the final `[DONE]`, which this adds) as server-sent events."""

    def __init__(self, events: AsyncIterator[str], runtime, states: list[RequestState]):
        super().__init__(ending_with_done(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.runtime, self.states = runtime, states

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for st in self.states:
                if not st.done:
                    await self.runtime.client.abort(st, "the client disconnected")


async def merged_updates(runtime, states: list[RequestState]) -> AsyncIterator[tuple[int, Update]]:
    """(index, update) of several requests in arrival order, until all have finished. If following
    one of them fails, that failure is raised here (the others are aborted on the way out)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, st: RequestState) -> None:
        updates = follow(runtime, st)
        ended: BaseException | None = None
        try:
            async for u in updates:
                await queue.put((i, u))
        except Exception as exc:
            ended = exc
        finally:
            await updates.aclose()  # aborts the request if it has not finished
            queue.put_nowait((i, ended))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(states)]
    remaining = len(tasks)
    try:
        while remaining:
            i, u = await queue.get()
            if isinstance(u, Update):
                yield i, u
                continue
            remaining -= 1
            if u is not None:
                raise u
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
