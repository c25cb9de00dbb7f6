"""Run SGLang's own router (`sglang-router`, `python -m sglang_router.launch_router`) in front of
Bullet replicas, as a subprocess on a free port: what the router test and the 1-vs-2-replica
benchmark share. The router is SGLang's engine for scale-out (cache-aware routing, health checks,
retries); Bullet only has to speak SGLang's HTTP API for it to work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from artifact.server import free_port


class SGLangRouter:
    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", *extra: str,
                 startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # a replica that dies is noticed by the next failed request (retried elsewhere) and by the
        # health check within a second, rather than SGLang's default minute
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls,
                     "--policy", policy, "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                     "--worker-startup-timeout-secs", str(int(startup_timeout)), "--log-level", "warn",
                     "--prometheus-port", str(free_port()), *extra]  # its own: two routers may run at once
        self.startup_timeout = startup_timeout
        self.expected = len(worker_urls)
        self.proc: subprocess.Popen | None = None
        self.log_path = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log", delete=False).name

    def start(self) -> "SGLangRouter":
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if len(self.healthy_workers()) == self.expected:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the router did not see {self.expected} healthy workers:\n{self.tail()}")

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def healthy_workers(self) -> list[str]:
        return [w["url"] for w in self.get("/workers", timeout=5)["workers"] if w.get("is_healthy")]

    def tail(self, n: int = 30) -> str:
        try:
            return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "SGLangRouter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
