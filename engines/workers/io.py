"""A worker's sockets: one PULL inbox it binds, PUSH sockets to the frontend (and, for prefill, to
the decode worker). Messages are typed (`bullet.messages`)."""

from __future__ import annotations

import zmq

from bullet.messages import Handoff, Message, OutputBatch, RequestOutput, decode, encode
from bullet.runtime.endpoints import Endpoints


class WorkerIO:
    def __init__(self, role: str, endpoints: Endpoints):
        self.ctx = zmq.Context(1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(endpoints.decode_in if role == "decode" else endpoints.prefill_in)
        self.to_frontend = self._push(endpoints.frontend_in)
        self.to_decode = self._push(endpoints.decode_in) if role == "prefill" else None
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)  # flush outputs on a clean exit, but never hang on one
        sock.connect(address)
        return sock

    def receive(self, timeout_ms: int) -> list[Message]:
        """Everything waiting in the inbox; waits up to timeout_ms for the first message."""
        msgs: list[Message] = []
        if timeout_ms > 0 and not self.poller.poll(timeout_ms):
            return msgs
        while True:
            try:
                msgs.append(decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self.to_frontend.send(encode(OutputBatch(outputs=outputs)))

    def send_handoff(self, handoff: Handoff) -> None:
        self.to_decode.send(encode(handoff))

    def close(self) -> None:
        for sock in (self.inbox, self.to_frontend, self.to_decode):
            if sock is not None:
                sock.close()
        self.ctx.term()
