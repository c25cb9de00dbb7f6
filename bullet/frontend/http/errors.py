"""Errors the API returns: every bad request becomes a 4xx with a JSON body that names the problem,
in the shape each client family expects (SGLang native: {"error": {"message"}}, OpenAI:
{"object": "error", "message", "type", "param", "code"})."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.headers = message, status, type_, param, headers
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                             405: "method_not_allowed", 413: "too_large", 499: "client_closed_request",
                             500: "internal_error", 503: "unavailable"}.get(status, "error")

    def native_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.status}}

    def openai_body(self) -> dict:
        return {"object": "error", "message": self.message, "type": self.type, "param": self.param,
                "code": self.code}


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    body = exc.openai_body() if is_openai_path(request.url.path) else exc.native_body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def stream_error_event(message: str, code: int = 400) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error" if code < 500 else "server_error",
                      "code": code}}
