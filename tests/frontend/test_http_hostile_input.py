"""Bodies built to hurt the server (issue 11, item 3), each against a real server: a lone UTF-16
surrogate, JSON nested thousands deep, bodies over the size limit (declared or chunked), and a
multi-megabyte prompt that must not stall the event loop. Each is a 4xx that says what is wrong,
in the path's error shape, and the server stays healthy with the same two workers.

Also issue 11, item 8: a rid whose request was just aborted can be reused at once."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.frontend.helpers import API_KEY, BODY_LIMIT, open_raw_request, read_events, wait_idle
from tests.server_utils import assert_generates

NESTED = b"[" * 5000 + b"]" * 5000


def healthy_and_same_workers(server, pids) -> None:
    assert server.get("/health")[0] == 200
    state = server.state()
    assert state["worker_pids"] == pids and state["worker_restarts"] == 0
    assert_generates(server, 2, text="1, 2, 3,")


@pytest.mark.parametrize("path,body", [
    ("/generate", rb'{"text": "Hi \ud800", "sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", rb'{"text": "Hi \udc00 there"}'),
    ("/generate", rb'{"text": ["fine", "Hi \ud800\u0041"]}'),
    ("/v1/completions", rb'{"prompt": "Hi \ud800", "max_tokens": 2}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "Hi \ud800"}], "max_tokens": 2}'),
], ids=["native-high", "native-low", "native-batch-item", "completion", "chat"])
def test_lone_surrogate_is_a_400(server, path, body):
    pids = server.worker_pids()
    status, err = server.post(path, body)
    assert status == 400, err
    message = err["message"] if path.startswith("/v1/") else err["error"]["message"]
    assert "surrogate" in message, err
    healthy_and_same_workers(server, pids)


def test_a_valid_surrogate_pair_is_text(server):
    """The escape for an emoji (a high and a low surrogate together) is fine."""
    status, out = server.post("/generate", rb'{"text": "Hi \ud83d\ude00", "sampling_params": {"max_new_tokens": 1}}')
    assert status == 200, out


def test_invalid_utf8_is_a_400(server):
    status, err = server.post("/generate", b'{"text": "Hi \xff\xfe"}')
    assert status == 400 and "JSON" in err["error"]["message"], err


@pytest.mark.parametrize("path,body", [
    ("/generate", NESTED),
    ("/generate", b'{"text": "hi", "sampling_params": {"stop": ' + NESTED + b"}}"),
    ("/v1/completions", b'{"prompt": ' + NESTED + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + NESTED + b"}]}"),
], ids=["native-top", "native-field", "completion", "chat"])
def test_deep_nesting_is_a_400(server, path, body):
    pids = server.worker_pids()
    status, err = server.post(path, body)
    assert status == 400, err
    message = err["message"] if path.startswith("/v1/") else err["error"]["message"]
    assert "nested too deeply" in message, err
    healthy_and_same_workers(server, pids)


# -- the body-size limit (the secured server runs with --max-request-body-bytes BODY_LIMIT) -------

def raw_response(sock: socket.socket, timeout: float = 30) -> tuple[int, dict]:
    """Status and JSON body of the one response on a raw socket."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(head.split()[1]), json.loads(rest[:length])


def send_head(server, path: str, headers: dict) -> socket.socket:
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {API_KEY}\r\n{extra}\r\n".encode())
    return sock


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_declared_length_over_the_limit_is_refused_before_the_body(secured, path):
    """413 answers the headers alone: not a byte of the (announced) body is ever sent."""
    with send_head(secured, path, {"Content-Length": str(BODY_LIMIT + 1)}) as sock:
        status, err = raw_response(sock)
    assert status == 413, err
    message = err["message"] if path.startswith("/v1/") else err["error"]["message"]
    assert str(BODY_LIMIT) in message and "--max-request-body-bytes" in message, err


def test_chunked_body_over_the_limit_is_cut_off(secured):
    """No length declared: the body is counted as it arrives, and the read that crosses the limit
    ends it with 413 (the test sends exactly one byte past the limit, then waits for the answer)."""
    with send_head(secured, "/generate", {"Transfer-Encoding": "chunked"}) as sock:
        piece, sent = b"x" * 65536, 0
        while sent <= BODY_LIMIT:
            part = piece[: BODY_LIMIT + 1 - sent]
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sent += len(part)
        status, err = raw_response(sock)
    assert status == 413 and str(BODY_LIMIT) in err["error"]["message"], err
    assert secured.get("/health")[0] == 200


def test_body_just_under_the_limit_is_read(secured):
    """The limit is on size only: a body below it is parsed as usual (here: a 400 for its content)."""
    text = "hello world " * ((BODY_LIMIT - 100) // 12)
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()
    assert len(body) <= BODY_LIMIT
    status, err = secured.post("/generate", body)
    assert status == 400 and "context length" in err["error"]["message"], err


# -- a big prompt is tokenized off the event loop ----------------------------------------------

def test_health_answers_while_a_multi_megabyte_prompt_is_tokenized(server):
    """Before the fix, the frontend tokenized on its event loop: a 10 MB body held /health for 25 s.
    Here 6 MB of text (twelve 0.5 MB prompts, each over the context once tokenized) take seconds to
    tokenize; /health must keep answering meanwhile. The bound is generous (a liveness check, not a
    timing), and the test checks that it really polled while the big request was in progress."""
    pids = server.worker_pids()
    big = json.dumps({"text": ["hello world " * 42_000] * 12, "sampling_params": {"max_new_tokens": 1}}).encode()
    result: dict = {}

    def send_big():
        result["response"] = server.post("/generate", big)
        result["done"] = time.monotonic()

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.2)  # let the body arrive
    polls = []
    while sender.is_alive():
        t0 = time.monotonic()
        status = server.get("/health")[0]
        polls.append((t0, time.monotonic() - t0, status))
        time.sleep(0.05)
    sender.join()
    assert all(s == 200 for _, _, s in polls)
    slowest = max(d for _, d, _ in polls)
    assert slowest < 2.0, f"/health took {slowest:.2f}s while a big prompt was tokenized"
    during = [p for p in polls if p[0] + p[1] < result["done"]]
    assert len(during) >= 3, f"the big request ended too soon to test anything ({len(polls)} polls)"
    status, err = result["response"]
    assert status == 400 and "context length" in err["error"]["message"], err
    healthy_and_same_workers(server, pids)


# -- issue 11, item 8: a rid is free again as soon as its request is gone ----------------------

LONG_STREAM = {"text": "Count: 1, 2, 3,", "stream": True,
               "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
SHORT = {"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}}


def wait_inflight_zero(server, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while server.state()["inflight_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.state()["inflight_requests"] == 0


def test_rid_reused_right_after_its_stream_was_dropped(server):
    """The client hangs up a stream; as soon as the frontend has let go of the request (its abort may
    still be on its way to the workers) the same rid starts a new request, which must run normally:
    internal state is keyed by the server's uid, so the old abort cannot touch the new request."""
    rid = "reuse-after-disconnect"
    sock = open_raw_request(server, "/generate", {**LONG_STREAM, "rid": rid})
    read_events(sock, 2)
    sock.close()
    wait_inflight_zero(server)
    status, out = server.post("/generate", {**SHORT, "rid": rid})
    assert status == 200, out
    assert out["meta_info"]["id"] == rid and out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    wait_idle(server)


def test_rid_reused_right_after_abort_request(server):
    """The same through SGLang's /abort_request: once it has answered, the rid is free."""
    rid = "reuse-after-abort-request"
    sock = open_raw_request(server, "/generate", {**LONG_STREAM, "rid": rid})
    try:
        read_events(sock, 2)
        status, out = server.post("/abort_request", {"rid": rid})
        assert status == 200 and out["aborted"] == [rid], out
        status, out = server.post("/generate", {**SHORT, "rid": rid})
        assert status == 200, out
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    finally:
        sock.close()
    wait_idle(server)
