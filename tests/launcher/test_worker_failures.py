"""A worker or the launcher dies: in-flight requests fail with an error (no hang), the launcher
restarts the workers or shuts down, and no process or /dev/shm segment is left behind."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import time

import pytest

from tests.server_utils import LONG, ServerProcess, assert_generates, bullet_segments, pid_alive, wait_for, pages_accounted



# one long streamed request per streaming endpoint
STREAMS = {
    "/generate": {**LONG, "stream": True},
    "/v1/completions": {"prompt": LONG["text"], "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                        "stream": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": LONG["text"]}], "max_tokens": 400,
                             "ignore_eos": True, "temperature": 0, "stream": True},
}


class OpenStream:
    """A streaming POST whose events are read as they come (http.client undoes the chunking)."""

    def __init__(self, server: ServerProcess, path: str, body: dict):
        self.path = path
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.events = [self.next_event()]  # the first token: the request is being served

    def next_event(self):
        while True:
            line = self.resp.readline()
            assert line, f"{self.path}: the stream ended without [DONE]"
            if line.startswith(b"data: "):
                payload = line[len(b"data: "):].strip().decode()
                return payload if payload == "[DONE]" else json.loads(payload)

    def rest(self) -> list:
        """Every event up to and including [DONE]."""
        while self.events[-1] != "[DONE]":
            self.events.append(self.next_event())
        self.conn.close()
        return self.events


def _kill_during_generation(server: ServerProcess, role: str, streams: bool = False):
    """Start 6 long requests (and with `streams`, one streamed request per streaming endpoint), SIGKILL
    `role` while they run; returns (responses, kill time, victim pid, streams)."""
    pool = cf.ThreadPoolExecutor(6)
    futures = [pool.submit(server.post, "/generate", LONG) for _ in range(6)]
    opened = [OpenStream(server, path, body) for path, body in STREAMS.items()] if streams else []
    wait_for(lambda: server.state()["decode"]["batch_size"] > 0, 60, "requests to reach decode")
    victim = server.worker_pids()[role]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    responses = [f.result(timeout=30) for f in futures]  # must not hang
    pool.shutdown()
    return responses, killed_at, victim, opened


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_killed_worker_fails_inflight_requests_and_is_restarted(role):
    with ServerProcess("--max-total-tokens", "8192", "--max-worker-restarts", "2") as server:
        responses, killed_at, victim, streams = _kill_during_generation(server, role, streams=True)
        noticed_after = wait_for(lambda: server.state()["failures"], 10, "the failure record")[-1]["time"] - killed_at
        assert noticed_after < 2.0, f"the launcher noticed the dead {role} worker after {noticed_after:.2f}s"
        for status, body in responses:
            assert status == 503, body
            assert f"the {role} worker died" in body["error"]["message"]
        for stream in streams:  # a failed stream says so before [DONE], on every streaming endpoint
            *_, error, done = stream.rest()
            assert done == "[DONE]" and "error" in error, (stream.path, stream.events[-3:])
            assert f"the {role} worker died" in error["error"]["message"] and error["error"]["code"] == 503
        wait_for(lambda: server.get("/health")[0] == 200, 120, "the restarted workers")
        state = server.state()
        assert state["worker_restarts"] == 1 and victim not in state["worker_pids"].values()
        assert not pid_alive(victim)
        assert_generates(server, 4)  # the restarted workers serve a whole request
        wait_for(lambda: pages_accounted(server.state()), 10, "all pages free or evictable")


def test_server_shuts_down_cleanly_when_out_of_restarts():
    server = ServerProcess("--max-total-tokens", "8192", "--max-worker-restarts", "0")
    with server:
        instance, pids = server.instance_id, list(server.worker_pids().values())
        responses, _, _, _ = _kill_during_generation(server, "decode")
        assert all(status == 503 for status, _ in responses)
        server.proc.wait(60)  # the launcher gives up and exits by itself
        assert server.proc.returncode != 0
        assert "stopped: the decode worker died" in server.tail()
        wait_for(lambda: not any(pid_alive(p) for p in pids), 15, "the surviving worker to exit")
        assert not bullet_segments(instance)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-generation"])
def test_killed_launcher_takes_its_workers_and_segments_with_it(busy):
    """Idle, or mid-generation: then the workers hold outputs for a frontend that is gone and input
    nobody will read (found by the fuzz driver: an orphaned worker hung in zmq_ctx_term forever)."""
    server = ServerProcess("--max-total-tokens", "4096")
    with server:
        instance, pids = server.instance_id, list(server.worker_pids().values())
        if busy:
            pool = cf.ThreadPoolExecutor(4)
            for _ in range(4):
                pool.submit(server.post, "/generate", LONG, None, 60)
            wait_for(lambda: server.state()["decode"]["batch_size"] > 0, 60, "requests to reach decode")
            pool.shutdown(wait=False)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        wait_for(lambda: not any(pid_alive(p) for p in pids), 20, "orphaned workers to exit")
        wait_for(lambda: not bullet_segments(instance), 10, "the instance's segments to be removed")
