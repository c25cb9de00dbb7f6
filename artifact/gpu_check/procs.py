"""Child processes with a deadline: each runs in its own process group, its output goes to a log
file, and at the deadline the whole group is killed (a step that hangs, or leaves helpers behind,
costs its own budget and nothing more). Progress lines carry the time since the run began."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_T0 = time.monotonic()
_lines: list[str] = []
_copies: list[Path] = []  # files that get every progress line too (the report folder's progress.log)


def progress(message: str) -> None:
    """One progress line on stdout: wall clock and seconds since the run began."""
    line = f"[gpu_check {time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:5.1f}s] {message}"
    print(line, flush=True)
    _lines.append(line)
    for path in _copies:
        with open(path, "a") as f:
            f.write(line + "\n")


def copy_progress_to(path: Path) -> None:
    """From now on every progress line goes to `path` too; the lines so far are written first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in _lines))
    _copies.append(path)


@dataclass
class Finished:
    returncode: int | None  # None when it was killed at its deadline
    seconds: float
    log: Path

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL to what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None, cwd: Path | None = None,
        stdin: str | None = None) -> Finished:
    """Run `cmd` to completion or `timeout_s`, output (stdout and stderr) to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, text=True)
        try:
            proc.communicate(stdin, timeout=max(1.0, timeout_s))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            kill_group(proc)
            code = None
            out.write(f"\n[gpu_check] killed at its deadline ({timeout_s:.0f} s)\n")
    return Finished(code, time.monotonic() - began, log)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]
