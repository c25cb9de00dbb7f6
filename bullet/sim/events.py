"""Virtual time: a clock the schedulers read (the `Clock` protocol of `bullet.schedulers.views`) and
the event queue that moves it. Time jumps from one event to the next and nothing else moves it, so
every second that passes is a second some event (an arrival, the end of a charged step, a worker's
poll) accounted for."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class VirtualClock:
    """`now()` for the policies and workers; only the event loop advances it."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now


class EventLoop:
    """Callbacks ordered by (time, insertion order): two events at one instant run in the order
    they were scheduled, which keeps a run deterministic."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self.processed = 0
        self._stopped = False

    def at(self, when: float, callback: Callable, *args) -> None:
        if when < self.clock._now:
            raise ValueError(f"cannot schedule in the past ({when} < {self.clock._now})")
        heapq.heappush(self._heap, (when, next(self._order), callback, args))

    def soon(self, callback: Callable, *args) -> None:
        """At the current instant, after what is already scheduled for it."""
        self.at(self.clock._now, callback, *args)

    def stop(self) -> None:
        self._stopped = True

    def run(self) -> None:
        """Until no event is left (or `stop()`)."""
        heap, clock = self._heap, self.clock
        while heap and not self._stopped:
            when, _, callback, args = heapq.heappop(heap)
            clock._now = when
            self.processed += 1
            callback(*args)

    def __len__(self) -> int:
        return len(self._heap)
