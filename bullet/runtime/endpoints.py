"""ZMQ endpoints of one server instance. Abstract-namespace IPC sockets (`ipc://@name`, Linux):
nothing is created on disk, so nothing is left behind when a process dies. The incarnation number
changes when the workers are restarted, so a message addressed to a dead worker never reaches its
replacement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoints:
    prefill_in: str  # frontend -> prefill: requests, aborts
    decode_in: str  # prefill -> decode: handoffs; frontend -> decode: aborts
    frontend_in: str  # prefill, decode -> frontend: outputs

    @classmethod
    def for_instance(cls, instance_id: str, incarnation: int) -> "Endpoints":
        base = f"ipc://@bullet-{instance_id}-{incarnation}"
        # the frontend outlives worker restarts: its endpoint stays; late outputs of a dead
        # incarnation name requests the frontend has already failed and are dropped there
        return cls(f"{base}-prefill", f"{base}-decode", f"ipc://@bullet-{instance_id}-frontend")
