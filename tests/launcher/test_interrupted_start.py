"""A stop signal while the server is still starting stops it then, not after the start-up: a user's
Ctrl-C (SIGINT to the whole process group) or a service manager's SIGTERM (to the launcher alone)
during a first launch's estimator profile — the longest part of a start, about a minute on 2 cores —
ends the profile's child, writes no profile, leaves no process or /dev/shm segment, and says so in
one line instead of two tracebacks. The runtime's side (where the signal is raised, what is cleaned up,
the wait for the workers) is also driven without a model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bullet.config import ServerArgs
from bullet.frontend.serving import ServingRuntime
from bullet.launcher.launcher import Launcher, StartupInterrupted
from engines.cache_root import cache_dir
from tests.server_utils import bullet_segments, free_port, pid_alive, wait_for


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return [pid for pid in found if pid_alive(pid)]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_signal_during_the_first_launchs_profile_stops_the_server_at_once(how, tmp_path):
    cache = tmp_path / "cache"  # no profile cached: this launch measures one
    cache.mkdir()
    for kept in ("weights", "tokenizers", "dtype"):  # the converted model is shared: no minute spent on it
        (cache_dir() / kept).mkdir(parents=True, exist_ok=True)
        (cache / kept).symlink_to(cache_dir() / kept)
    server = subprocess.Popen([sys.executable, "-m", "bullet.cli", "launch", "--port", str(free_port())],
                              env={**os.environ, "BULLET_CACHE_DIR": str(cache)}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read_stderr() -> None:  # read to the end: a full pipe would stall the server
        for line in server.stderr:
            lines.append(line.rstrip())

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("measuring (once" in line for line in lines) or server.poll() is not None, 240,
                 "the profile to be announced")
        assert server.poll() is None, "\n".join(lines[-20:])
        children = wait_for(lambda: processes_naming(str(cache)), 60, "the profiling child")  # its --output
        if how == "ctrl-c":
            os.killpg(server.pid, signal.SIGINT)  # what a terminal sends: the launcher and its children
        else:
            server.send_signal(signal.SIGTERM)  # what a service manager sends: the launcher alone
        code = server.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    output = "\n".join(lines)
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    said = [line for line in lines if "while starting" in line]
    assert said == [f"bullet launch: {name} while starting: stopped before serving (nothing half-measured is "
                    "cached, no worker or shared-memory segment is left)"], output
    assert "Traceback" not in output, output
    assert code == 128 + (signal.SIGINT if how == "ctrl-c" else signal.SIGTERM), output
    assert not [pid for pid in children if pid_alive(pid)], "the profiling child outlived the server"
    assert not processes_naming(str(cache))
    assert not list(cache.glob("profiles/*.json")), "a profile was written"
    assert not [n for n in bullet_segments() if n.removeprefix("sem.").startswith(f"bullet-{server.pid}x")]


def test_a_signal_in_the_blocking_start_up_is_raised_there_and_what_it_made_is_stopped():
    runtime = ServingRuntime(ServerArgs())
    stopped = []

    def start_then_signal():  # the launcher's start as a signal finds it: mid-way, in this thread
        runtime.interrupt_start(signal.SIGTERM)
        raise AssertionError("the signal did not leave the start-up where it stood")

    runtime.launcher.start, runtime.launcher.stop = start_then_signal, lambda: stopped.append(True)
    with pytest.raises(StartupInterrupted) as caught:
        asyncio.run(runtime.start())
    assert caught.value.sig == signal.SIGTERM and stopped == [True]
    runtime.interrupt_start(signal.SIGINT)  # a second signal, the blocking part over: recorded, not raised
    assert runtime.interrupted == signal.SIGINT


def test_a_signal_before_the_start_up_stops_it_before_anything_loads():
    runtime = ServingRuntime(ServerArgs())
    runtime.interrupt_start(signal.SIGINT)  # uvicorn's lifespan has not called start() yet: recorded
    runtime.launcher.start = lambda: pytest.fail("the start-up ran after the signal")
    with pytest.raises(StartupInterrupted):
        asyncio.run(runtime.start())


def test_the_wait_for_the_workers_ends_at_a_signal():
    with pytest.raises(StartupInterrupted) as caught:
        asyncio.run(Launcher(ServerArgs()).wait_ready(interrupted=lambda: signal.SIGTERM))
    assert caught.value.sig == signal.SIGTERM
