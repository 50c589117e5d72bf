"""The HTTP door of collm-edge and collm-router: a request body is bounded before anything reads it.

Without a bound one 50 MB JSON prompt grew an edge to 6.7 GB and held its event loop for two minutes
(issue #34). `BodyLimit` is a plain ASGI middleware: a declared `Content-Length` over the limit is
answered 413 before a byte of the body is read, and a body without one (chunked) is read only up to the
limit, then refused the same way; a body within the limit is handed on unchanged. The answer is the
OpenAI error shape with the limit and the setting that raises it.
"""

from __future__ import annotations

import json

from collm.common.protocol import error_body

BODY_METHODS = (b"POST", b"PUT", b"PATCH")
CLOSE = [(b"connection", b"close")]  # the rest of a refused body is never read: the connection cannot be reused


async def json_reply(send, status: int, body: dict, headers: list | None = None) -> None:
    """Answer a request at the ASGI level (a middleware, before any app) with a JSON body."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


def _too_large(size: str, limit: int, setting: str) -> dict:
    msg = f"the request body is {size}; this server takes at most {limit} bytes ({setting})"
    return error_body(msg, "invalid_request_error", code="request_too_large")


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, decided before the body is read whole."""

    def __init__(self, app, max_bytes: int, setting: str):
        self.app, self.max_bytes, self.setting = app, max_bytes, setting

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"].encode() not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and b"transfer-encoding" not in headers:  # chunked framing wins: count it below
            try:
                n = int(declared)
            except ValueError:
                return await json_reply(send, 400, error_body("Content-Length is not a number",
                                                              code="invalid_content_length"), CLOSE)
            if n > self.max_bytes:
                return await json_reply(send, 413, _too_large(f"{n} bytes", self.max_bytes, self.setting), CLOSE)
            return await self.app(scope, receive, send)
        # no declared length: read at most the limit here, then replay what was read to the app
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body ended
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await json_reply(send, 413, _too_large(f"over {self.max_bytes} bytes", self.max_bytes,
                                                              self.setting), CLOSE)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # only a disconnect can follow
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
