"""Small client-side helpers for the HTTP tests: server-sent events, Prometheus text, raw sockets,
and waiting for the workers to settle."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

from tests.server_utils import ServerProcess, pages_accounted

# Flags of the servers the HTTP tests start: a small KV pool keeps memory down (the context length
# stays the model's 8192).
SERVER_ARGS = ("--max-total-tokens", "8192")
# The second server: an API key, a KV pool of 512 tokens that two ~350-token requests overflow, and
# a 1 MiB request-body limit (the default is 16 MiB).
API_KEY = "sk-test-0123456789"
SMALL_POOL_TOKENS = 512
BODY_LIMIT = 1 << 20
MAX_QUEUED = 4  # and room for only a few requests at once (`--max-queued-requests`)
SECURED_ARGS = ("--max-total-tokens", str(SMALL_POOL_TOKENS), "--api-key", API_KEY,
                "--max-request-body-bytes", str(BODY_LIMIT), "--max-queued-requests", str(MAX_QUEUED),
                # fp32 on every CPU (auto would pick bf16 where the CPU has it, or the int8 model, which
                # requantizes activations): test_http_kv_full compares outputs with solo runs
                "--quantization", "none", "--dtype", "float32",
                # auth, limits and a full pool behave alike under every policy; `static` needs no estimator
                # profile, so this fp32 server starts without measuring one (~90 s on a fresh 2-core machine)
                "--policy", "static",
                # a template that shows tools to the model (SmolLM2's own has none): test_tool_calls
                "--chat-template", "chatml-tools")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class SecuredServer(ServerProcess):
    """Sends the API key unless a test passes its own headers (ServerProcess itself reads
    /server_info at startup and shutdown, which needs the key)."""

    def request(self, method, path, body=None, headers=None, timeout: float = 300):
        return super().request(method, path, body, AUTH if headers is None else headers, timeout)


def sse_events(body: str) -> list:
    """The `data:` payloads of an event stream, JSON-decoded; the final `[DONE]` stays a string."""
    out = []
    for block in body.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block[:80]!r}"
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def post_stream(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 300):
    """(status, content type, list of events) of a streaming POST."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.headers.get("content-type", ""), sse_events(resp.read().decode())


def metric(text: str, name: str, labels: dict | None = None) -> float:
    """Value of one sample in Prometheus text format (0 if absent: counters start unseen)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        if m and m.group(1) == name:
            got = ",".join(sorted(p for p in (m.group(2) or "").split(",") if p))
            if got == want:
                return float(m.group(3))
    return 0.0


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of one metric, whatever its labels."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{.*\})?\s+(\S+)$", line)
        if m and m.group(1) == name:
            total += float(m.group(2))
    return total


def token_counters(server) -> tuple[float, float]:
    """(prompt tokens, generated tokens) of all finished requests so far, from /metrics."""
    text = server.get("/metrics")[1]
    return metric_sum(text, "sglang:prompt_tokens_total"), metric_sum(text, "sglang:generation_tokens_total")


def open_raw_request(server, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """A socket with a POST sent on it: the test decides when (and whether) to read, and when to
    hang up — the way a crashed or impatient client behaves."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n{extra}\r\n".encode() + data)
    return sock


def read_events(sock: socket.socket, n: int) -> bytes:
    """Read from a streaming response until at least n `data:` events have arrived."""
    buf = b""
    while buf.count(b"data: ") < n:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the stream after {buf.count(b'data: ')} events: {buf[-300:]!r}"
        buf += chunk
    return buf


def idle(state: dict) -> bool:
    return (state["prefill"]["queued_requests"] == 0 and state["prefill"]["batch_size"] == 0
            and state["decode"]["batch_size"] == 0 and state["inflight_requests"] == 0
            and pages_accounted(state))


def wait_idle(server, within_s: float = 10.0) -> dict:
    """The server state once no request is left in either worker and every KV page is free; fails
    (showing the last state) if that does not happen within `within_s` — a liveness bound, not a
    speed assertion: an aborted request must not keep running."""
    deadline = time.monotonic() + within_s
    state = server.state()
    while not idle(state) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = server.state()
    assert idle(state), f"requests still held after {within_s}s: {summary(state)}"
    return state


def summary(state: dict) -> dict:
    return {"inflight": state["inflight_requests"], "prefill_queued": state["prefill"]["queued_requests"],
            "prefill_batch": state["prefill"]["batch_size"], "decode_batch": state["decode"]["batch_size"],
            "pages_free": state["kv_pages_free"], "pages_total": state["kv_pages_total"],
            "pages_cached": state.get("kv_pages_cached"), "pages_evictable": state.get("kv_pages_evictable")}
