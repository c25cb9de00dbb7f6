"""The request-body size limit, enforced while the body arrives rather than after it has been read.

A declared `Content-Length` over the limit is answered 413 at once, without reading a byte of the
body. A chunked body (no length declared) is counted as it streams in, and the read that crosses
the limit fails with the same 413; the handler never holds more than the limit in memory."""

from __future__ import annotations

import json

from bullet.frontend.http.errors import APIError, is_openai_path


def too_large(limit: int) -> APIError:
    return APIError(f"the request body exceeds the server's limit of {limit} bytes (--max-request-body-bytes)",
                    status=413)


def declared_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser rejects these before us; be safe anyway
                return None
    return None


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            return await self._reject(scope, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the handler's `await request.body()`: the app's APIError handler
                    # answers it in the path's error shape
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)

    async def _reject(self, scope, send) -> None:
        err = too_large(self.max_bytes)
        path = scope.get("path", "")
        body = json.dumps(err.openai_body() if is_openai_path(path) else err.native_body()).encode()
        # `connection: close`: the unread body is still on its way; this connection cannot be reused
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
