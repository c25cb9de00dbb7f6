"""A stream that fails while it is being produced ends with an error event, then `[DONE]` — never a
bare `[DONE]` that reads as an empty success (what a tokenizer-less server used to answer a streamed
request with: following the request raised inside a task, and the failure was swallowed).

The real-server cases (a worker that dies under a stream on each endpoint) are in
tests/launcher/test_worker_failures.py; here the two pieces that carry any other failure to the
client: `merged_updates` re-raises what following a request raised, `ending_with_done` turns it
into the event."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from bullet.frontend.client import RequestState, RuntimeClient
from bullet.frontend.http.errors import APIError
from bullet.frontend.http.streaming import DONE, ending_with_done, merged_updates, sse
from bullet.types.finish import Length
from engines.sampling_params import SamplingParams


async def collect(events) -> list:
    return [e async for e in events]


def payloads(events: list[str]) -> list:
    out = []
    for e in events:
        data = e.removeprefix("data: ").strip()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_failure_mid_stream_becomes_an_error_event_before_done():
    async def events():
        yield sse({"text": "partial"})
        raise RuntimeError("detokenizer exploded")

    got = payloads(asyncio.run(collect(ending_with_done(events()))))
    assert got[0] == {"text": "partial"} and got[-1] == "[DONE]"
    assert got[1]["error"]["code"] == 500 and got[1]["error"]["type"] == "server_error"
    assert got[1]["error"]["message"] == "internal error: RuntimeError: detokenizer exploded"


def test_an_api_error_keeps_its_status_and_a_clean_stream_just_ends():
    async def refused():
        raise APIError("this server has no tokenizer", status=400)
        yield  # an async generator

    async def fine():
        yield sse({"text": "all"})

    assert payloads(asyncio.run(collect(ending_with_done(refused())))) == [
        {"error": {"message": "this server has no tokenizer", "type": "invalid_request_error", "code": 400}}, "[DONE]"]
    assert asyncio.run(collect(ending_with_done(fine()))) == [sse({"text": "all"}), DONE]


def test_a_client_that_left_gets_nothing_more():
    async def cancelled():
        yield sse({"text": "a"})
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(collect(ending_with_done(cancelled())))


class FailingTokenizer:
    """A tokenizer whose decoding fails (a corrupt tokenizer file, a bug in a new one)."""

    def decode(self, ids, skip_special_tokens=True):
        raise ValueError(f"cannot decode {ids}")


def test_a_failure_following_one_request_reaches_the_stream():
    """What the handler's pump used to swallow: the merged updates raise it, and the stream reports it."""

    async def run():
        client = RuntimeClient(vocab_size=100, max_context=64, pool_tokens=64)
        runtime = SimpleNamespace(tokenizer=FailingTokenizer(), client=client)
        state = RequestState(rid="r", uid=1, prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=1), arrival=0.0)
        client.inflight[state.rid], client.by_uid[state.uid] = state, state
        state.output_ids.append(7)
        client._finish(state, Length(length=1))  # the update arrives; rendering it fails

        async def events():
            async for i, u in merged_updates(runtime, [state]):
                yield sse({"index": i, "text": u.text})

        return payloads(await collect(ending_with_done(events())))

    got = asyncio.run(run())
    assert got[-1] == "[DONE]" and len(got) == 2
    assert got[0]["error"]["message"].startswith("internal error: ValueError: cannot decode")
