"""The HTTP application: the serving runtime's lifetime is the app's lifespan (the port opens only
once both workers are ready), an API-key check, a body-size limit, routes, errors, metrics."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from bullet import __version__
from bullet.config import ServerArgs
from bullet.frontend.http import native, openai_api
from bullet.frontend.http.body_limit import BodyLimit
from bullet.frontend.http.errors import APIError, api_error_handler
from bullet.frontend.http.metrics import Metrics
from bullet.frontend.http.middleware import AuthAndCount
from bullet.frontend.serving import ServingRuntime
from bullet.launcher.launcher import StartupInterrupted, WorkerStartupError
from engines.weights import ModelLoadError

log = logging.getLogger("bullet.http")


def create_app(args: ServerArgs, runtime: ServingRuntime | None = None) -> FastAPI:
    runtime = runtime or ServingRuntime(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await runtime.start()
        except (ModelLoadError, WorkerStartupError, StartupInterrupted) as exc:  # `bullet launch` says it in one line
            runtime.startup_error = exc
            raise
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

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # unknown paths and wrong methods answer in the same JSON shapes as every other error
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return await api_error_handler(request, APIError(message, status=exc.status_code))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        # the client hung up while sending its body: nobody reads the answer, and nothing was queued
        log.debug("client disconnected during %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return await api_error_handler(request, APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                         type_="server_error"))

    # added last = outermost: the key is checked before a byte of the body is read, then its size
    app.add_middleware(BodyLimit, max_bytes=args.max_request_body_bytes)
    app.add_middleware(AuthAndCount, api_key=args.api_key, metrics_of=lambda: getattr(app.state, "metrics", None))

    app.include_router(native.router)
    app.include_router(openai_api.router)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def root():
        return JSONResponse({"name": "bullet", "version": __version__})

    return app
