"""Virtual time: a clock the loop cores read (the `Clock` protocol of `bullet.loops.clock`) and
the event queue that moves it. Time jumps from one event to the next and nothing else moves it, so
every second that passes is a second some event (an arrival, the end of a charged step, a worker's
poll) accounted for."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable


class VirtualClock:
    """`now()` for the policies and workers; only the event loop advances it."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now


class EventLoop:
    """Callbacks ordered by (time, insertion order): two events at one instant run in the order
    they were scheduled, which keeps a run deterministic.

    Events known in advance and in time order (a workload's arrivals) can wait in a list of their own
    (`at_each`) instead of the heap: they run exactly when and in the order they would from the heap,
    and the heap — pushed and popped for every step, wake-up and step end — stays a few events deep
    instead of holding every future arrival."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        # scheduled with `at_each`: in (time, insertion order), the next one at `_next`
        self._sorted: list[tuple[float, int, Callable, tuple]] = []
        self._next = 0
        self.processed = 0
        self._stopped = False

    def at(self, when: float, callback: Callable, *args) -> None:
        if when < self.clock._now:
            raise ValueError(f"cannot schedule in the past ({when} < {self.clock._now})")
        heapq.heappush(self._heap, (when, next(self._order), callback, args))

    def at_each(self, events: Iterable[tuple[float, Callable, tuple]]) -> None:
        """`at(when, callback, *args)` for each (when, callback, args) of `events`, in turn. Events
        given in time order, while no earlier `at_each` has any left, wait in a list instead of the
        heap (same order of execution)."""
        rows = [(when, next(self._order), callback, args) for when, callback, args in events]
        if any(row[0] < self.clock._now for row in rows):
            raise ValueError(f"cannot schedule in the past (before {self.clock._now})")
        in_order = all(a[0] <= b[0] for a, b in zip(rows, rows[1:]))
        if in_order and self._next >= len(self._sorted):
            self._sorted, self._next = rows, 0
            return
        for row in rows:
            heapq.heappush(self._heap, row)

    def soon(self, callback: Callable, *args) -> None:
        """At the current instant, after what is already scheduled for it."""
        self.at(self.clock._now, callback, *args)

    def stop(self) -> None:
        self._stopped = True

    def run(self) -> None:
        """Until no event is left (or `stop()`)."""
        heap, clock, pop = self._heap, self.clock, heapq.heappop
        while not self._stopped:
            rows, i = self._sorted, self._next
            if i < len(rows) and (not heap or rows[i] < heap[0]):  # by (time, order): never a tie
                when, _, callback, args = rows[i]
                self._next = i + 1
            elif heap:
                when, _, callback, args = pop(heap)
            else:
                break
            clock._now = when
            self.processed += 1
            callback(*args)

    def __len__(self) -> int:
        return len(self._heap) + len(self._sorted) - self._next
