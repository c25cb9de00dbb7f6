"""API-key check and per-path request counting, as plain ASGI middleware.

Why not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware wraps `receive` in a task group,
and `Request.is_disconnected()` probes `receive` inside an already-cancelled scope, so behind it the
probe never sees `http.disconnect` — a non-streaming client that hangs up would leave its request
generating to the end. Plain ASGI passes `receive` through untouched."""

from __future__ import annotations

import hmac
import json

from bullet.frontend.http.errors import APIError, is_openai_path

# Liveness probes and scrapers need no key (SGLang leaves /health* and /metrics open as well).
OPEN_PATHS = ("/health", "/health_generate", "/metrics")


def bearer_token(scope) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            header = value.decode("latin-1")
            return header[7:].strip() if header[:7].lower() == "bearer " else ""
    return ""


class AuthAndCount:
    def __init__(self, app, api_key: str | None, metrics_of):
        self.app, self.api_key = app, api_key
        self.metrics_of = metrics_of  # () -> Metrics | None (exists once the lifespan has started)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.api_key and path not in OPEN_PATHS and not hmac.compare_digest(
                bearer_token(scope).encode(), self.api_key.encode()):
            return await self._unauthorized(path, send)
        status = {}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # the router records the route it matched; unmatched paths (scanners) share one label
            # so that they cannot grow the number of series
            route = getattr(scope.get("route"), "path", None)
            self._count(route or "other", status.get("code", 500))

    async def _unauthorized(self, path: str, send) -> None:
        err = APIError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                       type_="authentication_error")
        body = json.dumps(err.openai_body() if is_openai_path(path) else err.native_body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
        self._count("unauthorized", 401)

    def _count(self, label: str, code: int) -> None:
        metrics = self.metrics_of()
        if metrics is not None:
            metrics.http.labels(label, str(code)).inc()
