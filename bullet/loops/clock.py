"""The time a loop core runs on: wall-clock (monotonic) in a worker process and the offline `LLM`,
virtual in the simulator (`bullet.sim.events.VirtualClock`)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()
