"""Clients that hang up: their requests must leave both workers (no queued request, empty batches)
and give back every KV page within a few seconds, whether they were streaming, waiting for a
non-streaming answer, or still queued for prefill."""

from __future__ import annotations

import time

import pytest

from tests.frontend.helpers import open_raw_request, read_events, summary, wait_idle

LONG = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0.8}
CLIENTS = 20


@pytest.fixture(autouse=True)
def starts_idle(server):
    wait_idle(server)
    yield
    assert server.get("/health")[0] == 200


def _wait_until(server, predicate, within_s: float = 60.0) -> dict:
    deadline = time.monotonic() + within_s
    state = server.state()
    while not predicate(state) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = server.state()
    assert predicate(state), summary(state)
    return state


@pytest.mark.parametrize("path,body", [
    ("/generate", lambda i: {"text": f"Story {i}: once upon a time", "stream": True, "sampling_params": LONG}),
    ("/v1/completions", lambda i: {"prompt": f"Story {i}: once upon a time", "stream": True,
                                   "max_tokens": 4000, "ignore_eos": True}),
    ("/v1/chat/completions", lambda i: {"messages": [{"role": "user", "content": f"Tell story {i}"}],
                                        "stream": True, "max_tokens": 4000, "ignore_eos": True}),
], ids=["generate", "completions", "chat"])
def test_streaming_clients_that_drop_mid_generation(server, path, body):
    socks = [open_raw_request(server, path, body(i)) for i in range(CLIENTS)]
    try:
        for s in socks:  # every client sees a few events: its request is decoding
            read_events(s, 3)
        running = server.state()
        assert running["inflight_requests"] == CLIENTS, summary(running)
        assert running["kv_pages_free"] < running["kv_pages_total"]
    finally:
        for s in socks:
            s.close()
    wait_idle(server, within_s=10)


def test_streaming_clients_that_drop_before_their_first_token(server):
    # a long prompt keeps prefill busy, so the others are still queued when their clients leave
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 100  # ~1000 tokens
    socks = [open_raw_request(server, "/generate", {"text": long_prompt + str(i), "stream": True,
                                                    "sampling_params": LONG}) for i in range(CLIENTS)]
    try:
        # all submitted, and the prefill worker holds some of them in its queue
        _wait_until(server, lambda s: s["inflight_requests"] == CLIENTS and s["prefill"]["queued_requests"] > 0)
    finally:
        for s in socks:
            s.close()
    wait_idle(server, within_s=10)


def test_non_streaming_client_that_drops_mid_request(server):
    sock = open_raw_request(server, "/generate", {"text": "Tell me a long story.", "sampling_params": LONG})
    try:
        # decoding has begun: the request holds pages and sits in the decode batch
        _wait_until(server, lambda s: s["decode"]["batch_size"] == 1 and s["inflight_requests"] == 1)
    finally:
        sock.close()
    wait_idle(server, within_s=10)


def test_non_streaming_batch_client_that_drops(server):
    sock = open_raw_request(server, "/v1/completions", {"prompt": ["Once", "Twice", "Thrice"], "n": 2,
                                                        "max_tokens": 4000, "ignore_eos": True})
    try:
        _wait_until(server, lambda s: s["decode"]["batch_size"] == 6)
    finally:
        sock.close()
    wait_idle(server, within_s=10)


def test_server_still_answers_after_the_disconnects(server):
    status, out = server.post("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2,
                                                                                "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2
