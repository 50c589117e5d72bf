"""The edge HTTP API over real HTTP (uvicorn on loopback) with the tiny model."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import LiveEdge, random_adapter_state, tiny_config
from prometheus_client.parser import text_string_to_metric_families

from collm.common.protocol import VERSION_HEADER


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    cfg = tiny_config(state_dir=str(tmp_path_factory.mktemp("state")), engine={"max_running": 4, "max_queue": 64})
    e = LiveEdge(cfg)
    yield e
    e.close()


def post(edge, path, body, **kw):
    return httpx.post(edge.url + path, json=body, timeout=60, **kw)


def model_id(edge):
    return httpx.get(edge.url + "/v1/models").json()["data"][0]["id"]


def sse_events(resp):
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_health_models_adapters(edge):
    h = httpx.get(edge.url + "/health").json()
    assert h["status"] == "ready" and h["adapter_version"] == 0 and h["edge"] == "t"
    models = httpx.get(edge.url + "/v1/models").json()
    assert models["data"][0]["id"] == "collm-global" and models["data"][0]["max_model_len"] > 0
    assert models["data"][0]["root"] == models["data"][-1]["id"] == "collm-tiny"
    ad = httpx.get(edge.url + "/v1/adapters").json()
    assert ad["serving_version"] == 0 and ad["history"][0]["source"] == "initial"


def test_completion_and_chat_non_streaming(edge):
    r = post(edge, "/v1/completions", {"model": model_id(edge), "prompt": "Once upon a time", "max_tokens": 8,
                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 0
    assert r.headers[VERSION_HEADER] == str(body["adapter_version"]) == "0"
    r = post(edge, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert r.json()["usage"]["completion_tokens"] == 6


def test_streaming_completion_and_chat(edge):
    with httpx.stream("POST", edge.url + "/v1/completions", timeout=60,
                      json={"prompt": "Tell me", "max_tokens": 10, "stream": True, "temperature": 0,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = post(edge, "/v1/completions", {"prompt": "Tell me", "max_tokens": 10, "temperature": 0,
                                          "ignore_eos": True}).json()
    assert text == full["choices"][0]["text"]  # streamed deltas add up to the whole answer
    with httpx.stream("POST", edge.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
                            "temperature": 0, "ignore_eos": True}) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_sixteen_concurrent_clients(edge):
    def one(i):
        return post(edge, "/v1/completions", {"prompt": f"Question {i}:", "max_tokens": 12, "temperature": 0.7,
                                              "seed": i, "ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [r.status_code for r in results] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in results)


@pytest.mark.parametrize("raw,status,param,words", [
    (b"{not json", 400, None, "not valid JSON"),
    (json.dumps({"prompt": "x", "max_tokens": "lots"}), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "x", "temperature": 7}), 400, "temperature", "less than or equal to 2"),
    (json.dumps({"max_tokens": 3}), 400, "prompt", "Field required"),
    (json.dumps({"prompt": "x", "n": 3}), 400, "n", "only n=1"),
    (json.dumps({"prompt": "x", "logprobs": 2}), 400, "logprobs", "not supported"),
    (json.dumps({"prompt": "x", "frequency_penalty": 0.5}), 400, "frequency_penalty", "use 0"),
    (json.dumps({"prompt": "x", "model": "gpt-9"}), 404, "model", "does not exist"),
    ('{"prompt": "hi \\ud800", "max_tokens": 2}', 400, "prompt", "lone surrogate"),
    (json.dumps({"prompt": "x", "stop": ["\ud800"]}), 400, "stop", "lone surrogate"),
    ('{"prompt": "x", "slo": {"ttft_ms": 1e400}}', 400, "slo.ttft_ms", "finite"),
    ('{"prompt": "x", "seed": 18446744073709551616}', 400, "seed", "less than or equal to"),
])
def test_bad_requests_get_openai_errors(edge, raw, status, param, words):
    r = httpx.post(edge.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 18446744073709551616 * 10])
def test_a_seed_torch_cannot_take_is_a_400_and_the_edge_keeps_serving(edge, seed):
    r = post(edge, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": seed})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"
    ok = post(edge, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 2**64 - 1})
    assert ok.status_code == 200, ok.text
    assert httpx.get(edge.url + "/health").json()["status"] == "ready"


@pytest.mark.parametrize("content, words", [
    ([{"type": "text", "text": 5}], "needs a string 'text'"),
    ([{"type": "text", "text": "ok"}, {"type": "text"}], "content part 1"),
    ("hello \ud800", "lone surrogate"),
])
def test_bad_chat_content_is_a_400(edge, content, words):
    raw = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    r = httpx.post(edge.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_prompt_over_context_limit(edge):
    limit = edge.engine.max_context
    r = post(edge, "/v1/completions", {"prompt": "word " * (limit + 10)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]
    r = post(edge, "/v1/completions", {"prompt": "short", "max_tokens": limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_metrics_parse_and_move_with_traffic(edge):
    def scrape():
        text = httpx.get(edge.url + "/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels or s.labels.get("finish_reason") == "length"}

    before = scrape()
    post(edge, "/v1/completions", {"prompt": "count me", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    after = scrape()
    assert after["collm_requests_total"] == before.get("collm_requests_total", 0) + 1
    assert after["collm_ttft_seconds_count"] == before.get("collm_ttft_seconds_count", 0) + 1
    for name in ("collm_queue_depth", "collm_slo_attainment", "collm_goodput_rps", "collm_spare_capacity",
                 "collm_adapter_version", "collm_batch_size_mean", "collm_training_tokens_per_second",
                 "collm_adapter_swaps_total"):
        assert name in after, name


def test_hot_swap_during_a_stream_keeps_its_version(edge):
    v0 = edge.engine.shadow.current_version
    got_first = threading.Event()
    result = {}

    def stream():
        with httpx.stream("POST", edge.url + "/v1/completions", timeout=60,
                          json={"prompt": "swap", "max_tokens": 60, "stream": True, "temperature": 0,
                                "ignore_eos": True}) as r:
            result["header"] = r.headers[VERSION_HEADER]
            events = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    got_first.set()
            result["events"] = events

    t = threading.Thread(target=stream)
    t.start()
    assert got_first.wait(20)
    assert edge.runtime.publish(random_adapter_state(edge.engine, 99), v0 + 1, round=1)
    t.join(30)
    assert result["header"] == str(v0)
    assert {e["adapter_version"] for e in result["events"]} == {v0}
    assert result["events"][-1]["choices"][0]["finish_reason"] == "length"
    after = post(edge, "/v1/completions", {"prompt": "after", "max_tokens": 2})
    assert after.headers[VERSION_HEADER] == str(v0 + 1)
    assert httpx.get(edge.url + "/v1/adapters").json()["round"] == 1


def test_model_picks_the_base_the_global_or_a_retained_version(tmp_path):
    """`model` chooses the adapter per request (serve/models.py); mixed batches stay exact."""
    from collm.edge_client.model.shadow import state_digest

    e = LiveEdge(tiny_config(state_dir=str(tmp_path / "s"), adapters={"retain": 2},
                             engine={"max_running": 8, "shed_late": False}))  # a loaded machine: no 'expired'

    try:
        def ask(model, prompt="Once upon a time"):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            if model is not None:
                body["model"] = model
            return post(e, "/v1/completions", body)

        ref = {0: ask(None).json()["choices"][0]["text"]}  # version 0 has B = 0: the base model's output
        states = {v: random_adapter_state(e.engine, 40 + v) for v in (1, 2, 3)}
        for v in (1, 2, 3):
            assert e.runtime.publish(states[v], v, round=v)
            ref[v] = ask(None).json()["choices"][0]["text"]
        assert len(set(ref.values())) == 4  # every version answers differently: the checks below can fail

        models = httpx.get(e.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["collm-global", "collm-global:local", "collm-global@3", "collm-global@2",
                                             "collm-tiny"]
        glob, local, v3, v2, base = models
        assert local["parent"] == "collm-global" and local["local_steps"] == 0 and local["based_on_version"] == 3
        assert glob["adapter_version"] == 3 and glob["round"] == 3 and glob["parent"] == "collm-tiny"
        assert glob["sha256"] == v3["sha256"] == state_digest(states[3]) != v2["sha256"]
        assert v2["parent"] == "collm-global" and v2["root"] == "collm-tiny" and v2["adapter_version"] == 2
        assert base["parent"] is None and base["adapter_version"] is None

        for model, version, text in [(None, 3, ref[3]), ("collm-global", 3, ref[3]),
                                     ("collm-global@2", 2, ref[2]), ("collm-tiny", None, ref[0])]:
            r = ask(model)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == text, model
            assert body["adapter_version"] == version and body["model"] == (model or "collm-global")
            assert r.headers[VERSION_HEADER] == ("base" if version is None else str(version))

        # all three kinds at once, several times over: each request still gets its own version's tokens
        kinds = [("collm-global", ref[3]), ("collm-global@2", ref[2]), ("collm-tiny", ref[0])] * 4
        with ThreadPoolExecutor(len(kinds)) as pool:
            texts = list(pool.map(lambda k: ask(k[0]).json()["choices"][0]["text"], kinds))
        assert texts == [t for _, t in kinds]

        for gone in ("collm-global@1", "collm-global@9", "collm-global@x", "gpt-9"):
            r = ask(gone)
            err = r.json()["error"]
            assert r.status_code == 404 and err["param"] == "model" and err["code"] == "model_not_found", gone
            assert "available: collm-global, collm-global:local, collm-global@3, collm-global@2, collm-tiny" \
                in err["message"]
        assert e.engine.shadow.alive_versions() == [2, 3]  # version 1 fell out of retention and was freed

        counts = {(s.labels["version"], s.name): s.value
                  for fam in text_string_to_metric_families(httpx.get(e.url + "/metrics").text) for s in fam.samples
                  if s.name in ("collm_version_requests_total", "collm_version_ttft_seconds_count")
                  and s.labels.get("finish_reason", "length") == "length"}
        # per version: @2 served 1 while current + 1 named + 4 concurrent, the base 1 + 4, version 3 1 + 2 + 4
        assert counts[("2", "collm_version_requests_total")] == 6 and counts[("base", "collm_version_requests_total")] == 5
        assert counts[("3", "collm_version_ttft_seconds_count")] == 7
        # version 1 left retention: its series are dropped, so the scrape does not grow by one per round
        assert not any(v in ("0", "1") for v, _ in counts)
    finally:
        e.close()


def test_client_disconnect_frees_its_slot(edge):
    free = edge.engine.free_slots()
    cancelled = edge.engine.telemetry.totals["cancelled"]
    # the tiny model writes 1000 tokens in about a second; on a loaded machine the client can read its first chunk
    # after the request has already finished, so a request that is not in flight any more is tried again
    for _ in range(3):
        with httpx.stream("POST", edge.url + "/v1/completions", timeout=60,
                          json={"prompt": "long", "max_tokens": 1000, "stream": True, "temperature": 0,
                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
            in_flight = edge.engine.free_slots() == free - 1
        if in_flight:
            break
    assert in_flight, "the streamed request was never seen in flight"
    deadline = time.time() + 5
    while edge.engine.free_slots() != free and time.time() < deadline:
        time.sleep(0.02)
    assert edge.engine.free_slots() == free
    assert edge.engine.telemetry.totals["cancelled"] >= cancelled + 1


def test_queue_full_is_429_with_retry_after(tmp_path):
    cfg = tiny_config(state_dir=str(tmp_path), engine={"max_running": 1, "max_queue": 1, "shed_late": False})
    e = LiveEdge(cfg)
    try:
        body = {"prompt": "hold", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: post(e, "/v1/completions", body), range(6)))
        codes = sorted(r.status_code for r in results)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        limited = next(r for r in results if r.status_code == 429)
        assert int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["code"] == "queue_full"
    finally:
        e.close()


def test_a_request_the_queue_has_no_room_for_is_refused_before_it_is_tokenized(tmp_path):
    """The tokenizer's thread had no bound: every request was tokenized before the queue's check, so a flood
    of large prompts delayed everyone's. Now the room counts requests in the tokenizer, and past it a request
    is refused at once."""
    cfg = tiny_config(state_dir=str(tmp_path), engine={"max_running": 1, "max_queue": 0, "shed_late": False})
    e = LiveEdge(cfg)
    try:
        hold = threading.Thread(target=post, args=(e, "/v1/completions", {"prompt": "hold", "max_tokens": 400,
                                                                          "temperature": 0, "ignore_eos": True}))
        hold.start()
        deadline = time.monotonic() + 30
        while e.engine.queue_room() > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert e.engine.queue_room() == 0  # the one slot is taken and nothing may wait
        r = post(e, "/v1/completions", {"prompt": "x" * 5000, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert "with those being tokenized" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        hold.join(60)
    finally:
        e.close()


def test_openai_client_works_unchanged(edge):
    from openai import OpenAI

    client = OpenAI(base_url=edge.url + "/v1", api_key="unused")
    mid = client.models.list().data[0].id
    c = client.completions.create(model=mid, prompt="Hello", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=mid, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) is not None
    from openai import BadRequestError

    with pytest.raises(BadRequestError):
        client.completions.create(model=mid, prompt="x", max_tokens=5, temperature=5)


def test_admin_endpoints(tmp_path):
    from collm.common.adapter_io import save_adapter

    e = LiveEdge(tiny_config(state_dir=str(tmp_path / "s"), api={"admin": True, "admin_without_token": True}))
    try:
        job = post(e, "/admin/train", {"steps": 2}).json()["job"]
        deadline = time.time() + 60
        while (st := httpx.get(e.url + f"/admin/jobs/{job}").json())["status"] == "running":
            assert time.time() < deadline
            time.sleep(0.05)
        assert st["status"] == "done" and st["report"]["steps"] == 2
        save_adapter(tmp_path / "ad", random_adapter_state(e.engine, 3), e.engine.cfg.lora, "collm-tiny")
        view = post(e, "/admin/adapters", {"path": str(tmp_path / "ad")}).json()
        assert view["serving_version"] == 1 and view["source"] == "admin"
        assert post(e, "/admin/adapters", {"path": str(tmp_path / "nope")}).status_code == 400
        for odd in ("a\u0000b", "\ud800"):  # a NUL byte, a lone surrogate: no path at all (were a 500)
            r = httpx.post(e.url + "/admin/adapters", content=json.dumps({"path": odd}),  # escaped: \ud800 as text
                           headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        bad_cfg = tmp_path / "bad-config"
        save_adapter(bad_cfg, random_adapter_state(e.engine, 4), e.engine.cfg.lora, "collm-tiny")
        (bad_cfg / "adapter_config.json").write_text("{not json")
        r = post(e, "/admin/adapters", {"path": str(bad_cfg)})
        assert r.status_code == 400 and "not readable JSON" in r.json()["error"]["message"]
        bad_weights = tmp_path / "bad-weights"
        save_adapter(bad_weights, random_adapter_state(e.engine, 4), e.engine.cfg.lora, "collm-tiny")
        (bad_weights / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
        r = post(e, "/admin/adapters", {"path": str(bad_weights)})
        assert r.status_code == 400 and "safetensors" in r.json()["error"]["message"]
        assert post(e, "/admin/train", {}).json()["error"]["message"].endswith("give steps or tokens")
        r = post(e, "/admin/evaluate", {"version": 7})  # the engine's own refusal, named by the field
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text

        view = post(e, "/admin/rollback", {"version": 0}).json()  # the undo: serve a retained version again
        assert view["serving_version"] == 0 and view["source"] == "rollback" and view["latest_version"] == 1
        assert post(e, "/v1/completions", {"prompt": "x", "max_tokens": 2}).headers[VERSION_HEADER] == "0"
        r = post(e, "/admin/rollback", {"version": 9})
        assert r.status_code == 404 and "available: 0, 1" in r.json()["error"]["message"]
        saved = tmp_path / "s" / "serving" / "serving.json"
        assert json.loads(saved.read_text())["version"] == 0  # what a restart serves
        assert post(e, "/admin/adapters", {"path": str(tmp_path / "ad")}).json()["serving_version"] == 2
    finally:
        e.close()


def test_admin_is_off_by_default(edge):
    r = post(edge, "/admin/train", {"steps": 1})
    assert r.status_code == 404 and "api.admin" in r.json()["error"]["message"]


def test_a_dead_engine_makes_health_503(tmp_path):
    e = LiveEdge(tiny_config(state_dir=str(tmp_path)))
    try:
        def broken_planner():  # a bug in the engine loop itself
            raise RuntimeError("planner bug")

        e.engine.core.plan = broken_planner
        first = post(e, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert first.status_code in (500, 503)
        h = httpx.get(e.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "error" and "planner bug" in h.json()["error"]
        again = post(e, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert again.status_code == 503 and "restart" in again.json()["error"]["message"]
    finally:
        e.close()


def test_the_real_load_report_carries_every_key_the_balancer_reads(edge):
    from collm.common.protocol import LoadReport
    from collm.edge_client.federation.client import FederatedEdge

    post(edge, "/v1/completions", {"prompt": "warm", "max_tokens": 3})
    record = FederatedEdge(edge.runtime).report()
    assert set(record) == set(LoadReport.keys())
    r = LoadReport.from_record("t", record)
    snap = edge.engine.snapshot()
    assert r.train_examples == snap.train_examples > 0
    assert r.train_tokens_per_s == pytest.approx(snap.idle_train_tokens_per_s) and r.train_tokens_per_s > 0
    assert r.adapter_version == snap.adapter_version >= 0
    assert 0 <= r.spare_capacity <= 1 and r.request_rate > 0 and r.slo_attainment is not None


def test_a_request_that_cannot_start_in_time_gets_a_429_not_a_late_answer(tmp_path):
    e = LiveEdge(tiny_config(state_dir=str(tmp_path), engine={"max_running": 1},
                             slo={"ttft_ms": 150, "tpot_ms": 1000}))
    try:
        body = {"prompt": "hold", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, e, "/v1/completions", body)
            time.sleep(0.05)
            late = post(e, "/v1/completions", body)
            assert first.result().status_code == 200
        assert late.status_code == 429, late.text
        err = late.json()["error"]
        assert err["code"] == "slo_unattainable" and "TTFT target" in err["message"]
        assert int(late.headers["Retry-After"]) >= 1
    finally:
        e.close()


def test_a_restarted_edge_catches_up_to_the_checkpointed_global_before_it_serves(tmp_path):
    """State dir says v1 (what the edge served before it died); the server has since written round 4."""
    from collm.edge_client.federation.service import EdgeFederation
    from collm.server.checkpoints import write_round

    state_dir, ckpt = tmp_path / "state", tmp_path / "ckpt"
    first = LiveEdge(tiny_config(state_dir=str(state_dir)))
    assert first.runtime.publish(random_adapter_state(first.engine, 1), 1, round=1)
    g4 = random_adapter_state(first.engine, 4)
    first.close()
    write_round(ckpt, 4, {k: v.numpy() for k, v in g4.items()}, {"round": 4}, first.engine.cfg.lora, "collm-tiny")

    again = LiveEdge(tiny_config(state_dir=str(state_dir)))  # a restart: restores v1 from its state dir
    try:
        assert again.engine.shadow.current_version == 1
        assert EdgeFederation(again.runtime).catch_up(str(ckpt)) == 4
        view = httpx.get(again.url + "/v1/adapters").json()
        assert view["serving_version"] == 4 and view["source"] == "bootstrap"
        assert EdgeFederation(again.runtime).catch_up(str(ckpt)) is None  # nothing newer: no swap
        r = post(again, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.headers[VERSION_HEADER] == "4"
    finally:
        again.close()



def test_a_version_number_is_never_reused_after_a_rollback_and_a_restart(tmp_path):
    """Rolled back from 901 to 900 and restarted: the restored 900 made 901 look free, and round 3's global
    was published as a second, different version 901."""
    from collm.common.adapter_io import save_adapter

    state_dir = tmp_path / "s"
    e = LiveEdge(tiny_config(state_dir=str(state_dir), api={"admin": True, "admin_without_token": True}))
    try:
        save_adapter(tmp_path / "ad", random_adapter_state(e.engine, 9), e.engine.cfg.lora, "collm-tiny")
        assert post(e, "/admin/adapters", {"path": str(tmp_path / "ad"), "version": 900}).status_code == 200
        assert e.runtime.publish_global(random_adapter_state(e.engine, 2), 2)
        assert e.engine.shadow.current_version == 901
        e.runtime.rollback(900)
    finally:
        e.close()
    again = LiveEdge(tiny_config(state_dir=str(state_dir)))
    try:
        assert again.engine.shadow.current_version == 900 and again.engine.shadow.latest_version == 901
        assert again.runtime.publish_global(random_adapter_state(again.engine, 3), 3)
        assert again.engine.shadow.current_version == 902
    finally:
        again.close()


def test_admin_versions_can_never_hold_back_the_federation(tmp_path):
    """An admin publish takes the next version number (or a far one); the next federated round's global is
    still served, above it, and a restart remembers which round it served (issue #34)."""
    from collm.common.adapter_io import save_adapter

    state_dir = tmp_path / "s"
    e = LiveEdge(tiny_config(state_dir=str(state_dir), api={"admin": True, "admin_without_token": True}))
    try:
        rt = e.runtime
        assert rt.publish_global(random_adapter_state(e.engine, 1), 1)
        save_adapter(tmp_path / "ad", random_adapter_state(e.engine, 9), e.engine.cfg.lora, "collm-tiny")
        r = post(e, "/admin/adapters", {"path": str(tmp_path / "ad"), "version": 10**9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "version" and "1001" in r.text
        assert post(e, "/admin/adapters", {"path": str(tmp_path / "ad"), "version": 900}).status_code == 200
        assert rt.publish_global(random_adapter_state(e.engine, 2), 2)  # round 2 passes the admin's 900
        assert e.engine.shadow.current_version == 901 and e.engine.shadow.current_info().round == 2
        assert not rt.publish_global(random_adapter_state(e.engine, 3), 2)  # a round already served
    finally:
        e.close()
    again = LiveEdge(tiny_config(state_dir=str(state_dir)))
    try:
        assert again.engine.shadow.current_version == 901 and again.runtime.latest_round == 2
        assert not again.runtime.publish_global(random_adapter_state(again.engine, 3), 2)
        assert again.runtime.publish_global(random_adapter_state(again.engine, 3), 3)
        assert again.engine.shadow.current_version == 902
    finally:
        again.close()
