"""Run `bullet launch` as a real subprocess for tests: pick a free port, wait for /health, and on
exit stop it with SIGTERM and check that no worker process and no /dev/shm segment is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 240.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = None
        self.info: dict = {}

    def __enter__(self) -> "ServerProcess":
        import tempfile

        self.log = tempfile.NamedTemporaryFile("w+", prefix="bullet-server-", suffix=".log", delete=False)
        self.log_path = self.log.name
        self.proc = subprocess.Popen([sys.executable, "-m", "bullet.cli", "launch", *self.args], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.tail()}")
            try:
                if self.get("/health")[0] == 200:
                    self.info = self.get("/server_info")[1]["internal_states"][0]
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout}s:\n{self.tail()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def instance_id(self) -> str:
        return self.info["instance_id"]

    def worker_pids(self) -> dict[str, int]:
        return self.state()["worker_pids"]

    def state(self) -> dict:
        return self.get("/server_info")[1]["internal_states"][0]

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict | str]:
        return self.request("GET", path, None, headers)

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict | str]:
        return self.request("POST", path, body, headers, timeout)

    def request(self, method, path, body=None, headers=None, timeout: float = 300):
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as err:
            raw, status = err.read().decode(), err.code
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw

    def tail(self, n: int = 40) -> str:
        try:
            return "".join(Path(self.log_path).read_text().splitlines(True)[-n:])
        except (OSError, TypeError):
            return ""

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
