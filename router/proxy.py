"""One try of a request on one edge, and the relay of its answer (a mixin of `app.Router`).

`_attempt` sends the request and holds the response until the edge's first byte (for a stream, its
first chunk), so that a failure before it raises `AttemptFailed` and the router may retry on another edge;
after that the answer is the client's: a JSON body is read whole (given up if the client leaves,
which cancels the edge's work), a stream is relayed chunk by chunk and a break in it becomes an SSE
error event. Every response gets the edge's version and name headers, the attempt number and the
rule's soonest-TTFT estimate; what the edge reports back (its TTFT, the output length) feeds the
router's estimate metrics and its typical output length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from collm.common.protocol import EDGE_HEADER, VERSION_HEADER, error_body
from collm.router.poller import describe
from collm.router.policy import Estimate
from collm.router.requests import SSEWatch
from collm.router.state import EdgeState

log = logging.getLogger("collm.router")

ATTEMPTS_HEADER = "X-CoLLM-Router-Attempts"
SOONEST_HEADER = "X-CoLLM-Soonest-TTFT"  # seconds: the slo rule's TTFT estimate on the soonest edge
PASSED_HEADERS = ("content-type", VERSION_HEADER.lower(), EDGE_HEADER.lower(), "retry-after", "cache-control")
MAX_REPORTED_TTFT_S = 1e6  # an edge's reported TTFT past this (or a 300-digit integer) is not learned from


LOAD_429_CODES = ("queue_full", "slo_unattainable")  # an edge's 429s for its load (not a key's rate limit)


def error_code(content: bytes) -> str | None:
    """The `error.code` of an OpenAI-style error body, if it has one."""
    try:
        code = json.loads(content).get("error", {}).get("code")
    except (ValueError, AttributeError, RecursionError):
        return None
    return code if isinstance(code, str) else None


class AttemptFailed(Exception):
    """An attempt that failed before the client got a byte (may be retried)."""

    def __init__(self, reason: str, why: str, response: Response | None = None):
        super().__init__(why)
        self.reason, self.why, self.response = reason, why, response


class ClientGone(Exception):
    pass


class OpenAttempt:
    """One try in flight on an edge: counted in `edge.outstanding`, and a stream in `awaiting` (sent at, TTFT
    target) until its first token, holding the edge's response, until `close`, which is idempotent (the relay and
    the response's background both call it)."""

    def __init__(self, edge: EdgeState, awaiting: dict, ttft_target_s: float | None):
        self.edge = edge
        self.up: httpx.Response | None = None
        self.closed = False
        self.awaiting = awaiting
        if ttft_target_s is not None:
            awaiting[self] = (time.monotonic(), ttft_target_s)
        edge.outstanding += 1

    def first_token(self) -> None:
        self.awaiting.pop(self, None)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.first_token()
        self.edge.outstanding -= 1
        if self.up is not None:
            with anyio.CancelScope(shield=True):
                await self.up.aclose()


class EdgeProxy:
    """Needs `cfg`, `client` (httpx), `metrics` (RouterMetrics), `admission` (AdmissionController),
    `awaiting` (the tries without a first token yet) and `_learn_output` from the router."""

    async def _attempt(self, edge: EdgeState, est: Estimate, method: str, path: str, raw: bytes, headers: dict,
                       stream: bool, attempt: int, request: Request, soonest: Estimate | None = None) -> Response:
        """One try on one edge; raises AttemptFailed when the client has had nothing yet and a retry may help."""
        self.metrics.routed.labels(edge.name).inc()
        # only a stream shows its first token when it comes (a JSON answer's wait would include its decoding)
        held = OpenAttempt(edge, self.awaiting, est.ttft_target_s if stream else None)
        edge.last_sent = time.monotonic()
        handed_off = False
        t0 = time.perf_counter()
        try:
            held.up = up = await self._send(edge, method, path, raw, headers)
            edge.last_progress = time.monotonic()
            out_headers = self._headers(up, edge, attempt, soonest)
            if up.status_code >= 400:
                return await self._error_answer(edge, up, out_headers)
            if stream and up.headers.get("content-type", "").startswith("text/event-stream"):
                chunks, first = await self._first_chunk(edge, up)
                handed_off = True
                return StreamingResponse(self._relay(edge, est, chunks, first, t0, held),
                                         status_code=up.status_code, headers=out_headers,
                                         media_type="text/event-stream", background=BackgroundTask(held.close))
            return await self._json_answer(edge, est, up, request, out_headers)
        finally:
            if not handed_off:
                await held.close()

    async def _send(self, edge: EdgeState, method: str, path: str, raw: bytes, headers: dict) -> httpx.Response:
        """The edge's response, its body not read yet; a transport error raises AttemptFailed."""
        try:
            return await self.client.send(self.client.build_request(method, edge.url + path, content=raw,
                                                                    headers=headers), stream=True)
        except httpx.HTTPError as e:
            self._transport_failure(edge, e)
            raise AttemptFailed("connect" if isinstance(e, httpx.ConnectError) else "read", describe(e)) from None

    async def _error_answer(self, edge: EdgeState, up: httpx.Response, out_headers: dict) -> Response:
        """An edge's 4xx or 5xx: 5xx (and 429 under `routing.retry_429`) raise AttemptFailed with the answer,
        other 4xx are the client's mistake and pass through."""
        status = up.status_code
        if status in (429, 503):  # overloaded or not ready: leave it alone for a while either way
            edge.cool_down(self.cfg.health.cooldown_s, f"answered {status}")
        retried = status >= 500 or (status == 429 and self.cfg.routing.retry_429)
        content = await (self._read_quietly(up) if retried else up.aread())
        if status == 429 and error_code(content) in LOAD_429_CODES:  # what admission let through came too late
            self.admission.shed(time.monotonic())
        if retried:
            self.metrics.failures.labels(edge.name, f"http_{status}").inc()
            self.metrics.responses.labels(edge.name, f"{status // 100}xx").inc()
            raise AttemptFailed(str(status), f"answered {status}", Response(content, status, out_headers))
        self.metrics.responses.labels(edge.name, "4xx").inc()
        return Response(content, status, out_headers)

    async def _first_chunk(self, edge: EdgeState, up: httpx.Response) -> tuple[AsyncIterator[bytes], bytes]:
        """The stream's chunks and its first one: a failure before it raises AttemptFailed (the stream is retried)."""
        chunks = up.aiter_raw()
        try:
            return chunks, await chunks.__anext__()
        except (httpx.HTTPError, StopAsyncIteration) as e:
            self._transport_failure(edge, e)
            raise AttemptFailed("read", describe(e)) from None

    async def _json_answer(self, edge: EdgeState, est: Estimate, up: httpx.Response, request: Request,
                           out_headers: dict) -> Response:
        """The whole body, unless the client leaves first; a read failure raises AttemptFailed."""
        try:
            content = await self._read_unless_gone(up, request)
        except ClientGone:  # nobody to answer; closing the connection cancels the edge's work
            self.metrics.responses.labels(edge.name, "client_gone").inc()
            return Response(b"", 499)
        except httpx.HTTPError as e:
            self._transport_failure(edge, e)
            raise AttemptFailed("read", describe(e)) from None
        self._observe_json(edge, est, content)
        self.metrics.responses.labels(edge.name, "2xx").inc()
        return Response(content, up.status_code, out_headers)

    def _transport_failure(self, edge: EdgeState, e: BaseException) -> None:
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            edge.connect_failed(describe(e))
            kind = "connect"
        else:
            kind = "read"
        self.metrics.failures.labels(edge.name, kind).inc()
        log.warning("edge %s failed before the first byte: %s", edge.name, describe(e))

    @staticmethod
    async def _read_quietly(up: httpx.Response) -> bytes:
        try:
            return await up.aread()
        except httpx.HTTPError:
            return b""

    @staticmethod
    async def _read_unless_gone(up: httpx.Response, request: Request) -> bytes:
        """The whole body; gives up (cancelling the edge's work) if the client disconnects meanwhile."""
        task = asyncio.ensure_future(up.aread())
        try:
            while True:
                finished, _ = await asyncio.wait({task}, timeout=0.5)
                if finished:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _headers(self, up: httpx.Response, edge: EdgeState, attempt: int, soonest: Estimate | None) -> dict:
        out = {k: up.headers[k] for k in PASSED_HEADERS if k in up.headers}
        out.setdefault("x-collm-edge", edge.name)
        out[ATTEMPTS_HEADER] = str(attempt)
        if soonest is not None and math.isfinite(soonest.ttft_s):
            out[SOONEST_HEADER] = f"{soonest.ttft_s:.6g}"  # significant digits: a fast edge estimates well under 1 ms
        return out

    def _observe_json(self, edge: EdgeState, est: Estimate, content: bytes) -> None:
        try:
            body = json.loads(content)
            ttft = body.get("collm", {}).get("ttft_s")
            tokens = body.get("usage", {}).get("completion_tokens")
        except (ValueError, AttributeError):
            return
        if isinstance(ttft, (int, float)) and not isinstance(ttft, bool) and 0 <= ttft <= MAX_REPORTED_TTFT_S:
            self.metrics.ttft_est.labels(edge.name).observe(est.ttft_s)
            self.metrics.ttft_obs.labels(edge.name).observe(ttft)
            self.admission.observe(time.monotonic(), float(ttft), est.ttft_target_s)
        self._learn_output(tokens if isinstance(tokens, int) else None)

    def _note_first_token(self, held: OpenAttempt, watch: SSEWatch, est: Estimate) -> None:
        """A stream's first token, once seen: admission learns its TTFT now, not when the stream ends."""
        if watch.first_token_s is not None:
            held.first_token()
            self.admission.observe(time.monotonic(), watch.first_token_s, est.ttft_target_s)

    async def _relay(self, edge: EdgeState, est: Estimate, chunks: AsyncIterator[bytes], first: bytes, t0: float,
                     held: OpenAttempt) -> AsyncIterator[bytes]:
        """Pass the edge's stream through as it arrives; a break becomes an SSE error event."""
        watch = SSEWatch(t0)
        outcome = "stream_cancelled"
        try:
            watch.feed(first)
            self._note_first_token(held, watch, est)
            yield first
            try:
                async for chunk in chunks:
                    edge.last_progress = time.monotonic()
                    had_first = watch.first_token_s is not None
                    watch.feed(chunk)
                    if not had_first:
                        self._note_first_token(held, watch, est)
                    yield chunk
                outcome = "2xx"
            except httpx.HTTPError as e:
                outcome = "stream_error"
                self.metrics.failures.labels(edge.name, "mid_stream").inc()
                edge.check_failed(self.cfg.health, f"stream broke: {describe(e)}")
                log.warning("edge %s broke a stream after it started (%s): ending it with an error event",
                            edge.name, describe(e))
                err = error_body(f"edge {edge.name} failed mid-stream ({describe(e)}); the response is incomplete",
                                 "server_error", code="edge_stream_failed")
                yield (b"" if watch.at_boundary else b"\n\n") + b"data: " + json.dumps(err).encode() + \
                    b"\n\ndata: [DONE]\n\n"
        finally:
            try:
                self.metrics.responses.labels(edge.name, outcome).inc()
                if outcome == "2xx":
                    if watch.first_token_s is not None:
                        self.metrics.ttft_est.labels(edge.name).observe(est.ttft_s)
                        self.metrics.ttft_obs.labels(edge.name).observe(watch.first_token_s)
                    self._learn_output(watch.completion_tokens)
            finally:
                await held.close()  # the edge's slot and the upstream response, whatever the bookkeeping did
