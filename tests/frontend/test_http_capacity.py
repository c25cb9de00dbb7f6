"""A bounded server: `--max-queued-requests` caps the requests held at once (found by the fuzz
driver: one body with 80,000 tiny prompts queued them all, and the prefill worker spent so long
ordering its queue that it missed its heartbeat and was killed). Past the cap a request gets 503
with Retry-After and nothing is queued; a batch larger than the cap gets 400 before it is even
tokenized; when the held requests finish, requests are admitted again. Runs on the `secured`
server (cap 4)."""

from __future__ import annotations

import json
import socket

from tests.frontend.helpers import AUTH, MAX_QUEUED, open_raw_request, read_events, wait_idle
from tests.server_utils import assert_generates

HOLD = {"text": "Count slowly from one to one hundred:", "stream": True,
        "sampling_params": {"max_new_tokens": 90, "temperature": 0, "ignore_eos": True}}


def _response_head(sock: socket.socket) -> tuple[int, dict, dict]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, buf
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(rest[:length] or b"{}")


def test_a_batch_larger_than_the_cap_is_a_400(secured):
    for path, body in [("/generate", {"text": ["hi"] * (MAX_QUEUED + 1)}),
                       ("/generate", {"input_ids": [[1, 2]] * (MAX_QUEUED + 1)}),
                       ("/generate", {"text": "hi", "sampling_params": {"n": MAX_QUEUED + 1}}),
                       ("/v1/completions", {"prompt": ["hi"] * 3, "n": 2, "max_tokens": 1})]:
        status, err = secured.post(path, body)
        assert status == 400, (path, err)
        message = err["message"] if path.startswith("/v1/") else err["error"]["message"]
        assert "--max-queued-requests" in message, err
    assert secured.state()["inflight_requests"] == 0


def test_past_the_cap_a_request_gets_503_and_later_runs(secured):
    holders = [open_raw_request(secured, "/generate", HOLD, AUTH) for _ in range(MAX_QUEUED)]
    try:
        for sock in holders:  # all admitted and producing
            read_events(sock, 1)
        extra = open_raw_request(secured, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}, AUTH)
        status, headers, err = _response_head(extra)
        extra.close()
        assert status == 503, err
        assert headers.get("retry-after") and "at capacity" in err["error"]["message"], (headers, err)
        assert secured.state()["inflight_requests"] == MAX_QUEUED  # the refused one was never queued
    finally:
        for sock in holders:
            sock.close()  # hanging up aborts them
    wait_idle(secured, 30)
    assert_generates(secured, 2, text="hi")
