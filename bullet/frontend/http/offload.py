"""Work whose cost grows with the input — parsing a body, tokenizing a prompt, rendering a prompt's
log-probabilities as text — runs in a worker thread once the input is large, so that one big request
cannot stall the event loop and with it /health, every stream and every other client. (The fast
tokenizer releases the GIL; the JSON parser and the validators hand it back every few milliseconds:
measured here, the loop never waited more than ~30 ms while a thread encoded a 2 MB prompt or parsed
a 16 MB body.) Small inputs run inline: for them a thread hop costs more than the work itself."""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

T = TypeVar("T")

INLINE_LIMIT = 16 * 1024  # bytes, characters or tokens: well under a millisecond of work


async def sized(size: int, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), in a thread when `size` (the input's length) is over INLINE_LIMIT."""
    if size <= INLINE_LIMIT:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
