"""A doctor's helper process, spoken to over its stdin (one command a line) and its stdout (one JSON
object a line), with a deadline on every answer: the cpu probe child and the isolation check's two
sides."""

from __future__ import annotations

import json
import select
import subprocess
import time


class JsonLineChild:
    """A child process spoken to over its stdin (one command a line) and stdout (one JSON object a
    line), with a deadline on every answer."""

    def __init__(self, cmd: list[str], timeout: float = 60.0, preexec_fn=None, env: dict | None = None,
                 wait: bool = True):
        """`wait=False`: return at once; `wait_ready()` reads the first answer (start several first)."""
        self.timeout = timeout
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=preexec_fn, env=env)
        self.pid = self.proc.pid
        self.ready: dict = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict:
        try:
            self.ready = self.read()
        except BaseException:  # never leave a child behind that did not start properly
            self.proc.kill()
            self.proc.wait()
            raise
        return self.ready

    def read(self, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
            if self.proc.poll() is not None:
                break
        raise RuntimeError(f"child {self.proc.args[2:4]} (pid {self.proc.pid}) gave no answer; "
                           f"exit code {self.proc.poll()}")

    def post(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def send(self, command: str, timeout: float | None = None) -> dict:
        self.post(command)
        return self.read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
