"""The edge's HTTP API: OpenAI-compatible completions and chat, health, metrics, adapters.

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
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from collm.common.adapter_io import check_compatible, load_adapter
from collm.common.auth import Keys, install
from collm.common.errors import UserError
from collm.common.protocol import EDGE_HEADER, VERSION_HEADER, error_body

from collm.edge_client.engine import (AdmittedEvent, EngineError, EngineFailed, FinishEvent, PromptTooLong,
                                     QueueFull, ShuttingDown, TokenEvent)
from collm.edge_client.serve.metrics import EdgeMetrics
from collm.edge_client.serve.models import Choice, UnknownModel, model_ids, resolve
from collm.edge_client.model.lora import BASE, LOCAL_VERSION
from collm.edge_client.model.shadow import UnknownVersion
from collm.edge_client.serve.openai_schema import (AdminEvaluate, AdminPublish, AdminRollback, AdminTrain, ChatRequest,
                                                  CompletionRequest, _Common)
from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.jobs import TrainBudget

MAX_ADMIN_JOBS = 256  # finished admin jobs /admin/jobs remembers (running ones are always kept)



class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


class _AsciiJSON(JSONResponse):
    """JSON escaped to ASCII: an error message that quotes the client's text (even a lone surrogate) renders."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None):
    return _AsciiJSON(error_body(message, type_, param, code), status_code=status, headers=headers)


def _inside(path: str, root: str) -> bool:
    """True if `path`, symlinks and '..' resolved, lies inside `root` (also resolved)."""
    p, r = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    return p == r or r in p.parents


def create_app(rt: EdgeRuntime) -> FastAPI:
    app = FastAPI(title="collm-edge", docs_url=None, redoc_url=None, openapi_url=None)
    install(app, Keys.from_config(rt.cfg.auth))
    state: dict = {"metrics": None}

    def metrics() -> EdgeMetrics:
        if state["metrics"] is None:
            state["metrics"] = EdgeMetrics(rt.engine, rt.cfg.name)
        return state["metrics"]

    if rt.ready.is_set():
        metrics()
    else:  # count every request from the first one, not from the first scrape
        rt.on_ready.append(metrics)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return _error(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", param=None, code="invalid_json")
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request").removeprefix("Value error, ")
        return _error(400, f"{param}: {msg}" if param else msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind)

    def engine():
        if rt.load_error:
            raise ApiError(503, f"the edge failed to load its model: {rt.load_error}", "service_unavailable")
        if not rt.ready.is_set():
            raise ApiError(503, "the edge is still loading its model", "service_unavailable",
                           headers={"Retry-After": "5"})
        if rt.engine.failure is not None:
            raise ApiError(503, f"the edge's engine failed ({rt.engine.failure}); it is restarting",
                           "service_unavailable")
        return rt.engine

    # ------------------------------------------------------------------ read-only endpoints
    @app.get("/health")
    async def health():
        if not rt.ready.is_set():
            status = "error" if rt.load_error else "loading"
            return JSONResponse({"status": status, "edge": rt.cfg.name, "error": rt.load_error}, status_code=503)
        eng = rt.engine
        if eng.failure is not None:
            return JSONResponse({"status": "error", "edge": rt.cfg.name, "error": f"engine failed: {eng.failure}"},
                                status_code=503)
        return {"status": "ready", "edge": rt.cfg.name, "model": rt.model_name,
                "adapter_version": eng.shadow.current_version, "uptime_s": round(time.time() - rt.started_at, 1),
                **eng.load(), "federation": rt.federation_status()}

    @app.get("/metrics")
    async def prometheus():
        engine()
        return Response(metrics().render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        eng = engine()
        shadow, name, base = eng.shadow, rt.cfg.adapters.name, rt.model_name
        retained = shadow.retained_versions()

        def entry(mid: str, parent: str | None, version: int | None) -> dict:
            info = None if version is None else shadow.info_of(version)
            return {"id": mid, "object": "model", "created": int(info.published_at if info else rt.started_at),
                    "owned_by": "collm", "root": base, "parent": parent, "max_model_len": eng.max_context,
                    "adapter_version": version, "round": info.round if info else None,
                    "sha256": info.digest if info else None, "eval_loss": info.eval_loss if info else None}

        data = []
        for mid in model_ids(base, name, retained):
            if mid == base:
                data.append(entry(base, None, None))
            elif mid == name:
                data.append(entry(name, base, shadow.current_version))
            elif mid.endswith(":local"):
                local = shadow.local_info()
                data.append({**entry(mid, name, None), "local_steps": local["steps"] if local else 0,
                             "based_on_version": local["based_on"] if local else shadow.current_version})
            else:
                data.append(entry(mid, name, int(mid.rpartition("@")[2])))
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters():
        engine()
        return rt.adapters_view()

    # ------------------------------------------------------------------ admin (api.admin: true)
    jobs: OrderedDict[str, object] = OrderedDict()  # admin jobs by id, the last MAX_ADMIN_JOBS

    def remember(jid: str, fut) -> None:
        """Keep a job's future for /admin/jobs; the oldest finished ones go past MAX_ADMIN_JOBS (the table
        must not grow with every call)."""
        jobs[jid] = fut
        for old in [k for k, f in jobs.items() if f.done()][: max(0, len(jobs) - MAX_ADMIN_JOBS)]:
            del jobs[old]

    def admin():
        if not rt.cfg.api.admin:
            raise ApiError(404, "admin endpoints are off; set api.admin: true in the edge config", "not_found_error")
        return engine()

    @app.post("/admin/train", status_code=202)
    async def admin_train(body: AdminTrain):
        eng = admin()
        try:
            fut = eng.train(TrainBudget(steps=body.steps, tokens=body.tokens, deadline_s=body.deadline_s))
        except (EngineError, ValueError) as e:
            raise ApiError(400, str(e)) from None
        jid = f"train-{uuid.uuid4().hex[:8]}"
        remember(jid, fut)
        return {"job": jid}

    @app.post("/admin/evaluate", status_code=202)
    async def admin_evaluate(body: AdminEvaluate):
        eng = admin()
        try:
            fut = eng.evaluate(version=body.version)
        except EngineError as e:
            raise ApiError(400, str(e), param="version") from None
        jid = f"eval-{uuid.uuid4().hex[:8]}"
        remember(jid, fut)
        return {"job": jid}

    @app.get("/admin/jobs/{jid}")
    async def admin_job(jid: str):
        admin()
        fut = jobs.get(jid)
        if fut is None:
            raise ApiError(404, f"no job {jid}", "not_found_error")
        if not fut.done():
            return {"job": jid, "status": "running"}
        if fut.exception() is not None:
            return {"job": jid, "status": "failed", "error": str(fut.exception())}
        return {"job": jid, "status": "done", "report": fut.result().as_dict()}

    @app.post("/admin/adapters")
    async def admin_publish(body: AdminPublish):
        eng = admin()
        if rt.cfg.api.adapter_dir is not None and not _inside(body.path, rt.cfg.api.adapter_dir):
            raise ApiError(403, f"path: adapters load only from inside {rt.cfg.api.adapter_dir} (api.adapter_dir)",
                           "permission_error", param="path")
        try:
            state, _ = load_adapter(body.path)
        except UserError as e:
            raise ApiError(400, str(e), param="path") from None
        problems = check_compatible(state, eng.layers.expected_shapes())
        if problems:
            raise ApiError(400, f"path: adapter does not fit this model: {problems[0]}", param="path")
        version = body.version if body.version is not None else eng.shadow.latest_version + 1
        if not rt.publish(state, version, source="admin"):
            raise ApiError(409, f"version {version} is not newer than {eng.shadow.latest_version}", param="version")
        return rt.adapters_view()

    @app.post("/admin/rollback")
    async def admin_rollback(body: AdminRollback):
        eng = admin()
        try:
            rt.rollback(body.version)
        except UnknownVersion as e:
            raise ApiError(404, f"version: {e}", "not_found_error", param="version") from None
        return rt.adapters_view()

    # ------------------------------------------------------------------ generation
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        eng = engine()
        choice = _choose_model(eng, body)
        ids = eng.tokenizer.encode(body.prompt)
        return await _generate(eng, ids, body, request, chat=False, choice=choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        eng = engine()
        choice = _choose_model(eng, body)
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            out = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
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
        slo = eng.slo.override(body.slo.ttft_ms, body.slo.tpot_ms) if body.slo else eng.slo
        try:
            req = eng.submit(ids, params, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev), slo=slo,
                             adapter=choice.version)
        except UnknownVersion as e:  # dropped from retention between resolving and pinning
            raise _unknown_model(f"model '{choice.label}': {e}") from None
        except QueueFull as e:
            retry = _retry_after(eng)
            raise ApiError(429, f"{e}; retry after {retry} s", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(retry)}) from None
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

    return app


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


def _retry_after(eng) -> int:
    """Seconds until a queue slot is likely free: queued work over the replica's request rate."""
    snap = eng.snapshot()
    rate = max(snap.window.completed_rate, 1e-3)
    return int(min(60, max(1, math.ceil(snap.waiting / rate / 4))))
