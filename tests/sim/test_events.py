"""The event loop: events run in (time, insertion order), whether they wait in the heap (`at`) or in
the list of events known in advance (`at_each`) — the same order either way, ties included."""

from __future__ import annotations

import random

import pytest

from bullet.sim.events import EventLoop, VirtualClock


def trace(use_at_each: bool, seed: int) -> list[tuple[float, str]]:
    """Arrivals on a coarse grid (ties with each other and with other events), each scheduling
    follow-ups at the same instant or later, some of which schedule more; a second batch of
    arrivals is added mid-run (it cannot join the list while the first has events left)."""
    rng = random.Random(seed)
    loop, seen = EventLoop(VirtualClock()), []

    def event(name: str, depth: int) -> None:
        seen.append((loop.clock.now(), name))
        for k in range(rng.randint(0, 2) if depth < 3 else 0):
            loop.at(loop.clock.now() + rng.choice((0.0, 0.5, 1.0, 2.5)), event, f"{name}.{k}", depth + 1)

    def schedule(times: list[float], prefix: str) -> None:
        if use_at_each:
            loop.at_each((t, event, (f"{prefix}{i}", 0)) for i, t in enumerate(times))
        else:
            for i, t in enumerate(times):
                loop.at(t, event, f"{prefix}{i}", 0)

    first = sorted(rng.choice((0.0, 0.5, 1.0, 1.5, 3.0, 7.0)) for _ in range(30))
    loop.at(0.0, event, "tick", 2)
    schedule(first, "a")
    loop.at(2.0, lambda: schedule(sorted(2.0 + rng.choice((0.0, 1.0, 5.0)) for _ in range(10)), "b"))
    loop.at(0.5, event, "late-tie", 3)
    loop.run()
    assert len(loop) == 0
    return seen


@pytest.mark.parametrize("seed", range(20))
def test_events_known_in_advance_run_as_if_each_were_scheduled_alone(seed):
    assert trace(True, seed) == trace(False, seed)


def test_at_each_keeps_its_events_out_of_the_heap_and_counts_them():
    loop = EventLoop(VirtualClock())
    loop.at_each((float(t), lambda: None, ()) for t in range(100))
    assert len(loop._heap) == 0 and len(loop) == 100
    loop.at(50.0, loop.stop)
    loop.run()
    assert len(loop) == 49  # 0..50 ran (the stop came after the arrival at 50: scheduled later)
    with pytest.raises(ValueError, match="past"):
        loop.at_each([(1.0, lambda: None, ())])
