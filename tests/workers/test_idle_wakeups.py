"""An idle server sleeps: its workers block on their sockets between heartbeats, a signal ends that
wait at once (so a SIGTERM still stops an idle worker without delay), and the launcher learns of a
worker's exit from the process itself rather than by polling for it."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading
import time

import zmq

from bullet.frontend.serving import WorkerExits
from bullet.shared.endpoints import Endpoints, make_runtime_dir, remove_runtime_dir
from bullet.types.messages import FlushCache, encode
from bullet.types.roles import Role
from bullet.types.worker_state import HEARTBEAT_INTERVAL_S, heartbeat_interval_s
from bullet.workers.driver import WorkerDriver
from bullet.loops.base import Wake


def test_an_idle_worker_publishes_often_enough_for_the_watchdog_and_no_more():
    assert heartbeat_interval_s(30.0) == HEARTBEAT_INTERVAL_S  # the default watchdog: once a second
    assert heartbeat_interval_s(2.0) == 0.5  # a tight watchdog: four heartbeats inside its timeout
    assert heartbeat_interval_s(0.0) == HEARTBEAT_INTERVAL_S  # watchdog off

    class IdleCore:
        idle = True

    driver = WorkerDriver(IdleCore(), io=None, should_stop=lambda: True, heartbeat_s=0.5)
    assert driver.timeout_s(Wake.EVENT) == 0.5
    IdleCore.idle = False  # waiting on the peer: looks again within milliseconds
    assert driver.timeout_s(Wake.EVENT) < 0.01


def _kill_self_after(delay: float, signum: int) -> threading.Thread:
    def fire():
        time.sleep(delay)
        signal.pthread_kill(threading.main_thread().ident, signum)
    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


def test_a_signal_ends_a_long_wait_on_the_socket_and_messages_still_arrive():
    from bullet.workers.io import WorkerIO

    runtime = make_runtime_dir("test-wakeups")
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    io = WorkerIO(Role.DECODE, Endpoints.in_dir(runtime, 1))
    try:
        io.wake_on_signals()
        thread = _kill_self_after(0.2, signal.SIGUSR1)
        began = time.monotonic()
        assert io.receive(30.0) == []  # woken by the signal, not by a message
        waited = time.monotonic() - began
        thread.join()
        assert received == [signal.SIGUSR1]
        assert waited < 10.0, f"the wait ran {waited:.1f}s of its 30s: the signal did not end it"

        push = io.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(Endpoints.in_dir(runtime, 1).decode_in)
        push.send(encode(FlushCache()))
        deadline = time.monotonic() + 30
        got = []
        while not got and time.monotonic() < deadline:
            got = io.receive(1.0)
        push.close()
        assert [type(m) for m in got] == [FlushCache]
    finally:
        io.close()
        signal.signal(signal.SIGUSR1, previous)
        remove_runtime_dir(runtime)
    assert signal.set_wakeup_fd(-1) == -1  # closing the sockets handed the signal wake-up back


def _sleep_long():
    time.sleep(60)


def test_the_supervisor_is_woken_by_a_worker_that_exits_and_stops_watching_it():
    proc = multiprocessing.get_context("spawn").Process(target=_sleep_long, daemon=True)
    proc.start()

    async def scenario() -> tuple[float, int, float]:
        exits = WorkerExits(asyncio.get_running_loop())
        exits.watch([proc.sentinel])
        await exits.wait(0.05)  # nothing exited: the wait times out
        assert not exits.event.is_set() and exits.fds == {proc.sentinel}
        proc.kill()
        began = time.monotonic()
        await exits.wait(60.0)
        woke_after = time.monotonic() - began
        watched = len(exits.fds)
        # the exited process's sentinel stays readable; still watched, it would wake every pass
        began = time.monotonic()
        await exits.wait(0.3)
        return woke_after, watched, time.monotonic() - began

    woke_after, watched, quiet_wait = asyncio.run(scenario())
    proc.join(10)
    assert woke_after < 30.0, f"the exit woke the supervisor only after {woke_after:.1f}s"
    assert watched == 0
    assert quiet_wait >= 0.25  # nothing left to wake it: the wait ran its course
