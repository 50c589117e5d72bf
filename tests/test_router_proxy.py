"""collm-router's forwarding, retries and health handling against scripted fake edges (no model).

The fake edges answer like collm-edge (same paths, headers and Prometheus names) and fail on
command, so every failure path is exercised deterministically; tests/test_router_live.py does the
same against real collm-edge processes.
"""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from helpers import free_port

from collm.common import metric_names as M
from collm.common.config import validate_config
from collm.router.app import create_app
from collm.router.config import RouterConfig


def serve_in_thread(app, port: int = 0, lifespan: str = "off"):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           lifespan=lifespan, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        assert thread.is_alive(), "server thread died"
        time.sleep(0.01)
    assert server.started
    return server, thread, server.servers[0].sockets[0].getsockname()[1]


class LiveRouter:
    """collm-router's app served by uvicorn on a free loopback port, in this process."""

    def __init__(self, cfg: dict):
        self.cfg = validate_config(RouterConfig, cfg, "test")
        self.app = create_app(self.cfg)
        self.router = self.app.state.router
        self.server, self.thread, port = serve_in_thread(self.app, lifespan="on")
        self.url = f"http://127.0.0.1:{port}"

    def edge(self, name):
        return next(e for e in self.router.edges if e.name == name)

    def wait_for(self, cond, timeout=15.0, what="condition"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if cond():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def router_config(edges: list[tuple[str, str]], **overrides) -> dict:
    cfg = {"edges": [{"name": n, "url": u} for n, u in edges],
           "health": {"interval_s": 0.1, "timeout_s": 1.0, "unhealthy_after": 2, "cooldown_s": 0.5},
           "routing": {"seed": 0, "policy": "slo"}}  # slo spreads idle requests over the edges, which these
    # tests of forwarding and of the slo rule rely on; slo_pack (the default) has its own tests
    for k, v in overrides.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def sse(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ----------------------------------------------------------------------------------------- fake edges
METRICS = """# HELP x
{queue} {q}
{running} {r}
{max_running} 8.0
{spare} 1.0
{busy} 0.0
{active} 0.0
{ttft} 1.0
{tpot} 0.1
{pred} 0.004
{cost}{{term="base"}} 0.003
{cost}{{term="per_decode_seq"}} 0.0005
{cost}{{term="per_prefill_token"}} 2e-05
{cost}{{term="per_1k_kv_tokens"}} 0.0015
"""


class FakeEdge:
    """Answers like collm-edge; `mode` scripts the next generation requests."""

    def __init__(self, name: str, port: int | None = None, edge_header: bool = True):
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "ok"
        self.ready = True
        self.health_delay = 0.0
        self.queue = 0
        self.calls = 0
        self.bodies: list[dict] = []
        self.edge_header = edge_header
        self.server = None
        self.start()

    def headers(self):
        h = {"X-CoLLM-Adapter-Version": "3"}
        if self.edge_header:
            h["X-CoLLM-Edge"] = self.name
        return h

    def build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            import asyncio

            await asyncio.sleep(self.health_delay)
            return JSONResponse({"status": "ready" if self.ready else "loading", "edge": self.name},
                                status_code=200 if self.ready else 503)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(METRICS.format(
                queue=M.QUEUE_DEPTH, running=M.RUNNING, max_running=M.MAX_RUNNING, spare=M.SPARE_CAPACITY,
                busy=M.TRAINING_BUSY, active=M.TRAINING_ACTIVE, ttft=M.SLO_TTFT, tpot=M.SLO_TPOT,
                pred=M.DECODE_STEP_PRED, cost=M.STEP_COST, q=self.queue, r=0))

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            try:  # like collm-edge: a body it cannot read is the client's mistake
                body = json.loads(await request.body())
            except (ValueError, RecursionError):
                return JSONResponse({"error": {"message": "not valid JSON", "type": "invalid_request_error",
                                               "param": None, "code": "invalid_json"}}, status_code=400)
            self.calls += 1
            self.bodies.append(body)
            mode = self.mode
            if mode in ("500", "503", "429", "400", "404"):
                status = int(mode)
                hdr = {"Retry-After": "7"} if status == 429 else {}
                code = "queue_full" if status == 429 else None  # collm-edge's code for a full queue
                return JSONResponse({"error": {"message": f"{self.name} says {status}", "type": "x", "param": None,
                                               "code": code}}, status_code=status, headers=hdr)
            if body.get("stream"):
                return StreamingResponse(self.stream(mode, body.get("max_tokens", 5)), media_type="text/event-stream",
                                         headers=self.headers())
            count, ttft = (10**310, 10**310) if mode == "huge_counts" else (2, 0.01)  # a hostile or broken edge
            return JSONResponse({"object": "text_completion", "choices": [{"text": f"hi from {self.name}"}],
                                 "usage": {"completion_tokens": count}, "collm": {"ttft_s": ttft}},
                                headers=self.headers())

        return app

    async def stream(self, mode: str, n: int):
        import asyncio

        if mode == "die_before_first":
            raise RuntimeError("scripted failure before the first byte")
        for i in range(n):
            await asyncio.sleep(0.05)
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}) + "\n\n"
            if mode == "die_mid_stream" and i == 2:
                raise RuntimeError("scripted failure mid-stream")
        count = 10**310 if mode == "huge_counts" else n
        yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                     "usage": {"completion_tokens": count}}) + "\n\n"
        yield "data: [DONE]\n\n"

    def start(self):
        self.server, self.thread, _ = serve_in_thread(self.build(), self.port)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def fakes():
    edges = [FakeEdge("a"), FakeEdge("b", edge_header=False)]
    yield edges
    for e in edges:
        e.stop()


@pytest.fixture
def router(fakes):
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes]))
    yield r
    r.close()


def post(router, body, path="/v1/completions", **kw):
    return httpx.post(router.url + path, json=body, timeout=30, **kw)


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("raw, status", [
    ("[" * 100_000 + "]" * 100_000, 400),                            # JSON too deep for Python's parser
    ('{"prompt": "hi \\ud800", "max_tokens": 2}', 200),            # a lone surrogate in the text
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', 200),
    ('{"prompt": "x", "slo": {"ttft_ms": 1e400, "tpot_ms": -5}}', 200),  # an infinite target, a negative one
    ('{"prompt": "x", "max_tokens": 1' + "0" * 310 + "}", 200),    # integers past any float (were a 500)
    ('{"prompt": "x", "slo": {"ttft_ms": 1' + "0" * 310 + ', "tpot_ms": 5' + "0" * 400 + "}}", 200),
])
def test_odd_bodies_reach_the_edge_and_its_answer_comes_back(router, raw, status):
    path = "/v1/chat/completions" if "messages" in raw[:20] else "/v1/completions"
    r = httpx.post(router.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code in (status, 404 if path.endswith("chat/completions") else status), r.text
    assert r.status_code < 500


def test_an_edge_that_reports_300_digit_counts_cannot_break_the_router(router, fakes):
    """The router learns the typical output and the TTFT from the edges' answers: a 300-digit count overflowed
    into a 500, and on a stream left the edge's slot held (repeated, every client got 503)."""
    for e in fakes:
        e.mode = "huge_counts"
    typical = router.router.typical_output
    for stream in (False, True, False, True):
        r = post(router, {"prompt": "hi", "max_tokens": 3, "stream": stream})
        assert r.status_code == 200, r.text
    router.wait_for(lambda: all(e.outstanding == 0 for e in router.router.edges), what="every slot given back")
    assert router.router.typical_output == typical  # nothing learned from the hostile counts
    for e in fakes:
        e.mode = "ok"
    assert post(router, {"prompt": "hi"}).status_code == 200  # routed on the same typical output as before


def test_forwards_body_and_headers_and_names_the_edge(router, fakes):
    seen = set()
    for i in range(12):
        r = post(router, {"prompt": f"p{i}", "max_tokens": 3, "slo": {"ttft_ms": 500}})
        assert r.status_code == 200, r.text
        assert r.headers["X-CoLLM-Adapter-Version"] == "3" and r.headers["X-CoLLM-Router-Attempts"] == "1"
        edge = r.headers["X-CoLLM-Edge"]
        assert r.json()["choices"][0]["text"] == f"hi from {edge}"  # b sends no X-CoLLM-Edge: the router adds it
        seen.add(edge)
    assert seen == {"a", "b"}  # idle edges are near-ties: both get traffic
    assert fakes[0].bodies[0]["slo"] == {"ttft_ms": 500}  # bodies go through unchanged
    assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "fake"


def test_stream_is_relayed_as_it_arrives(router, fakes):
    t0 = time.perf_counter()
    stamps, body = [], b""
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 10},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            stamps.append(time.perf_counter() - t0)
            body += chunk
    events = sse(body.decode())
    assert events[-1] == "[DONE]" and len(events) == 12
    # the edge sends a token every 50 ms for 0.5 s: the first arrives long before the last
    assert stamps[0] < 0.3 and stamps[-1] > 0.45 and len(stamps) >= 8


def test_5xx_and_broken_connections_before_the_first_byte_are_retried_once(router, fakes):
    a, b = fakes
    for mode in ("500", "503", "die_before_first"):
        a.mode = b.mode = "ok"
        a.mode = mode
        # force the first pick onto a: make b look loaded for this one request
        b.queue = 40
        router.wait_for(lambda: router.edge("b").scrape and router.edge("b").scrape.queue_depth == 40, what="scrape")
        for stream in (False, True) if mode != "die_before_first" else (True,):
            r = post(router, {"prompt": "x", "max_tokens": 3, "stream": stream})
            assert r.status_code == 200, (mode, r.text)
            assert r.headers["X-CoLLM-Edge"] == "b" and r.headers["X-CoLLM-Router-Attempts"] == "2", mode
            if stream:
                assert sse(r.text)[-1] == "[DONE]" and "error" not in r.text
            router.edge("a").cooldown_until = 0  # a 503 puts a on a cooldown; this test wants a tried first
        b.queue = 0
    metrics = httpx.get(router.url + "/metrics").text
    assert 'collm_router_retries_total{reason="500"} 2.0' in metrics
    assert 'collm_router_retries_total{reason="read"} 1.0' in metrics  # the stream that died before a byte


def test_both_edges_failing_passes_the_last_answer_through(router, fakes):
    for e in fakes:
        e.mode = "500"
    r = post(router, {"prompt": "x"})
    assert r.status_code == 500 and r.headers["X-CoLLM-Router-Attempts"] == "2"
    assert r.json()["error"]["message"].endswith("says 500")
    assert sum(e.calls for e in fakes) == 2  # retried once, not more


def test_4xx_pass_through_unchanged_and_429_is_retried_once(router, fakes):
    a, b = fakes
    for code in (400, 404):
        a.mode = b.mode = str(code)
        before = a.calls + b.calls
        r = post(router, {"prompt": "x"})
        assert r.status_code == code and r.json()["error"]["message"].endswith(f"says {code}")
        assert a.calls + b.calls == before + 1  # the client's mistake: not retried
    a.mode, b.mode = "429", "ok"
    b.queue = 40
    router.wait_for(lambda: router.edge("b").scrape.queue_depth == 40, what="scrape")
    best_effort = {"X-CoLLM-Best-Effort": "1"}  # b's queue is far past any TTFT target: admission would refuse
    r = post(router, {"prompt": "x"}, headers=best_effort)
    assert r.status_code == 200 and r.headers["X-CoLLM-Edge"] == "b" and r.headers["X-CoLLM-Router-Attempts"] == "2"
    b.mode = "429"
    r = post(router, {"prompt": "x"}, headers=best_effort)
    assert r.status_code == 429 and r.headers["Retry-After"] == "7"


def test_admission_refuses_what_no_edge_can_start_in_time_and_best_effort_goes_through(router, fakes):
    a, b = fakes
    a.queue = b.queue = 60  # the fake edges' costs: every estimate is seconds past a 1 s TTFT target
    router.wait_for(lambda: all(router.edge(n).scrape.queue_depth == 60 for n in "ab"), what="scrape")
    calls = a.calls + b.calls
    r = post(router, {"prompt": "x", "max_tokens": 3})
    assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unattainable"
    assert int(r.headers["Retry-After"]) >= 1 and a.calls + b.calls == calls  # refused here, no edge asked
    assert float(r.headers["X-CoLLM-Soonest-TTFT"]) > 1.0  # the estimate admission judged, past the target
    metrics = httpx.get(router.url + "/metrics").text
    assert "collm_router_refused_total 1.0" in metrics
    late = post(router, {"prompt": "x", "max_tokens": 3, "best_effort": True})
    assert late.status_code == 200 and float(late.headers["X-CoLLM-Soonest-TTFT"]) > 1.0  # served, estimate shown
    assert post(router, {"prompt": "x", "max_tokens": 3}, headers={"X-CoLLM-Best-Effort": "true"}).status_code == 200
    assert post(router, {"prompt": "x", "max_tokens": 3, "slo": {"ttft_ms": 600_000}}).status_code == 200
    a.queue = b.queue = 0
    router.wait_for(lambda: all(router.edge(n).scrape.queue_depth == 0 for n in "ab"), what="scrape")
    ok = post(router, {"prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200 and 0 < float(ok.headers["X-CoLLM-Soonest-TTFT"]) <= 1.0


def test_admission_loosens_after_first_tokens_with_room_and_tightens_on_edge_429s(fakes):
    """The adaptive margin over real HTTP: streamed first tokens that come fast loosen it, so a request
    whose soonest estimate is 1.5x its target goes through; edges answering 429 tighten it again."""
    a, b = fakes
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes], routing={
        "seed": 0, "admission_margin_max": 2.0, "typical_output_tokens": 2,  # what the fakes answer: estimates hold
        "admission_feedback": {"period_s": 0.05, "min_requests": 3, "step": 1.0, "cool_s": 60}}))
    try:
        a.queue = b.queue = 30  # the fake edges' costs: an estimate of seconds
        r.wait_for(lambda: all(r.edge(n).scrape.queue_depth == 30 for n in "ab"), what="scrape")
        est = float(post(r, {"prompt": "x", "max_tokens": 3, "best_effort": True}).headers["X-CoLLM-Soonest-TTFT"])
        tight = {"prompt": "x", "max_tokens": 3, "slo": {"ttft_ms": 1000 * est / 1.5}}  # estimate 1.5x its target
        assert post(r, tight).status_code == 429 and r.router.admission.margin == 1.0
        for _ in range(4):  # streamed first tokens 0.05 s after sending, against the edges' 1 s target
            assert post(r, {"prompt": "x", "stream": True, "max_tokens": 2, "best_effort": True}).status_code == 200
        time.sleep(0.06)
        ok = post(r, tight)
        assert ok.status_code == 200 and float(ok.headers["X-CoLLM-Soonest-TTFT"]) > est / 1.5
        assert r.router.admission.margin == 2.0
        assert "collm_router_admission_margin 2.0" in httpx.get(r.url + "/metrics").text
        a.mode = b.mode = "429"  # queue full: each request is tried on both edges, two 429s
        for _ in range(2):
            assert post(r, {"prompt": "x", "max_tokens": 3, "best_effort": True}).status_code == 429
        time.sleep(0.06)
        calls = a.calls + b.calls
        refused = post(r, tight)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "slo_unattainable"
        assert a.calls + b.calls == calls and r.router.admission.margin == 1.0  # refused at the router
        assert not r.router.awaiting  # every try left the waiting list, streamed or answered, served or not
    finally:
        r.close()


def test_a_gated_slo_pack_spreads_while_first_tokens_come_late_and_gathers_again_after(fakes):
    """routing.pack_gate over real HTTP: slo_pack sends requests to the edge that already has one while the
    first tokens the router relays come with room; once they come late (a burst) it spreads them, and it
    gathers again when the late ones have left the window. With a fixed admission margin: the slack is
    measured all the same."""
    a, b = fakes
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes], routing={
        "seed": 0, "policy": "slo_pack", "pack_gate": 0.5, "admission_margin_max": None,
        "admission_feedback": {"period_s": 0.05, "window_s": 3.0, "min_requests": 3}}))

    def served_by():
        got = post(r, {"prompt": "x", "max_tokens": 3})
        assert got.status_code == 200, got.text
        return got.headers["X-CoLLM-Edge"]

    def streams(ttft_ms):  # first tokens 0.05 s after sending, against this target
        for _ in range(4):
            assert post(r, {"prompt": "x", "stream": True, "max_tokens": 2, "best_effort": True,
                            "slo": {"ttft_ms": ttft_ms}}).status_code == 200
        time.sleep(0.06)

    try:
        a.queue = 1  # a serves one request already: slo_pack's gathering sends the next there too
        r.wait_for(lambda: r.edge("a").scrape.queue_depth == 1 and r.edge("b").scrape.queue_depth == 0,
                   what="scrape")
        assert {served_by() for _ in range(3)} == {"a"}  # no evidence yet: gather
        streams(ttft_ms=20)  # 2.5x their target: slack -1.5
        assert {served_by() for _ in range(3)} == {"b"} and r.router.admission.slack < 0.5
        health = httpx.get(r.url + "/health").json()
        assert (health["policy"], health["routing_now"]) == ("slo_pack", "slo") and health["ttft_slack"] < 0.5
        assert "collm_router_gathering 0.0" in httpx.get(r.url + "/metrics").text
        time.sleep(3.1)  # the late ones leave the window
        streams(ttft_ms=1000)
        assert {served_by() for _ in range(3)} == {"a"} and r.router.admission.slack > 0.5
        assert httpx.get(r.url + "/health").json()["routing_now"] == "slo_pack"
        assert "collm_router_gathering 1.0" in httpx.get(r.url + "/metrics").text
    finally:
        r.close()


def test_mid_stream_failure_ends_with_an_sse_error_event(router, fakes):
    for e in fakes:
        e.mode = "die_mid_stream"
    r = post(router, {"prompt": "x", "stream": True, "max_tokens": 10})
    assert r.status_code == 200
    events = sse(r.text)
    assert [e["choices"][0]["text"] for e in events[:3]] == ["t0 ", "t1 ", "t2 "]
    assert events[-2]["error"]["code"] == "edge_stream_failed" and events[-1] == "[DONE]"
    assert r.headers["X-CoLLM-Router-Attempts"] == "1"  # bytes were out: no retry
    assert 'outcome="stream_error"' in httpx.get(router.url + "/metrics").text
    assert all(e.outstanding == 0 for e in router.router.edges)


def test_connection_refused_is_routed_around_and_the_edge_comes_back(fakes):
    # polls far apart: the router learns that `a` is gone from the refused request itself
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes], health={"interval_s": 30}))
    try:
        a, b = fakes
        a.stop()
        codes = [post(r, {"prompt": "x"}) for _ in range(6)]
        assert all(c.status_code == 200 and c.headers["X-CoLLM-Edge"] == "b" for c in codes)
        assert sum(c.headers["X-CoLLM-Router-Attempts"] == "2" for c in codes) == 1  # one retry; then a is out
        assert not r.edge("a").healthy
        assert httpx.get(r.url + "/health").json()["healthy_edges"] == 1
    finally:
        r.close()
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes]))
    try:
        assert not r.edge("a").healthy
        a.start()  # same port: the health poll puts it back
        r.wait_for(lambda: r.edge("a").healthy, what="a back in")
        seen = {post(r, {"prompt": "x"}).headers["X-CoLLM-Edge"] for _ in range(12)}
        assert seen == {"a", "b"}
    finally:
        r.close()


def test_unready_edge_is_taken_out_after_failed_polls(router, fakes):
    a, _ = fakes
    a.ready = False
    router.wait_for(lambda: not router.edge("a").healthy, what="a out")
    assert {post(router, {"prompt": "x"}).headers["X-CoLLM-Edge"] for _ in range(6)} == {"b"}
    a.ready = True
    router.wait_for(lambda: router.edge("a").healthy, what="a back")


def test_slow_health_checks_do_not_take_out_an_edge_that_is_streaming(fakes):
    """Overloaded edges answer /health late; while one streams tokens to the router it stays in."""
    r = LiveRouter(router_config([(e.name, e.url) for e in fakes], health={"timeout_s": 0.3, "interval_s": 0.1}))
    try:
        a, b = fakes
        a.health_delay = 1.0
        b.queue = 40  # the stream goes to a
        r.wait_for(lambda: r.edge("b").scrape.queue_depth == 40, what="scrape")
        with httpx.stream("POST", r.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 30},
                          timeout=30) as s:
            assert s.headers["X-CoLLM-Edge"] == "a"
            for _ in s.iter_raw():
                assert r.edge("a").healthy  # 1.5 s of stream, polls timing out all along
        r.wait_for(lambda: not r.edge("a").healthy, timeout=5, what="a out once it is silent")
        assert 'kind="poll_timeout"' in httpx.get(r.url + "/metrics").text
    finally:
        r.close()


def test_no_healthy_edge_is_503_with_an_openai_error():
    r = LiveRouter(router_config([("x", f"http://127.0.0.1:{free_port()}"), ("y", f"http://127.0.0.1:{free_port()}")]))
    try:
        h = httpx.get(r.url + "/health")
        assert h.status_code == 503 and h.json()["healthy_edges"] == 0
        for path in ("/v1/completions", "/v1/chat/completions"):
            resp = post(r, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, path=path)
            assert resp.status_code == 503 and resp.headers["Retry-After"]
            err = resp.json()["error"]
            assert err["type"] == "service_unavailable" and err["code"] == "no_healthy_edge"
            assert "x (" in err["message"] and "y (" in err["message"]
        assert httpx.get(r.url + "/v1/models").status_code == 503
        assert "collm_router_no_healthy_edge_total 3.0" in httpx.get(r.url + "/metrics").text
    finally:
        r.close()


def test_metrics_name_every_edge(router, fakes):
    post(router, {"prompt": "x", "max_tokens": 3})
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True}) as s:
        s.read()
    text = httpx.get(router.url + "/metrics").text
    for name in ("collm_router_routed_total", "collm_router_responses_total", "collm_router_edge_healthy",
                 "collm_router_edge_outstanding", "collm_router_ttft_estimated_seconds_count",
                 "collm_router_ttft_observed_seconds_count", "collm_router_healthy_edges 2.0"):
        assert name in text, name
    assert 'collm_router_edge_healthy{edge="a"} 1.0' in text and 'collm_router_routed_total{edge="b"}' in text


# ----------------------------------------------------------------------------------------- the CLI
def test_cli_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "router.yaml"
    bad.write_text("edges:\n  - {name: a, url: 'localhost:1'}\nrouting: {policy: fastest}\n")
    p = subprocess.run([sys.executable, "-m", "collm.router.cli", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [
        f"error: {bad}: edges.0.url: expected an http:// or https:// URL such as http://127.0.0.1:8081, "
        "got 'localhost:1'",
        f"error: {bad}: routing.policy: expected 'slo', 'slo_pack', 'round_robin' or 'least_outstanding', got 'fastest'"]
    p = subprocess.run([sys.executable, "-m", "collm.router.cli", "--config", "configs/router.yaml", "--check"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "policy: slo" in p.stdout and "http://127.0.0.1:8083" in p.stdout


def test_cli_serves_and_exits_zero_on_sigterm(tmp_path, fakes):
    import signal

    import yaml

    port = free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump(router_config([(e.name, e.url) for e in fakes], api={"port": port})))
    proc = subprocess.Popen([sys.executable, "-m", "collm.router.cli", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
        clash = subprocess.run([sys.executable, "-m", "collm.router.cli", "--config", str(cfg)],
                               capture_output=True, text=True, timeout=60)
        assert clash.returncode == 2 and f"api.port: cannot listen on 127.0.0.1:{port}" in clash.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        proc.kill()
