"""The edge's admin endpoints (`api.admin: true`): train and evaluate jobs, publish an adapter, roll back."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter

from collm.common.adapter_io import check_compatible, load_adapter
from collm.common.errors import UserError
from collm.edge_client.engine import EngineError
from collm.edge_client.model.shadow import UnknownVersion
from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.serve.errors import ApiError
from collm.edge_client.serve.openai_schema import AdminEvaluate, AdminPublish, AdminRollback, AdminTrain
from collm.edge_client.training.jobs import TrainBudget

MAX_ADMIN_JOBS = 256  # finished admin jobs /admin/jobs remembers (running ones are always kept)
MAX_VERSION_STEP = 1000  # an admin version may skip at most this many numbers (rounds still pass it: publish_global)


def _inside(path: str, root: str) -> bool:
    """True if `path`, symlinks and '..' resolved, lies inside `root` (also resolved)."""
    p, r = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    return p == r or r in p.parents


def admin_routes(rt: EdgeRuntime, engine: Callable) -> APIRouter:
    """The /admin/* routes; `engine()` is the app's gate (503 while loading or failed)."""
    router = APIRouter()
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

    @router.post("/admin/train", status_code=202)
    async def admin_train(body: AdminTrain):
        eng = admin()
        try:
            fut = eng.train(TrainBudget(steps=body.steps, tokens=body.tokens, deadline_s=body.deadline_s))
        except (EngineError, ValueError) as e:
            raise ApiError(400, str(e)) from None
        jid = f"train-{uuid.uuid4().hex[:8]}"
        remember(jid, fut)
        return {"job": jid}

    @router.post("/admin/evaluate", status_code=202)
    async def admin_evaluate(body: AdminEvaluate):
        eng = admin()
        try:
            fut = eng.evaluate(version=body.version)
        except EngineError as e:
            raise ApiError(400, str(e), param="version") from None
        jid = f"eval-{uuid.uuid4().hex[:8]}"
        remember(jid, fut)
        return {"job": jid}

    @router.get("/admin/jobs/{jid}")
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

    @router.post("/admin/adapters")
    async def admin_publish(body: AdminPublish):
        eng = admin()
        try:
            path = Path(body.path).expanduser().resolve()  # checked and loaded: the same path, symlinks resolved
        except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a lone surrogate, a symlink loop, ~nobody
            raise ApiError(400, f"path: not a usable file path ({type(e).__name__}: {str(e)[:200]})",
                           param="path") from None
        if rt.cfg.api.adapter_dir is not None and not _inside(str(path), rt.cfg.api.adapter_dir):
            raise ApiError(403, f"path: adapters load only from inside {rt.cfg.api.adapter_dir} (api.adapter_dir)",
                           "permission_error", param="path")
        latest = eng.shadow.latest_version
        if body.version is not None and body.version > latest + MAX_VERSION_STEP:
            raise ApiError(400, f"version: at most {latest + MAX_VERSION_STEP} (the latest, {latest}, + "
                                f"{MAX_VERSION_STEP}); omit it for the next one", param="version")
        try:
            state, _ = load_adapter(path)
        except UserError as e:
            raise ApiError(400, str(e), param="path") from None
        problems = check_compatible(state, eng.layers.expected_shapes())
        if problems:
            raise ApiError(400, f"path: adapter does not fit this model: {problems[0]}", param="path")
        version = body.version if body.version is not None else latest + 1
        if not rt.publish(state, version, source="admin"):
            raise ApiError(409, f"version {version} is not newer than {eng.shadow.latest_version}", param="version")
        return rt.adapters_view()

    @router.post("/admin/rollback")
    async def admin_rollback(body: AdminRollback):
        admin()
        try:
            rt.rollback(body.version)
        except UnknownVersion as e:
            raise ApiError(404, f"version: {e}", "not_found_error", param="version") from None
        return rt.adapters_view()

    return router
