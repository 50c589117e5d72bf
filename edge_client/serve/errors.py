"""The edge API's errors: one OpenAI-style JSON body for every failure, ASCII-safe, naming the field."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from collm.common.protocol import error_body


class ApiError(Exception):
    """An error a handler raises; the app renders it as `error_body` with its status and headers."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


class _AsciiJSON(JSONResponse):
    """JSON escaped to ASCII: an error message that quotes the client's text (even a lone surrogate) renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None) -> JSONResponse:
    return _AsciiJSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """ApiError, a body that fails validation (the first problem, named by its field) and Starlette's own
    HTTP errors all answer in the one error shape."""

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", param=None, code="invalid_json")
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)
