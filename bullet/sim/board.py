"""The state buffer of a simulated server: each worker publishes a `WorkerState` for its role and
reads its peer's, exactly the fields the real loops publish (`engines/workers/*_loop.py` through
`WorkerContext.publish`). A publish replaces the role's snapshot with a new object, so a reader
holds a consistent copy as with the shared-memory seqlock; listeners let a waiting worker notice
its peer's change (the real loops notice by polling)."""

from __future__ import annotations

from typing import Callable

from bullet.state_buffer import ROLES, WorkerState


class StateBoard:
    def __init__(self):
        self._states = {role: WorkerState() for role in ROLES}
        self._beats = dict.fromkeys(ROLES, 0)
        self._listeners: dict[str, list[Callable[[], None]]] = {role: [] for role in ROLES}

    def publish(self, role: str, state: WorkerState, heartbeat_ns: int) -> None:
        self._beats[role] += 1
        state.heartbeat_ns, state.heartbeat_count = heartbeat_ns, self._beats[role]
        self._states[role] = state
        for listener in self._listeners[role]:
            listener()

    def read(self, role: str) -> WorkerState:
        return self._states[role]

    def on_publish(self, role: str, listener: Callable[[], None]) -> None:
        """Call `listener` after every publish by `role`."""
        self._listeners[role].append(listener)
