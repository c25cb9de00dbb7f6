"""A worker's sockets: one PULL inbox it binds, PUSH sockets to the frontend (and, for prefill, to
the decode worker). Messages are typed (`bullet.core.messages`); bytes that are not one of them are
logged and dropped — they never stop the loop."""

from __future__ import annotations

import logging
import math

import zmq

from bullet.core.messages import (Handoff, MalformedMessage, Message, OutputBatch, Recompute, RequestOutput, decode,
                                  encode)
from bullet.core.roles import Role
from bullet.runtime.endpoints import Endpoints

log = logging.getLogger("bullet.worker.io")


class WorkerIO:
    def __init__(self, role: Role, endpoints: Endpoints):
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a peer sending more is disconnected by ZMQ
        self.inbox.bind(endpoints.decode_in if role is Role.DECODE else endpoints.prefill_in)
        self.to_frontend = self._push(endpoints.frontend_in)
        self.to_decode = self._push(endpoints.decode_in) if role is Role.PREFILL else None
        self.to_prefill = self._push(endpoints.prefill_in) if role is Role.DECODE else None
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.dropped = 0

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)  # flush outputs on a clean exit, but never hang on one
        sock.connect(address)
        return sock

    def receive(self, timeout_s: float) -> list[Message]:
        """Everything waiting in the inbox; waits up to `timeout_s` for the first message (rounded
        up to whole milliseconds: a worker that asked to sleep until a time never wakes before it)."""
        msgs: list[Message] = []
        if timeout_s > 0 and not self.poller.poll(math.ceil(timeout_s * 1e3)):
            return msgs
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            try:
                msgs.append(decode(data))
            except MalformedMessage as exc:
                self.dropped += 1
                log.warning("dropped a malformed message (%d bytes): %s", len(data), exc)

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.to_frontend.send(encode(OutputBatch(outputs=outputs)))

    def send_handoff(self, handoff: Handoff) -> None:
        self.to_decode.send(encode(handoff))

    def send_recompute(self, msg: Recompute) -> None:
        self.to_prefill.send(encode(msg))

    def send_to_prefill(self, msg: Message) -> None:
        """Decode's messages for the prefix cache's owner (pages to keep, pages to evict); in the
        order sent, after any Recompute sent before them (one socket)."""
        self.to_prefill.send(encode(msg))

    def close(self) -> None:
        for sock in (self.inbox, self.to_frontend, self.to_decode, self.to_prefill):
            if sock is not None:
                sock.close()
        self.ctx.term()
