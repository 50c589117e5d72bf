"""The edge's generation endpoints: OpenAI-compatible completions and chat, whole or streamed (SSE).

Every response says which adapter version produced it: the `adapter_version` field and the
`X-CoLLM-Adapter-Version` header ("base" and null for the frozen base). The version is the one
pinned when the request was admitted (or the one `model` named, `serve/models.py`), so a hot swap
during a stream changes neither.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from collm.common.protocol import EDGE_HEADER, VERSION_HEADER, error_body
from collm.edge_client.engine import (AdmittedEvent, EngineError, EngineFailed, FinishEvent, PromptTooLong,
                                     QueueFull, ShuttingDown, TokenEvent)
from collm.edge_client.model.lora import BASE, LOCAL_VERSION
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.model.shadow import UnknownVersion
from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.serve.errors import ApiError
from collm.edge_client.serve.models import Choice, UnknownModel, resolve
from collm.edge_client.serve.openai_schema import ChatRequest, CompletionRequest, _Common

MESSAGE_CHARS = 32  # what a chat template adds per message (role markers), counted against api.max_prompt_chars


def generation_routes(rt: EdgeRuntime, engine: Callable) -> APIRouter:
    """/v1/completions and /v1/chat/completions; `engine()` is the app's gate (503 while loading or failed)."""
    router = APIRouter()
    # Tokenizing is linear in the prompt and holds the GIL in stretches: it runs on a thread of its own, so the
    # event loop keeps answering /health and streaming tokens meanwhile (one thread: the tokenizer is shared).
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="collm-tokenize")
    in_tokenizer = 0  # requests handed to the tokenizer and not yet submitted (the event loop's own count)
    max_chars = rt.cfg.api.max_prompt_chars

    def _bounded(chars: int, param: str, counted: str = "") -> None:
        if chars > max_chars:
            raise ApiError(400, f"{param}: {chars} characters{counted}; this edge takes at most {max_chars} "
                                f"(api.max_prompt_chars)", param=param, code="context_length_exceeded")

    async def _tokenize(eng, fn, *args):
        """`fn(*args)` on the tokenizer's thread, if the queue has room for the request once it is tokenized:
        otherwise every client's request would wait behind a backlog that `engine.max_queue` never sees."""
        nonlocal in_tokenizer
        if in_tokenizer >= eng.queue_room():
            raise _queue_full(eng, f"the queue is full ({eng.cfg.engine.max_queue} waiting requests, with those "
                                   f"being tokenized)")
        in_tokenizer += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)
        finally:
            in_tokenizer -= 1

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = engine()
        choice = _choose_model(eng, body)
        _bounded(len(body.prompt), "prompt")
        ids = await _tokenize(eng, eng.tokenizer.encode, body.prompt)
        return await _generate(eng, ids, body, request, chat=False, choice=choice)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        eng = engine()
        choice = _choose_model(eng, body)
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        # the template's markers count too: 65k empty messages fit a 1 MiB body and template to ~2M characters
        _bounded(sum(len(m["content"]) + MESSAGE_CHARS for m in msgs), "messages",
                 f" ({len(msgs)} messages, each counting {MESSAGE_CHARS} for the template's markers)")

        def template():
            return eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)

        try:
            out = await _tokenize(eng, template)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - the template rejected the conversation
            raise ApiError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        ids = list(out["input_ids"] if hasattr(out, "keys") else out)
        return await _generate(eng, ids, body, request, chat=True, choice=choice)

    def _unknown_model(message: str) -> ApiError:
        return ApiError(404, message, "not_found_error", param="model", code="model_not_found")

    def _choose_model(eng, body: _Common) -> Choice:
        try:
            return resolve(body.model, rt.model_name, rt.cfg.adapters.name, eng.shadow.retained_versions())
        except UnknownModel as e:
            raise _unknown_model(str(e)) from None

    async def _generate(eng, ids: list[int], body: _Common, request: Request, chat: bool, choice: Choice):
        limit = eng.max_context
        if len(ids) >= limit:
            raise ApiError(400, f"this edge's maximum context length is {limit} tokens, but the prompt has "
                                f"{len(ids)} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        max_tokens = body.max_tokens or min(eng.cfg.engine.default_max_tokens, limit - len(ids))
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"this edge's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                                f"and max_tokens asks for {max_tokens}", param="max_tokens",
                           code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stops, ignore_eos=body.ignore_eos)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        slo = eng.slo.override(body.slo.ttft_ms, body.slo.tpot_ms, floor=rt.cfg.slo.override_floor) if body.slo \
            else eng.slo
        try:
            req = eng.submit(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), slo=slo,
                             adapter=choice.version)
        except UnknownVersion as e:  # dropped from retention between resolving and pinning
            raise _unknown_model(f"model '{choice.label}': {e}") from None
        except QueueFull as e:
            raise _queue_full(eng, str(e)) from None
        except (ShuttingDown, EngineFailed) as e:
            raise ApiError(503, str(e), "service_unavailable") from None
        except PromptTooLong as e:
            raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except (EngineError, ValueError) as e:
            raise ApiError(400, str(e)) from None

        # Wait for admission (the pinned version goes in the headers), watching for a client that leaves.
        try:
            first = await _next_event(events, request, eng, req)
        except asyncio.CancelledError:
            eng.cancel(req)
            raise
        if isinstance(first, FinishEvent):  # cancelled, expired or failed before admission
            if first.reason == "expired":
                retry = _retry_after(eng)
                raise ApiError(429, f"the request waited {first.record.e2e_s:.1f} s for a slot, past its "
                                    f"{first.record.ttft_slo_s:g} s TTFT target, and was not started; retry after "
                                    f"{retry} s", "rate_limit_error", code="slo_unattainable",
                               headers={"Retry-After": str(retry)})
            raise ApiError(503, "the request could not be served", "service_unavailable")
        kind = {BASE.version: "base", LOCAL_VERSION: "local"}.get(first.adapter_version)
        version = None if kind else first.adapter_version
        headers = {VERSION_HEADER: kind or str(version), EDGE_HEADER: rt.cfg.name}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options.include_usage if body.stream_options else True
            stream = _sse(eng, req, events, request, rid, created, version, len(ids), chat, include_usage,
                          choice.label)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        try:
            while True:
                ev = await _next_event(events, request, eng, req)
                if isinstance(ev, FinishEvent):
                    break
        except asyncio.CancelledError:
            eng.cancel(req)
            raise
        if ev.reason == "error":
            raise ApiError(500, "the engine failed while generating", "server_error")
        out = ({"index": 0, "message": {"role": "assistant", "content": ev.text}, "finish_reason": ev.reason,
                   "logprobs": None} if chat else
                  {"index": 0, "text": ev.text, "finish_reason": ev.reason, "logprobs": None})
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": choice.label, "choices": [out], "usage": _usage(len(ids), ev.record.output_tokens),
            "adapter_version": version, "collm": _timings(ev)}, headers=headers)

    async def _sse(eng, req, events, request, rid, created, version, n_prompt, chat, include_usage,
                   label: str) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, usage: dict | None = None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": label, "choices": [choice],
                    "adapter_version": version}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                ev = await _next_event(events, request, eng, req)
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield chunk(ev.text, None)
                elif isinstance(ev, FinishEvent):
                    finished = True
                    if ev.reason == "error":
                        err = error_body("the engine failed while generating", "server_error")
                        yield f"data: {json.dumps(err)}\n\n"
                    else:
                        usage = _usage(n_prompt, ev.record.output_tokens) if include_usage else None
                        yield chunk(None, ev.reason, usage)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # the client went away mid-stream: free the slot now
                eng.cancel(req)

    return router


async def _next_event(events: asyncio.Queue, request: Request, eng, req):
    """The next engine event for `req`; cancels it if the client disconnects meanwhile."""
    while True:
        try:
            ev = await asyncio.wait_for(events.get(), timeout=0.5)
        except TimeoutError:
            if await request.is_disconnected():
                eng.cancel(req)
                raise asyncio.CancelledError from None
            continue
        if isinstance(ev, (AdmittedEvent, TokenEvent, FinishEvent)):
            return ev


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _timings(ev: FinishEvent) -> dict:
    r = ev.record
    return {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "slo_met": r.slo_met}


def _queue_full(eng, why: str) -> ApiError:
    retry = _retry_after(eng)
    return ApiError(429, f"{why}; retry after {retry} s", "rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry)})


def _retry_after(eng) -> int:
    """Seconds until a queue slot is likely free: queued work over the replica's request rate."""
    snap = eng.snapshot()
    rate = max(snap.window.completed_rate, 1e-3)
    return int(min(60, max(1, math.ceil(snap.waiting / rate / 4))))
