"""What a hostile or unlucky moment must not do to a running server: a stopped (hung) worker is
detected by its heartbeat, killed and restarted; SIGTERM drains instead of cutting requests off;
the worker and frontend sockets admit only the server's user, and garbage or a pickle sent to any
of them is dropped without running anything or disturbing a request."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from tests.server_utils import LONG, ServerProcess, assert_generates, bullet_segments, pages_accounted, pid_alive, wait_for, wait_pages_accounted



def test_a_stopped_worker_is_detected_by_its_heartbeat_and_restarted():
    with ServerProcess("--max-total-tokens", "8192", "--heartbeat-timeout", "2") as server:
        pool = cf.ThreadPoolExecutor(4)
        futures = [pool.submit(server.post, "/generate", LONG) for _ in range(4)]
        wait_for(lambda: server.state()["decode"]["batch_size"] > 0, 60, "requests to reach decode")
        victim = server.worker_pids()["decode"]
        stopped_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        responses = [f.result(timeout=60) for f in futures]  # must not hang
        failed_after = time.monotonic() - stopped_at
        pool.shutdown()
        for status, body in responses:
            assert status == 503, body
            assert "the decode worker stopped responding" in body["error"]["message"]
        assert failed_after < 10, f"a stopped worker was noticed after {failed_after:.1f}s (timeout 2s)"
        wait_for(lambda: server.get("/health")[0] == 200, 120, "the restarted workers")
        assert not pid_alive(victim)
        assert_generates(server, 4)
        wait_for(lambda: pages_accounted(server.state()), 10, "all pages free or evictable")


def _stream(port: int, body: dict) -> list[str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [line.decode().strip() for line in resp if line.strip()]


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones():
    server = ServerProcess("--max-total-tokens", "8192", "--shutdown-timeout", "120")
    with server:
        instance = server.instance_id
        body = {"text": "Count to one hundred:", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        pool = cf.ThreadPoolExecutor(4)
        futures = [pool.submit(server.post, "/generate", body) for _ in range(3)]
        stream = pool.submit(_stream, server.port, body)
        wait_for(lambda: server.state()["decode"]["batch_size"] > 0, 60, "requests to reach decode")
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: server.get("/health")[0] == 503, 10, "the server to start draining")
        status, refused = server.post("/generate", body)
        assert status == 503 and "draining" in refused["error"]["message"]
        for f in futures:
            status, out = f.result(timeout=120)
            assert status == 200 and out["meta_info"]["completion_tokens"] == 40, out
        events = stream.result(timeout=120)
        assert events[-1] == "data: [DONE]" and '"finish_reason": {"type": "length"' in events[-2]
        assert server.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has stopped
        pool.shutdown()
        assert not bullet_segments(instance)


def test_a_drain_that_runs_out_of_time_ends_streams_with_an_error_event():
    server = ServerProcess("--max-total-tokens", "8192", "--shutdown-timeout", "1")
    with server:
        pool = cf.ThreadPoolExecutor(1)
        stream = pool.submit(_stream, server.port, {"text": "Tell a story.",
                                                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
        wait_for(lambda: server.state()["decode"]["batch_size"] > 0, 60, "the request to reach decode")
        server.proc.send_signal(signal.SIGTERM)
        events = stream.result(timeout=60)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])
        assert "shut down before this request finished" in error["error"]["message"]
        server.proc.wait(60)
        pool.shutdown()


def _endpoints(server) -> dict[str, str]:
    runtime_dir = Path(server.state()["runtime_dir"])
    socks = {p.name: str(p) for p in runtime_dir.iterdir() if p.suffix == ".sock"}
    return {"prefill": next(v for k, v in socks.items() if k.startswith("prefill-")),
            "decode": next(v for k, v in socks.items() if k.startswith("decode-")),
            "frontend": socks["frontend.sock"]}


@pytest.fixture(scope="module")
def server():
    """One server for the checks that leave it as they found it (sockets, garbage, forged messages):
    each asserts the server is still healthy, with the same workers, after its own turn."""
    with ServerProcess("--max-total-tokens", "4096") as server:
        yield server


def test_worker_sockets_live_in_a_directory_only_the_server_user_can_enter(server):
    runtime_dir = Path(server.state()["runtime_dir"])
    info = runtime_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    paths = _endpoints(server)
    assert all(Path(p).is_socket() for p in paths.values())
    with open("/proc/net/unix") as f:  # no abstract-namespace (permission-less) socket of ours
        assert "@bullet-" not in f.read()
    if os.getuid() != 0:
        pytest.skip("checking another user's access needs root to switch to that user")
    probe = ("import os, socket, sys; os.setgid(65534); os.setuid(65534)\n"
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
             "try:\n    s.connect(sys.argv[1]); print('connected')\n"
             "except PermissionError:\n    print('refused')\n")
    for path in paths.values():
        out = subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused", (path, out.stdout, out.stderr)


class _Marker:
    """A pickle that, if anything unpickled it, would create a file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_garbage_and_pickles_on_every_socket_are_dropped(server, tmp_path):
    marker = tmp_path / "pwned"
    pids = server.worker_pids()
    ctx = zmq.Context()
    payloads = [b"", b"\x00\xff" * 1000, b"not json", b'{"kind": "generate"}', b'{"kind": "outputs", "outputs": 5}',
                b'{"kind": "abort", "uid": -1}', json.dumps({"kind": "outputs", "outputs": [{"uid": 999999}]}).encode(),
                pickle.dumps(_Marker(str(marker))), b"[" * 5000 + b"]" * 5000]
    for name, path in _endpoints(server).items():
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"ipc://{path}")
        for data in payloads:
            sock.send(data)
        sock.close()
    ctx.term()
    time.sleep(1.0)
    assert not marker.exists()
    assert server.get("/health")[0] == 200 and server.worker_pids() == pids  # no worker died or restarted
    assert_generates(server, 4)
    assert "dropped a malformed" in server.tail(200)


def _forged() -> list[bytes]:
    """Valid messages no frontend or peer worker would send (found by the fuzz driver: a handoff
    naming another owner's pages killed the decode worker)."""
    from bullet.types.messages import GenerateRequest, Handoff, Recompute, Release, encode
    from engines.sampling_params import SamplingParams

    params, uid = SamplingParams(max_new_tokens=4), 10**12
    common = dict(rid="forged", params=params, arrival=0.0)
    return [encode(GenerateRequest(uid=uid, input_ids=[49152, 50152], **common)),
            encode(GenerateRequest(uid=uid + 1, input_ids=[1] * 9000, **common)),
            encode(Recompute(uid=uid + 2, prompt_ids=[1, 2], output_ids=[10**6], first_token_time=0.0, **common)),
            encode(Handoff(uid=uid + 3, prompt_ids=[1, 2], output_ids=[3], page_table=[5], first_token_time=0.0,
                           **common)),
            encode(Handoff(uid=uid + 4, prompt_ids=[1, 2], output_ids=[3], page_table=[10**6], first_token_time=0.0,
                           **common)),
            encode(Handoff(uid=uid + 5, prompt_ids=[1, 2], output_ids=[3], page_table=[5], shared_pages=1,
                           first_token_time=0.0, **common)),
            encode(Release(uid=uid + 6, token_ids=[1, 2, 3], page_table=[7])),
            encode(Release(uid=uid + 7, token_ids=[1, 2, 3], page_table=[7], shared_pages=1))]


def test_forged_well_formed_messages_are_dropped_before_they_reach_the_model(server):
    pids, paths = server.worker_pids(), _endpoints(server)
    ctx = zmq.Context()
    for name in ("prefill", "decode"):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(f"ipc://{paths[name]}")
        for data in _forged():
            sock.send(data)
        sock.close()
    ctx.term()
    time.sleep(1.0)
    assert server.get("/health")[0] == 200 and server.worker_pids() == pids
    assert_generates(server, 4)
    tail = server.tail(300)
    assert "dropped a Handoff message: its page table names pages" in tail
    assert "dropped a GenerateRequest message: token ids outside" in tail
    assert "dropped a Release message: its page table names" in tail
    assert "a step of" not in tail  # nothing forged got as far as a step
    wait_pages_accounted(server)  # every page free or in the prefix cache


@pytest.fixture(scope="module")
def after_leftovers():
    """An "instance" whose creator is gone (segments and a socket directory made by a process we kill),
    then a server launched after it — with its OpenMP runtimes reporting their settings at start.
    Yields (server, the dead instance's id, its socket directory)."""
    code = ("import os, signal, sys\n"
            "from bullet.shm.segments import new_instance_id\n"
            "from bullet.shm.state_buffer import StateBuffer\n"
            "from bullet.shared.endpoints import make_runtime_dir\n"
            "iid = new_instance_id(); StateBuffer.create(iid); d = make_runtime_dir(iid)\n"
            "print(iid, d, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    iid, runtime_dir = out.stdout.split()
    assert bullet_segments(iid) and Path(runtime_dir).is_dir()
    with ServerProcess("--max-total-tokens", "4096", env={"OMP_DISPLAY_ENV": "VERBOSE"}) as server:
        yield server, iid, runtime_dir


def test_leftovers_of_a_killed_instance_are_reclaimed_at_the_next_launch(after_leftovers):
    _, iid, runtime_dir = after_leftovers
    assert not bullet_segments(iid) and not Path(runtime_dir).exists()


def test_worker_threads_spin_briefly_then_sleep_at_barriers(after_leftovers):
    # unbounded spinning of two workers' OpenMP threads on shared cores collapsed decode under load, and
    # sleeping at once made every parallel region a wake-up (see engines.host): each worker's OpenMP
    # runtime reports the bounded spin it starts with
    server, _, _ = after_leftovers
    log = server.tail(10_000)
    assert log.count("GOMP_SPINCOUNT = '20000'") >= 2, log[-3000:]
