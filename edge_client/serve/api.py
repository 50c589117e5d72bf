"""The edge's HTTP app: health, Prometheus metrics, models and adapters here; generation
(`serve/generate.py`) and admin (`serve/admin.py`) are routers it includes; errors in `serve/errors.py`."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from collm.common.auth import KeyRing, install
from collm.common.http_guard import BodyLimit
from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.serve.admin import admin_routes
from collm.edge_client.serve.errors import ApiError, install_error_handlers
from collm.edge_client.serve.generate import generation_routes
from collm.edge_client.serve.metrics import EdgeMetrics
from collm.edge_client.serve.models import model_ids


def create_app(rt: EdgeRuntime) -> FastAPI:
    app = FastAPI(title="collm-edge", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=rt.cfg.api.max_body_bytes, setting="api.max_body_bytes")
    ring = KeyRing(rt.cfg.auth)
    rt.cfg.check_admin_keys(ring.keys)
    install(app, ring)  # outermost: a request without a key is refused before its body is read
    state: dict = {"metrics": None}

    def metrics() -> EdgeMetrics:
        if state["metrics"] is None:
            state["metrics"] = EdgeMetrics(rt.engine, rt.cfg.name)
        return state["metrics"]

    if rt.ready.is_set():
        metrics()
    else:  # count every request from the first one, not from the first scrape
        rt.on_ready.append(metrics)

    install_error_handlers(app)

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

    app.include_router(admin_routes(rt, engine))
    app.include_router(generation_routes(rt, engine))
    return app
