"""The fuzz/soak driver: its cases cover what the issue lists, it reports (never raises on) a server
that errs, hangs or hangs up, and a tiny run against a real server writes the whole report and
leaves nothing behind. The full run (10,000 requests, 10-minute soak) is a benchmark, not a test."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from artifact.fuzz.http_cases import OK, CaseGenerator
from artifact.fuzz.http_driver import fuzz_http, unbounded_generation
from artifact.fuzz.report import verdict
from artifact.fuzz.zmq_fuzz import Canary, Payloads

ROOT = Path(__file__).resolve().parents[2]


def test_cases_cover_every_category_endpoint_and_attack():
    gen = CaseGenerator(random.Random(3), "m", 49152, max_body_mb=4)
    cases = [gen.next() for _ in range(4000)]
    categories = Counter(c.category for c in cases)
    assert set(categories) == {name for name, _ in CaseGenerator.MIX}
    good_paths = {c.path for c in cases if c.category == "good"}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/health", "/server_info", "/v1/models",
            "/abort_request", "/metrics", "/flush_cache"} <= good_paths
    # /flush_cache is refused while requests run (as SGLang's), so any answer but a 5xx is right there
    assert all(c.expect == OK for c in cases if c.category == "good" and c.path != "/flush_cache")
    bodies = [c.body or c.raw or b"" for c in cases]
    assert any(b"\\ud800" in b or b"\\udfff" in b for b in bodies)  # lone surrogates, as JSON escapes
    assert any(b.startswith(b"[" * 5000) for b in bodies)  # deep nesting
    assert any(len(b) >= 4 * 2**20 for b in bodies) and max(map(len, bodies)) <= 4 * 2**20 + 2**16
    assert any(b"Content-Length: abc" in b for b in bodies)  # protocol abuse
    assert {c.action for c in cases} == {"send", "raw", "stream-abort", "client-timeout"}
    assert any(b"18446744073709551616" in b for b in bodies)  # 2**64
    again = CaseGenerator(random.Random(3), "m", 49152, max_body_mb=4)
    assert [again.next().body for _ in range(50)] == [c.body for c in cases[:50]]


def test_socket_payloads_include_a_canary_pickle_and_bogus_messages(tmp_path):
    canary = tmp_path / "canary"
    payloads = Payloads(random.Random(1), str(canary), 49152, 512)
    kinds = Counter(payloads.next(name)[0] for name in ["prefill-1.sock", "decode-1.sock", "frontend.sock"] * 200)
    assert set(kinds) == {"bogus", "malformed_json", "pickled", "garbage", "multipart"}
    handoffs = [json.loads(payloads.bogus("decode-1.sock")) for _ in range(50)]
    assert any(h["kind"] == "handoff" and any(p >= 512 or p < 0 for p in h["page_table"]) for h in handoffs)
    pickle.loads(pickle.dumps(Canary(str(canary))))  # what a receiver that unpickles would do
    assert canary.is_dir()  # so a canary found after the run is proof, not an accident


class MisbehavingServer:
    """Answers /health and the liveness probe, and every other request with a 500, a hang, a
    dropped connection or a stream that never ends, in turn."""

    def __init__(self, failed_probes: int = 0):
        self.count, self.failed_probes = 0, failed_probes
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def handle(self, request: web.Request):
        body = await request.read()
        if b"Say hi." in body and self.failed_probes > 0:  # "restarting" for a while
            self.failed_probes -= 1
            return web.json_response({"error": "restarting"}, status=503)
        if request.path in ("/health", "/server_info") or b"Say hi." in body:
            return web.json_response({"status": "ok", "internal_states": [{"worker_restarts": 0}]})
        self.count += 1
        turn = self.count % 4
        if turn == 0:
            return web.json_response({"error": "boom"}, status=500)
        if turn == 1:
            await asyncio.sleep(30)
        if turn == 2:
            request.transport.close()
            return web.Response()
        return web.Response(text="data: {}\n\n", content_type="text/event-stream")

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_driver_reports_a_server_that_errs_hangs_and_hangs_up():
    server = MisbehavingServer()
    try:
        gen = CaseGenerator(random.Random(0), "m", 49152, max_body_mb=1)
        stats = asyncio.run(fuzz_http(server.url, gen, 60, concurrency=6, probe_every=20, timeout=2.0))
    finally:
        server.close()
    out = stats.as_dict()
    assert stats.sent == 60 and sum(sum(c.values()) for c in stats.outcomes.values()) == 60
    assert {"5xx", "timeout", "conn-error"} <= set(out["failures"])
    assert all(f["examples"] for f in out["failures"].values())
    assert len(out["probes"]) == 3 and all(p["alive"] for p in out["probes"])


def test_a_failed_probe_waits_for_recovery_and_the_fuzz_goes_on():
    server = MisbehavingServer(failed_probes=2)
    try:
        gen = CaseGenerator(random.Random(1), "m", 49152, max_body_mb=1)
        stats = asyncio.run(fuzz_http(server.url, gen, 30, concurrency=4, probe_every=10, timeout=2.0))
    finally:
        server.close()
    assert stats.sent == 30 and stats.stopped_early is None
    first = stats.probes[0]
    assert not first["alive"] and first["recovered_after_s"] is not None
    assert all(p["alive"] for p in stats.probes[1:]) and "liveness probe failed" in stats.findings.counts


@pytest.mark.slow
def test_a_tiny_run_against_a_real_server_writes_the_whole_report(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "artifact.fuzz_soak", "--requests", "60", "--zmq-messages", "30",
           "--zmq-oversized-mb", "0", "--soak-minutes", "0.05", "--soak-rate", "2", "--soak-max-tokens", "8",
           "--probe-every", "30",
           "--max-body-mb", "1", "--out", str(out), "--", "--policy", "static", "--log-level", "warning",
           "--max-total-tokens", "4096"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: it found something
    result = json.loads((out / "results.json").read_text())
    assert result["http"]["sent"] == 60
    assert sum(result["zmq"]["sent"].values()) + sum(result["zmq"]["undeliverable"].values()) == 30
    assert result["soak"]["sent"] >= 1 and result["soak"]["sent"] == (
        result["soak"]["completed"] + result["soak"]["failed"] + result["soak"]["lost"])
    for point in ("start", "soak_start", "end"):
        assert {"launcher", "prefill", "decode"} <= set(result[point]["memory"])
    assert result["end"]["pool"]["kv_pages_total"] == 4096 // 16
    v = result["verdict"]
    assert v == verdict(result) and (proc.returncode == 0) == (not any(x for x in v.values() if x is not None))
    # what the fixes of the reliability issue promise, whatever else the fuzz found
    assert v["code_executed_from_socket"] is False and v["server_died"] is False
    assert v["shm_segments_left"] == 0 and v["processes_left"] == 0 and v["runtime_dir_left"] is False
    assert result["end"]["liveness"]["alive"]
    md = (out / "results.md").read_text()
    assert "## Verdict" in md and "## HTTP fuzz" in md and "## Soak" in md and "## Memory" in md


def test_only_a_valid_request_without_a_length_limit_counts_as_unbounded():
    from artifact.fuzz.http_cases import Case

    def case(path, body):
        return Case("mutation", "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode(), OK)

    assert unbounded_generation(case("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ax_tokens": 6}))
    assert unbounded_generation(case("/generate", {"text": "x", "sampling_params": {"ma6x_new_tokens": 6}}))
    assert unbounded_generation(case("/generate", {"text": "x"}))
    assert not unbounded_generation(case("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 6}}))
    assert not unbounded_generation(case("/v1/completions", {"prompt": "x", "max_tokens": 4}))
    assert not unbounded_generation(case("/generate", b'{"text": "x", '))
    assert not unbounded_generation(case("/health", {"text": "x"}))
    assert not unbounded_generation(case("/generate", b"[" * 5000 + b"]" * 5000))  # too deep for json: not a crash


def test_leftovers_are_read_once_they_settle_or_as_they_stand_after_the_grace():
    import os
    import subprocess
    import time

    from artifact.fuzz_soak import settled_leftovers

    began = time.monotonic()
    assert settled_leftovers(None, None, [], grace_s=5.0) == {"shm_segments": [], "runtime_dir_left": False,
                                                              "processes_left": []}
    assert time.monotonic() - began < 1.0  # nothing left: no wait
    child = subprocess.Popen(["sleep", "0.3"])
    try:
        assert settled_leftovers(None, None, [child.pid], grace_s=10.0)["processes_left"] == []  # gone in time
    finally:
        child.wait()
    began = time.monotonic()
    assert settled_leftovers(None, None, [os.getpid()], grace_s=0.3)["processes_left"] == [os.getpid()]
    assert time.monotonic() - began >= 0.3


def test_the_soak_counts_an_error_event_as_failed_and_the_word_error_as_text():
    """A stream that ends with [DONE] still failed if it carried an error event; one whose model wrote the
    word "error" (a delta `{"content": "error"}`) completed — a 10-minute soak counted it failed once."""
    from artifact.fuzz.soak import reports_an_error

    def stream(*events) -> bytes:
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"

    text = {"choices": [{"index": 0, "delta": {"content": "error"}, "finish_reason": None}]}
    failure = {"error": {"message": "the decode worker failed", "type": "server_error", "code": 503}}
    assert not reports_an_error(stream(text, text), stream=True)
    assert reports_an_error(stream(text, failure), stream=True)
    assert reports_an_error(b"data: {not json\n\ndata: [DONE]\n\n", stream=True)
    assert not reports_an_error(json.dumps({"text": '{"error": 1}', "meta_info": {}}).encode(), stream=False)
    assert reports_an_error(json.dumps(failure).encode(), stream=False)
    assert reports_an_error(b"<html>", stream=False)
