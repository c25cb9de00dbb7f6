"""Run `bullet launch` as a real subprocess for tests: pick a free port, wait for /health, and on
exit stop it with SIGTERM and check that no worker process and no /dev/shm segment is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from artifact.server import BulletServer, free_port  # noqa: F401  (free_port re-exported for tests)


LONG = {"text": "Write a very long story about a lighthouse keeper.",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}


def assert_generates(server, tokens: int = 4, text: str = "Hello", headers: dict | None = None) -> dict:
    """The server still serves: a greedy request that ignores EOS must come back with exactly `tokens`
    tokens and finish on its length. (A sampled request that may stop at EOS can come back short —
    "Hello" at temperature 1 ends with "." and EOS about once in 300 — so a liveness check that counts
    tokens must pin both.)"""
    body = {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    status, out = server.post("/generate", body, headers)
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": tokens}, meta
    assert meta["completion_tokens"] == len(out["output_ids"]) == tokens, out
    return out


def wait_for(predicate, timeout: float, what: str):
    """The first truthy value of `predicate()`, polled every 50 ms; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pages_accounted(state: dict) -> bool:
    """/server_info's pool once nothing runs: every page free, or held by the prefix cache with no
    request using it (evicted on demand) — nothing leaked."""
    cached, evictable = state.get("kv_pages_cached", 0), state.get("kv_pages_evictable", 0)
    return cached == evictable and state["kv_pages_free"] + evictable == state["kv_pages_total"]


def wait_pages_accounted(server, timeout: float = 10.0) -> dict:
    """The server's state once `pages_accounted` holds: a finished request's pages reach the prefix
    cache a moment after its last token reaches the client (decode sends them to prefill, which
    inserts them), so a check right after a response must wait for them."""
    return wait_for(lambda: (lambda s: s if pages_accounted(s) else None)(server.state()), timeout,
                    "every page free or evictable")


def bullet_segments(instance_id: str | None = None) -> list[str]:
    prefix = f"bullet-{instance_id}-" if instance_id else "bullet-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith("sem." + prefix))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


class ServerProcess(BulletServer):
    """A BulletServer whose shutdown is checked: no worker process and no segment may survive it."""

    def __init__(self, *args: str, startup_timeout: float = 240.0, env: dict | None = None):
        super().__init__(*args, startup_timeout=startup_timeout, env=env)

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then check nothing of the instance survives."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pids = []
        try:
            pids = list(self.worker_pids().values())
        except Exception:
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored SIGTERM for {timeout}s:\n{self.tail()}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        alive = [p for p in pids if pid_alive(p)]
        assert not alive, f"worker processes {alive} outlived the server"
        if self.info:
            assert not bullet_segments(self.instance_id), f"segments left: {bullet_segments(self.instance_id)}"
        self.drop_log()  # stopped cleanly: nothing left to read (a failed check above keeps it)

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:  # a server the test itself killed, and the test passed: its log served its purpose
            self.drop_log()
