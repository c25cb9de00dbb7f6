"""Start `bullet launch` as a subprocess on a free port and talk to it: what the benchmark driver
and the tests share."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not zombies (from /proc: state and group follow
    the command name in /proc/<pid>/stat)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def system_launch(system: str) -> list[str]:
    """`bullet launch` flags of a compared system: a policy (`default` = the server's default) optionally
    followed by launch flags in the same string, e.g. "bullet --split-rule aggregate"."""
    policy, *extra = shlex.split(system)
    return extra if policy == "default" else ["--policy", policy, *extra]


@contextlib.contextmanager
def all_started(servers: dict):
    """Enter every server context of `servers` (name -> unstarted server) and yield name -> started
    server; all are stopped on exit, also when one fails to start."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(server) for name, server in servers.items()}


def system_slug(system: str) -> str:
    """A file-name-safe name of a compared system."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", system).strip("-")


class BulletServer:
    def __init__(self, *args: str, startup_timeout: float = 600.0, env: dict | None = None, log_path: str | None = None,
                 new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path
        self._own_log = log_path is None  # a temporary log of ours: removed once the server stopped cleanly
        self.info: dict = {}
        # its own process group: the launcher and its workers can then be told apart from the caller
        # and killed together (`kill_group`) when a launcher dies without stopping its workers
        self.new_session = new_session

    def start(self) -> "BulletServer":
        if self.log_path is None:
            self.log_path = tempfile.NamedTemporaryFile("w+", prefix="bullet-server-", suffix=".log", delete=False).name
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "bullet.cli", "launch", *self.args], cwd=ROOT,
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=self.new_session)
        try:
            return self._wait_healthy()
        except BaseException:  # whatever went wrong after Popen, leave no server behind
            self.terminate()
            raise

    def _wait_healthy(self) -> "BulletServer":
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.tail()}")
            try:
                if self.get("/health")[0] == 200:
                    self.info = self.state()
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {self.startup_timeout}s:\n{self.tail()}")

    def __enter__(self) -> "BulletServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.terminate()

    @property
    def instance_id(self) -> str:
        return self.info["instance_id"]

    def state(self) -> dict:
        return self.get("/server_info")[1]["internal_states"][0]

    def worker_pids(self) -> dict[str, int]:
        return self.state()["worker_pids"]

    def get(self, path: str, headers: dict | None = None):
        return self.request("GET", path, None, headers)

    def post(self, path: str, body, headers: dict | None = None, timeout: float = 300):
        return self.request("POST", path, body, headers, timeout)

    def request(self, method, path, body=None, headers=None, timeout: float = 300):
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw, status = resp.read().decode(), resp.status
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

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not stop. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode in (0, -signal.SIGTERM):
            self.drop_log()  # a crashed server's log stays, for reading
        return self.proc.returncode

    def kill_group(self) -> list[int]:
        """SIGKILL what is still alive of a `new_session` server's process group (workers that outlived
        their launcher); their pids (zombies waiting to be reaped do not count)."""
        if self.proc is None or not self.new_session:
            return []
        alive = live_group_members(self.proc.pid)
        if alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return alive

    def drop_log(self) -> None:
        """Remove the temporary log this object created (a log_path given by the caller stays)."""
        if self._own_log and self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self.log_path = None
