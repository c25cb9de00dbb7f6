"""Server-sent events for one or more requests, and the guarantee that a stream which ends early
(client gone, server stopping) leaves nothing running in the workers.

Starlette runs the body generator in a task that it cancels when the client disconnects. If that
happens before the generator has started (a client that hangs up right after sending), the
generator's own `finally` never runs; so the response itself aborts every unfinished request once
it is over, however it ended."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from bullet.http.generation import Update, follow
from bullet.runtime.client import RequestState


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], runtime, states: list[RequestState]):
        super().__init__(events, media_type="text/event-stream",
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
    """(index, update) of several requests in arrival order, until all have finished."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, st: RequestState) -> None:
        updates = follow(runtime, st)
        try:
            async for u in updates:
                await queue.put((i, u))
        finally:
            await updates.aclose()  # aborts the request if it has not finished
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(states)]
    remaining = len(tasks)
    try:
        while remaining:
            i, u = await queue.get()
            if u is None:
                remaining -= 1
            else:
                yield i, u
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
