"""An idle keep-alive connection stays open longer than clients keep theirs (`--timeout-keep-alive`, 65 s),
so the client lets go first. With uvicorn's own 5 s, a pooled client (aiohttp keeps idle connections
15 s) that sent a request on a connection idle for ~5 s met the server closing it and lost the request
(ServerDisconnectedError: once in a 10-minute soak at 0.5 req/s, and at will with a 5.0 s pause)."""

from __future__ import annotations

import http.client
import time

from bullet.config import ServerArgs


def _health(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    return response.status


def test_an_idle_connection_outlives_uvicorns_five_seconds(server):
    assert ServerArgs().timeout_keep_alive > 15  # above aiohttp's idle pool; httpx keeps 5 s
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        assert _health(conn) == 200
        sock = conn.sock  # kept open for the next request
        time.sleep(5.5)  # uvicorn's default would have closed it at 5 s
        # on a connection the server closed, this raises RemoteDisconnected (http.client does not retry)
        assert _health(conn) == 200 and conn.sock is sock, "the server closed an idle connection after 5 s"
    finally:
        conn.close()
