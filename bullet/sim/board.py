"""The state buffer of a simulated server: each worker publishes a `WorkerState` for its role and
reads its peer's — the same records, at the same points, as in the worker processes (the loop cores
publish them). A publish replaces the role's snapshot with a new object, so a reader holds a
consistent copy as with the shared-memory seqlock; listeners let a waiting worker notice its peer's
change (a worker process notices by polling)."""

from __future__ import annotations

from typing import Callable

from bullet.loops.clock import Clock
from bullet.types.roles import BLOCK_ROLES, Role
from bullet.types.worker_state import WorkerState


class StateBoard:
    def __init__(self, clock: Clock):
        self.clock = clock
        self._states = {role: WorkerState() for role in BLOCK_ROLES}
        self._beats = dict.fromkeys(BLOCK_ROLES, 0)
        self._listeners: dict[Role, list[Callable[[], None]]] = {role: [] for role in BLOCK_ROLES}
        # a role, or its name, -> its block (`Role(role).block`, looked up: every publish and read asks)
        self._block = {key: role.block for role in Role for key in (role, role.value)}

    def publish(self, role: str, state: WorkerState) -> int:
        role = self._block.get(role) or Role(role).block  # (an unknown role: Role's ValueError)
        beat = self._beats[role] = self._beats[role] + 1
        state.heartbeat_ns, state.heartbeat_count = int(self.clock.now() * 1e9), beat
        self._states[role] = state
        for listener in self._listeners[role]:
            listener()
        return beat

    def read(self, role: str) -> WorkerState:
        return self._states[self._block.get(role) or Role(role).block]

    def on_publish(self, role: str, listener: Callable[[], None]) -> None:
        """Call `listener` after every publish by `role`."""
        self._listeners[Role(role).block].append(listener)
