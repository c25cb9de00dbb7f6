"""A worker's sockets: one PULL inbox it binds, PUSH sockets to the frontend (and, for prefill, to
the decode worker). Messages are typed (`bullet.types.messages`); bytes that are not one of them are
logged and dropped — they never stop the loop."""

from __future__ import annotations

import logging
import math
import os
import signal

import zmq

from bullet.types.messages import (Handoff, MalformedMessage, Message, OutputBatch, Recompute, RequestOutput, decode,
                                  encode)
from bullet.shared.endpoints import Endpoints
from bullet.types.roles import Role

log = logging.getLogger("bullet.worker.io")
SEND_TIMEOUT_MS = 10_000


class WorkerIO:
    def __init__(self, role: Role, endpoints: Endpoints):
        self.ctx = zmq.Context(1)
        # a context whose peers vanished must still terminate (found: an orphaned worker hung in
        # zmq_ctx_term on an inbox with unread input from a dead frontend): sockets default to linger 0
        self.ctx.set(zmq.BLOCKY, False)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a peer sending more is disconnected by ZMQ
        self.inbox.bind(endpoints.decode_in if role is Role.DECODE else endpoints.prefill_in)
        self.to_frontend = self._push(endpoints.frontend_in)
        self.to_decode = self._push(endpoints.decode_in) if role is Role.PREFILL else None
        self.to_prefill = self._push(endpoints.prefill_in) if role is Role.DECODE else None
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.dropped = 0
        self.dropped_sends = 0
        self._signal_pipe: tuple[int, int] | None = None

    def wake_on_signals(self) -> None:
        """Let a signal end a wait in `receive` at once (the main thread only). Without it the poll is
        resumed after the handler ran (PEP 475), and a SIGTERM that set the stop flag is seen only when
        the wait times out — up to an idle worker's heartbeat interval."""
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self.poller.register(read_end, zmq.POLLIN)
        self._signal_pipe = (read_end, write_end)

    def _push(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)  # flush outputs on a clean exit, but never hang on one
        # a peer that stopped reading (gone, or hung: the launcher restarts it) must not block a step
        # forever once the queue is full: the send fails after this long and the output is dropped
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        sock.connect(address)
        return sock

    def receive(self, timeout_s: float) -> list[Message]:
        """Everything waiting in the inbox; waits up to `timeout_s` for the first message (rounded
        up to whole milliseconds: a worker that asked to sleep until a time never wakes before it)."""
        msgs: list[Message] = []
        if timeout_s > 0:
            ready = dict(self.poller.poll(math.ceil(timeout_s * 1e3)))
            if self._signal_pipe is not None and self._signal_pipe[0] in ready:
                self._drain_signal_pipe()
            if self.inbox not in ready:
                return msgs  # timed out, or a signal: the caller looks at its stop flag
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
            self._send(self.to_frontend, encode(OutputBatch(outputs=outputs)), "outputs to the frontend")

    def send_handoff(self, handoff: Handoff) -> None:
        self._send(self.to_decode, encode(handoff), "a handoff to decode")

    def send_recompute(self, msg: Recompute) -> None:
        self._send(self.to_prefill, encode(msg), "a recompute to prefill")

    def _send(self, sock: zmq.Socket, data: bytes, what: str) -> None:
        try:
            sock.send(data)
        except zmq.Again:
            self.dropped_sends += 1
            log.error("dropped %s: the peer has not read for %.0f s (gone or hung; the launcher handles it)",
                      what, SEND_TIMEOUT_MS / 1e3)

    def send_to_prefill(self, msg: Message) -> None:
        """Decode's messages for the prefix cache's owner (pages to keep, pages to evict); in the
        order sent, after any Recompute sent before them (one socket)."""
        self.to_prefill.send(encode(msg))

    def _drain_signal_pipe(self) -> None:
        try:
            while os.read(self._signal_pipe[0], 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._signal_pipe is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._signal_pipe:
                os.close(fd)
            self._signal_pipe = None
        for sock in (self.inbox, self.to_frontend, self.to_decode, self.to_prefill):
            if sock is not None:
                sock.close()  # each with its own linger: 0 for the inbox, bounded for the outputs
        self.ctx.term()
