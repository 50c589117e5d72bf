"""`collm-router`: one OpenAI-compatible front for several `collm-edge` replicas, routing by SLO slack.

    request -> router: estimate TTFT/TPOT on every healthy edge -> the edge with the most slack
            -> edge scheduler -> model + pinned adapter -> response, streamed back chunk by chunk

The rule is in `router/policy.py` (its docstring has the formula) and runs as `router/fleet.py`'s
columnar form over the `FleetTable` the polls (`router/poller.py`) fill in; what the router knows about
each edge (health, last /metrics scrape, its own in-flight counts) is in `router/state.py`; request
parsing and the SSE first-token watch in `router/requests.py`, the Prometheus collectors in `router/metrics.py`,
one try on one edge and the relay of its answer in `router/proxy.py`.

Endpoints: POST /v1/completions and /v1/chat/completions (bodies go to the edge unchanged, streams
are relayed as they arrive), GET /v1/models (from one healthy edge), GET /health (503 when no edge
is healthy), GET /metrics (Prometheus, names below).

Failures:
* an edge that cannot be reached, answers 5xx, or breaks off before the router has sent the client
  a byte: the request is retried once on another edge (streams: the router holds the response
  until the edge's first chunk, so a failure before it can still be retried);
* 429 (the edge's queue is full) is retried once on another edge too (`routing.retry_429`): it is a
  statement about that edge's load, not about the request. Other 4xx are the client's mistake and
  pass through unchanged, as does the last edge's answer when the retry fails as well;
* a stream that breaks after the client got bytes ends with an SSE error event,
  `data: {"error": {...}}` then `data: [DONE]`;
* no healthy edge (or none left to retry on after a connection failure): 503 with an OpenAI-style
  error body and `Retry-After`.

Every response carries the edge's X-CoLLM-Adapter-Version and X-CoLLM-Edge (added from the router's
config when the edge did not send it) and X-CoLLM-Router-Attempts (1, or 2 after a retry); under
the slo policy also X-CoLLM-Soonest-TTFT, the rule's estimate (seconds) of the TTFT on the edge that
would start the request soonest: what admission compares with the target, so a client (or a
benchmark) can check the estimate against the TTFT it got, with or without admission on.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import json
import logging
import math
import random
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from collm.common.auth import KeyRing, Keys, bearer, install, matches
from collm.common.errors import UserError
from collm.common.http_guard import BodyLimit
from collm.common.protocol import error_body

from collm.router.admission import AdmissionController, routing_policy
from collm.router.config import RouterConfig
from collm.router.metrics import RouterMetrics
from collm.router.poller import EdgePoller
from collm.router.proxy import SOONEST_HEADER, EdgeProxy, AttemptFailed
from collm.router.requests import request_view
from collm.router.fleet import FleetTable, choose, stale_after
from collm.router.policy import Assumptions, Decision, Estimate, RequestView, learn_output, unattainable
from collm.router.state import EdgeState

log = logging.getLogger("collm.router")

BEST_EFFORT_HEADER = "X-CoLLM-Best-Effort"  # "1"/"true": route even when no edge can meet the TTFT target
FORWARDED_HEADERS = ("content-type", "accept")  # never the client's key: the router sends its own (edge_key)
RETRY_AFTER_MAX_S = 60  # a 429's Retry-After is capped, as the edge caps its own


def edge_verify(ca_file: str | None):
    """How the router checks https:// edges: the system's CAs, or the given CA file (a one-line error if unreadable)."""
    if ca_file is None:
        return True
    import ssl

    try:
        return ssl.create_default_context(cafile=str(Path(ca_file).expanduser()))
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"proxy.ca_file: cannot read {ca_file} as a PEM CA ({e}); give the CA that signed the edges' "
                        "certificates (collm-certs)") from None


# ============================================================================ the router
class Router(EdgeProxy):
    def __init__(self, cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.cfg = cfg
        self.edges = [EdgeState(e) for e in cfg.edges]
        self.index = {e.name: i for i, e in enumerate(self.edges)}
        r = cfg.routing
        self.table = FleetTable(self.edges, r.default_max_running, r.default_slo.ttft_s, r.default_slo.tpot_s)
        self.rng = random.Random(cfg.routing.seed)
        self.counter = 0
        self.typical_output = float(cfg.routing.typical_output_tokens)
        self.awaiting: dict = {}  # tries without a first token yet -> (sent at, TTFT target): admission reads them
        self.admission = AdmissionController(r.admission_margin, r.admission_margin_max, r.admission_feedback)
        self.metrics = RouterMetrics(self)
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self.poller = EdgePoller(cfg, self.edges, self.metrics, self.rng)
        edge_keys = cfg.edge_key.resolve("edge_key")
        self.edge_key = edge_keys[0] if edge_keys else None
        self.ring = KeyRing(cfg.auth)
        if self.edge_key and not self.keys.api and not cfg.open_proxy:
            raise UserError("edge_key: the router would spend its key towards the edges for anyone (auth.api_keys "
                            "gives no key); set auth.api_keys, or open_proxy: true if that is what you want")
        self.best_effort_keys = cfg.best_effort_keys.resolve("best_effort_keys")
        self.verify = edge_verify(cfg.proxy.ca_file)

    @property
    def keys(self) -> Keys:
        return self.ring.current()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        p = self.cfg.proxy
        # keep idle connections to an edge shorter than the edge server keeps them (uvicorn: 5 s), so a
        # request never goes out on a connection the edge is closing at that moment
        limits = httpx.Limits(max_connections=p.max_connections, max_keepalive_connections=p.max_connections,
                              keepalive_expiry=p.keepalive_s)
        auth = {"Authorization": f"Bearer {self.edge_key}"} if self.edge_key else None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=p.connect_timeout_s, read=p.read_timeout_s, write=30.0,
                                  pool=p.pool_timeout_s),
            limits=limits, transport=self._transport, headers=auth, verify=self.verify)
        await self.poller.start(self._transport, auth, self.verify)
        log.info("router %s: %d edges, policy %s, %d healthy now", self.cfg.name, len(self.edges),
                 self.cfg.routing.policy, self.healthy_count())

    async def stop(self) -> None:
        await self.poller.stop()
        if self.client is not None:
            await self.client.aclose()

    # ---------------------------------------------------------------- edge state
    def poll_interval(self) -> float:
        return self.poller.poll_interval()

    def healthy_count(self) -> int:
        return sum(e.healthy for e in self.edges)

    def assumptions(self) -> Assumptions:
        return self.cfg.routing.assumptions(self.typical_output)

    def policy_now(self, now: float | None = None) -> str:
        """The rule to route by now: a gated slo_pack spreads as slo while the measured TTFT slack is below
        routing.pack_gate (`policy.policy_now`). With `now`, the slack is measured first (once a period)."""
        r = self.cfg.routing
        return routing_policy(r.policy, r.pack_gate, self.admission, now, self.awaiting.values())

    def pick(self, x: RequestView, exclude: list[str]) -> tuple[EdgeState, Decision, Estimate] | None:
        """The edge for request x among the healthy ones not tried yet (cooling-down ones last)."""
        now = time.monotonic()
        pool = self.table.routable(now, [self.index[n] for n in exclude if n in self.index])
        if pool is None:
            return None
        cols = self.table.columns(pool, stale_after(self.cfg.health.stale_after_s, self.poll_interval()), now)
        d = choose(self.policy_now(now), cols, x, self.rng, self.counter, self.assumptions())
        self.counter += 1
        est = d.estimate
        edge = self.edges[self.index[d.edge]]
        edge.last_slack = est.slack
        log.debug("route to %s (%s): est TTFT %.0f ms, TPOT %.1f ms, slack %.2f", edge.name, d.why,
                  1000 * est.ttft_s, 1000 * est.tpot_s, est.slack)
        return edge, d, est

    def _learn_output(self, tokens: int | None) -> None:
        self.typical_output = learn_output(self.typical_output, tokens)

    # ---------------------------------------------------------------- forwarding
    async def forward(self, request: Request, path: str, method: str = "POST", chat: bool = False) -> Response:
        """One client request: refused when the router is full or a key may not skip admission, else routed."""
        raw = await request.body() if method == "POST" else b""
        body = None
        if raw:
            with contextlib.suppress(ValueError, RecursionError):  # the edge answers bad JSON with a 400
                body = json.loads(raw)
        in_flight = sum(e.outstanding for e in self.edges)
        if in_flight >= self.cfg.api.max_in_flight:
            return JSONResponse(error_body(f"the router has {in_flight} requests in flight, its limit "
                                           f"(api.max_in_flight); retry after 1 s", "service_unavailable",
                                           code="router_busy"), status_code=503, headers={"Retry-After": "1"})
        x, stream = request_view(body, chat, self.cfg, self.typical_output)
        asked = request.headers.get(BEST_EFFORT_HEADER, "").lower() in ("1", "true", "yes")
        if asked or (isinstance(body, dict) and body.get("best_effort") is True):
            if not self._may_skip_admission(request.headers.get("authorization")):
                return JSONResponse(error_body(f"{BEST_EFFORT_HEADER}: this key may not skip admission (the "
                                               "router's best_effort_keys)", "permission_error",
                                               code="best_effort_not_allowed"), status_code=403)
            x = replace(x, best_effort=True)
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        return await self._route(x, stream, method, path, raw, headers, request)

    async def _route(self, x: RequestView, stream: bool, method: str, path: str, raw: bytes, headers: dict,
                     request: Request) -> Response:
        """Admission on the first pick, then one try and at most one retry on another edge (`router/proxy.py`)."""
        tried: list[str] = []
        failed: list[AttemptFailed] = []
        for attempt in (1, 2):
            picked = self.pick(x, exclude=tried)
            if picked is None and attempt == 2 and failed[-1].reason == "read":
                # the only edge broke off before answering: most often an idle keep-alive connection
                # it closed as we reused it; one more try on the same edge, on a fresh connection
                picked = self.pick(x, exclude=[])
            if picked is None:
                break
            edge, decision, est = picked
            if (attempt == 1 and self.cfg.routing.admission and not x.best_effort
                    and unattainable(decision, self.admission.update(time.monotonic(), self.awaiting.values()))):
                return self._refuse(decision)
            tried.append(edge.name)
            if attempt == 2:
                self.metrics.retries.labels(failed[-1].reason).inc()
                log.warning("retrying on edge %s after edge %s failed: %s", edge.name, tried[0], failed[-1].why)
            try:
                return await self._attempt(edge, est, method, path, raw, headers, stream, attempt, request,
                                           decision.soonest)
            except AttemptFailed as f:
                failed.append(f)
        return self._unserved(tried, failed)

    def _unserved(self, tried: list[str], failed: list[AttemptFailed]) -> Response:
        """No try succeeded: the last edge's own answer (5xx or 429) if there was one, else 503."""
        last_answer = next((f.response for f in reversed(failed) if f.response is not None), None)
        if last_answer is not None:  # an edge answered (5xx or 429) and no retry could do better
            return last_answer
        self.metrics.no_edge.inc()
        if failed:
            msg = "no healthy edge could take the request: " + "; ".join(
                f"{n}: {f.why}" for n, f in zip(tried, failed, strict=False))
        else:
            down = ", ".join(f"{e.name} ({e.last_error or 'not ready'})" for e in self.edges)
            msg = f"no healthy edge: all {len(self.edges)} edges are out of service: {down}"
        return JSONResponse(error_body(msg, "service_unavailable", code="no_healthy_edge"), status_code=503,
                            headers={"Retry-After": str(max(1, math.ceil(self.cfg.health.interval_s)))})

    def _may_skip_admission(self, authorization: str | None) -> bool:
        """Best effort is a permission of a key; a router without client keys cannot tell clients apart."""
        if not self.keys.api:
            return True
        token = bearer(authorization)
        return token is not None and matches(token, self.best_effort_keys + self.keys.admin)

    def _refuse(self, d: Decision) -> Response:
        """429: even the soonest edge would give the request its first token after its target."""
        soon = d.soonest
        self.metrics.refused.inc()
        late = soon.ttft_s - soon.ttft_target_s
        retry = min(RETRY_AFTER_MAX_S, max(1, math.ceil(late))) if math.isfinite(late) else RETRY_AFTER_MAX_S
        msg = (f"no edge can start this request within its {soon.ttft_target_s:g} s TTFT target (soonest: "
               f"{soon.edge}, about {soon.ttft_s:.1f} s); retry after {retry} s, or send "
               f"{BEST_EFFORT_HEADER}: 1 to be served late")
        return JSONResponse(error_body(msg, "rate_limit_error", code="slo_unattainable"), status_code=429,
                            headers={"Retry-After": str(retry), SOONEST_HEADER: f"{soon.ttft_s:.6g}"})

    # ---------------------------------------------------------------- views
    def health_body(self) -> dict:
        n = self.healthy_count()
        return {"status": "ok" if n else "unavailable", "router": self.cfg.name, "policy": self.cfg.routing.policy,
                "routing_now": self.policy_now(), "ttft_slack": self.admission.slack,
                "admission_margin": self.admission.margin, "healthy_edges": n,
                "edges": [e.describe() for e in self.edges]}


# ============================================================================ the app
def create_app(cfg: RouterConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    router = Router(cfg, transport)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="collm-router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=cfg.api.max_body_bytes, setting="api.max_body_bytes")
    install(app, router.ring)  # outermost: a request without a key is refused before its body
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.get("/health")
    async def health():
        body = router.health_body()
        return JSONResponse(body, status_code=200 if body["healthy_edges"] else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.forward(request, "/v1/models", method="GET")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.forward(request, "/v1/chat/completions", chat=True)

    return app
