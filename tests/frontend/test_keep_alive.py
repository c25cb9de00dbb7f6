"""An idle keep-alive connection stays open longer than clients keep theirs (`--timeout-keep-alive`, 65 s),
so the client lets go first. With uvicorn's own 5 s, a pooled client (aiohttp keeps idle connections
15 s) that sent a request on a connection idle for ~5 s met the server closing it and lost the request
(ServerDisconnectedError: once in a 10-minute soak at 0.5 req/s, and at will with a 5.0 s pause)."""

from __future__ import annotations

import socket
import time

from bullet.config import ServerArgs

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n"


def _one_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_an_idle_connection_outlives_uvicorns_five_seconds(server):
    assert ServerArgs().timeout_keep_alive > 15  # above aiohttp's idle pool; httpx keeps 5 s
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(REQUEST)
        assert _one_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)  # uvicorn's default would have closed it at 5 s
        sock.sendall(REQUEST)
        assert _one_response(sock).startswith(b"HTTP/1.1 200"), "the server closed an idle connection after 5 s"
