"""The load generator (artifact.loadgen): seeded prompts and arrivals, the per-request records
against a real CPU server (SmolLM2, a few requests) read back by the reader the artifact already
has, and the failures a stream can hide — an error event, a bare [DONE] — counted as failures."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from artifact import loadgen
from artifact.bench_client import read_bench_file
from bullet.types.slo import SLO
from tests.server_utils import ServerProcess


def test_prompts_and_arrivals_follow_from_the_seed_and_a_shorter_run_is_a_prefix():
    a = loadgen.workload(20, 4.0, 7, 1000, (5, 9))
    assert a == loadgen.workload(20, 4.0, 7, 1000, (5, 9))
    prompts, arrivals = loadgen.workload(5, 4.0, 7, 1000, (5, 9))
    assert prompts == a[0][:5] and arrivals == a[1][:5]
    assert loadgen.workload(20, 4.0, 8, 1000, (5, 9)) != a
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert all(5 <= len(p) <= 9 and all(100 <= t < 1000 for t in p) for p in a[0])
    with pytest.raises(ValueError):
        loadgen.workload(3, 0.0, 1, 1000, (5, 9))


def test_a_real_server_streams_every_request_and_the_artifact_reader_parses_the_file(tmp_path):
    prompts, arrivals = loadgen.workload(3, 6.0, 1, 40000, (8, 24))
    with ServerProcess("--dtype", "float32", "--max-total-tokens", "2048", "--policy", "static") as server:
        records, duration = asyncio.run(loadgen.run_point(server.url, prompts, arrivals, 5, deadline_s=120))
    assert [r.error for r in records] == ["", "", ""]
    assert all(r.ok and r.output_len == 5 and r.ttft > 0 and len(r.itl) == 4 for r in records)
    path = tmp_path / "bench.jsonl"
    loadgen.write_bench_file(path, loadgen.bench_details(records, duration, 6.0, "static"))
    result, parsed = read_bench_file(path)
    assert result["completed"] == 3 and result["request_rate"] == 6.0 and len(result["arrivals"]) == 3
    assert [(r.input_len, r.output_len, r.ok) for r in parsed] == [(len(p), 5, True) for p in prompts]
    assert parsed[0].tpot == pytest.approx(sum(records[0].itl) / 4)
    point = loadgen.summary(records, duration, SLO.parse("10s", "10s"))
    assert point["completed"] == 3 and point["attainment"] == 1.0 and point["output_tok_per_s"] > 0
    assert point["ttft_p50_s"] > 0 and point["itl_p99_s"] > 0


async def _fake_server(body: bytes, port_out: list) -> asyncio.AbstractServer:
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, family=socket.AF_INET)
    port_out.append(server.sockets[0].getsockname()[1])
    return server


def _against(body: bytes) -> loadgen.Record:
    async def go():
        port: list = []
        server = await _fake_server(body, port)
        async with server:
            records, _ = await loadgen.run_point(f"http://127.0.0.1:{port[0]}", [[101, 102]], [0.0], 3, deadline_s=30)
        return records[0]

    return asyncio.run(go())


def event(tokens: int) -> bytes:
    return f"data: {json.dumps({'text': '', 'meta_info': {'completion_tokens': tokens}})}\n\n".encode()


def test_a_bare_done_an_error_event_and_a_short_stream_are_failures():
    bare = _against(b"data: [DONE]\n\n")
    assert not bare.ok and "no token" in bare.error
    failed = _against(event(1) + b'data: {"error": {"message": "worker died"}}\n\n' + b"data: [DONE]\n\n")
    assert not failed.ok and "worker died" in failed.error and failed.output_len == 1
    short = _against(event(1) + event(2) + b"data: [DONE]\n\n")
    assert not short.ok and "2 of 3" in short.error
    cut = _against(event(1))
    assert not cut.ok and "without [DONE]" in cut.error
    whole = _against(event(1) + event(3) + b"data: [DONE]\n\n")  # two tokens in one event: two gaps of half
    assert whole.ok and whole.error == "" and len(whole.itl) == 2 and whole.itl[0] == whole.itl[1]
