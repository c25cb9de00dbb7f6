"""The HTTP application: the serving runtime's lifetime is the app's lifespan (the port opens only
once both workers are ready), an API-key check, routes, errors, metrics."""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from bullet import __version__
from bullet.config import ServerArgs
from bullet.http import native, openai_api
from bullet.http.errors import APIError, api_error_handler
from bullet.http.metrics import Metrics
from bullet.runtime.serving import ServingRuntime

log = logging.getLogger("bullet.http")
OPEN_PATHS = {"/health", "/metrics"}  # liveness probes and scrapers need no key


def create_app(args: ServerArgs, runtime: ServingRuntime | None = None) -> FastAPI:
    runtime = runtime or ServingRuntime(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        app.state.metrics = Metrics(runtime)
        runtime.client.on_finish = app.state.metrics.on_finish
        log.info("serving %s with policy %s", runtime.model.model_name, args.policy)
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(title="Bullet", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime
    app.add_exception_handler(APIError, api_error_handler)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return await api_error_handler(request, APIError(f"invalid request: {exc.errors()[:3]}"))

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        if args.api_key and request.url.path not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), args.api_key.encode()):
                return await api_error_handler(request, APIError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                    type_="authentication_error"))
        response = await call_next(request)
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.http.labels(request.url.path if response.status_code != 404 else "other",
                                str(response.status_code)).inc()
        return response

    app.include_router(native.router)
    app.include_router(openai_api.router)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def root():
        return JSONResponse({"name": "bullet", "version": __version__})

    return app
