"""Priority scheduling served for real, from the HTTP body to the worker's queue: with the server
busy (one running request at most, `--max-running-requests 1`), a low-priority request and then a
high-priority one wait together; the high one is admitted first. With one request running at a
time, the low one cannot start before the high one has finished — an order, not a timing. A
two-process policy (static) and the one-process chunked baseline."""

from __future__ import annotations

import threading
import time

import pytest

from tests.server_utils import ServerProcess


def _wait(server, what, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server.state()
        if predicate(state):
            return
        time.sleep(0.01)
    pytest.fail(f"the server never had {what}: {server.state()}")


@pytest.mark.parametrize("policy", ["static", "chunked:64"])
def test_the_higher_priority_waiting_request_runs_first(policy):
    params = {"temperature": 0, "ignore_eos": True}
    with ServerProcess("--policy", policy, "--enable-priority-scheduling", "--max-running-requests", "1",
                       "--max-total-tokens", "4096") as server:
        done: dict[str, float] = {}
        errors = []

        def one(name, priority, max_new_tokens):
            status, body = server.post("/generate", {"text": f"Tell me a story about {name}.", "priority": priority,
                                                     "sampling_params": {**params, "max_new_tokens": max_new_tokens}})
            if status != 200:
                errors.append((name, status, body))
            done[name] = time.monotonic()

        threads = [threading.Thread(target=one, args=("busy", None, 32))]
        threads[0].start()
        _wait(server, "the busy request running", lambda s: s["inflight_requests"] == 1)
        threads.append(threading.Thread(target=one, args=("low", 0, 4)))
        threads[-1].start()
        _wait(server, "the low request queued", lambda s: s["prefill"]["queued_requests"] == 1)
        threads.append(threading.Thread(target=one, args=("high", 5, 4)))
        threads[-1].start()
        _wait(server, "both requests queued behind the busy one", lambda s: s["prefill"]["queued_requests"] == 2)
        assert "busy" not in done, "the busy request ended before both others queued: lengthen it"
        for t in threads:
            t.join()
        assert not errors, errors
        assert done["busy"] < done["high"] < done["low"], done
