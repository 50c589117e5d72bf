"""API keys and the admin token (common/auth.py) on a real tiny edge and a real router, over HTTP."""

import os

import httpx
import pytest
from helpers import LiveEdge, random_adapter_state, tiny_config
from test_router_proxy import LiveRouter

from collm.common.adapter_io import save_adapter
from collm.common.auth import AuthConfig, Keys, refusal
from collm.common.errors import UserError

KEY, ADMIN, ROUTER_KEY = "k-edge-1", "adm-1", "k-client-9"


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def test_refusal_rules():
    keys = Keys(("a", "b"), ("root",))
    assert refusal("/v1/completions", "Bearer b", keys) is None
    assert refusal("/v1/completions", "Bearer root", keys) is None  # the admin token may also call the API
    assert refusal("/v1/completions", "Bearer c", keys)[0] == 401
    assert refusal("/v1/completions", "b", keys)[0] == 401  # not a bearer header
    assert refusal("/v1/models", None, keys)[1]["error"]["code"] == "invalid_api_key"
    assert refusal("/health", None, keys) is None and refusal("/metrics", None, keys) is None
    assert refusal("/health", None, Keys(("a",), (), protect_health=True))[0] == 401
    assert refusal("/admin/train", "Bearer a", keys)[0] == 403
    assert refusal("/admin/train", "Bearer nope", keys)[0] == 401
    assert refusal("/admin/train", "Bearer root", keys) is None
    assert refusal("/v1/completions", None, Keys((), ())) is None  # nothing configured: open


def test_keys_come_from_config_env_and_file_and_a_missing_source_is_one_line(tmp_path, monkeypatch):
    f = tmp_path / "keys.txt"
    f.write_text("# clients\nfile-key  # laptop\n\n")
    monkeypatch.setenv("COLLM_TEST_KEYS", "env-a, env-b")
    cfg = AuthConfig.model_validate({"api_keys": {"keys": ["cfg-key"], "env": "COLLM_TEST_KEYS", "file": str(f)}})
    assert Keys.from_config(cfg).api == ("cfg-key", "env-a", "env-b", "file-key")
    monkeypatch.setenv("COLLM_TEST_EMPTY", "")
    assert Keys.from_config(AuthConfig.model_validate({"api_keys": {"env": "COLLM_TEST_EMPTY"}})).api == ()
    with pytest.raises(UserError, match="auth.api_keys.env: environment variable COLLM_NOPE is not set"):
        Keys.from_config(AuthConfig.model_validate({"api_keys": {"env": "COLLM_NOPE"}}))
    with pytest.raises(UserError, match="auth.admin_tokens.file: cannot read"):
        Keys.from_config(AuthConfig.model_validate({"admin_tokens": {"file": str(tmp_path / "none")}}))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "adapters").mkdir()
    e = LiveEdge(tiny_config(state_dir=str(tmp / "s"), api={"admin": True, "adapter_dir": str(tmp / "adapters")},
                             engine={"shed_late": False},
                             auth={"api_keys": {"keys": [KEY]}, "admin_tokens": {"keys": [ADMIN]}}))
    yield e, tmp
    e.close()


def test_the_edge_wants_a_key_on_v1_and_the_admin_token_on_admin(guarded):
    e, _ = guarded
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, bearer("wrong"), {"Authorization": KEY}):
        r = httpx.post(e.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text
    assert httpx.post(e.url + "/v1/completions", json=body, headers=bearer(KEY), timeout=30).status_code == 200
    assert httpx.get(e.url + "/v1/models", headers=bearer(KEY)).status_code == 200
    assert httpx.get(e.url + "/health").status_code == 200 and httpx.get(e.url + "/metrics").status_code == 200
    r = httpx.post(e.url + "/admin/train", json={"steps": 1}, headers=bearer(KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_token_required"
    assert httpx.post(e.url + "/admin/train", json={"steps": 1}).status_code == 401
    assert httpx.post(e.url + "/admin/train", json={"steps": 1}, headers=bearer(ADMIN)).status_code == 202
    assert httpx.get(e.url + "/openapi.json").status_code == 404  # the admin surface is not mapped


def test_admin_adapter_loads_only_from_the_adapter_dir(guarded):
    e, tmp = guarded
    state = random_adapter_state(e.engine, 5)
    save_adapter(tmp / "adapters" / "good", state, e.engine.cfg.lora, "collm-tiny")
    save_adapter(tmp / "outside", state, e.engine.cfg.lora, "collm-tiny")
    os.symlink(tmp / "outside", tmp / "adapters" / "link-out")
    for path in (tmp / "outside", tmp / "adapters" / ".." / "outside", tmp / "adapters" / "link-out"):
        r = httpx.post(e.url + "/admin/adapters", json={"path": str(path)}, headers=bearer(ADMIN))
        assert r.status_code == 403 and r.json()["error"]["param"] == "path", path
    r = httpx.post(e.url + "/admin/adapters", json={"path": str(tmp / "adapters" / "good")}, headers=bearer(ADMIN))
    assert r.status_code == 200, r.text


def test_the_router_checks_client_keys_and_uses_its_own_key_towards_the_edges(guarded):
    e, _ = guarded
    router = LiveRouter({"edges": [{"name": "t", "url": e.url}], "auth": {"api_keys": {"keys": [ROUTER_KEY]}},
                         "edge_key": {"keys": [KEY]}})
    try:
        router.wait_for(lambda: router.router.healthy_count() == 1, what="the edge to be healthy")
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(router.url + "/v1/completions", json=body, headers=bearer(KEY), timeout=30).status_code == 401
        r = httpx.post(router.url + "/v1/completions", json=body, headers=bearer(ROUTER_KEY), timeout=30)
        assert r.status_code == 200, r.text  # the edge accepted the router's key, not the client's
        assert httpx.get(router.url + "/v1/models", headers=bearer(ROUTER_KEY)).json()["data"][0]["id"] == "collm-global"
    finally:
        router.server.should_exit = True
        router.thread.join(10)


def test_the_device_cli_shows_status_lists_adapters_and_rolls_back(guarded, capsys):
    from collm.edge_client.cli import main

    e, _ = guarded
    assert e.runtime.publish(random_adapter_state(e.engine, 8), e.engine.shadow.latest_version + 1, round=7)
    v = e.engine.shadow.current_version
    with pytest.raises(SystemExit) as done:
        main(["status", "--url", e.url])
    assert done.value.code == 0 and f"serving adapter version {v}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["adapters", "--url", e.url, "--key", KEY, "list"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and f"collm-global@{v}" in out and "collm-tiny" in out
    with pytest.raises(SystemExit) as done:
        main(["adapters", "--url", e.url, "--key", KEY, "rollback", "0"])  # the admin call needs --token
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("error: ") and "401" in err and "--token" in err
    with pytest.raises(SystemExit) as done:
        main(["adapters", "--url", e.url, "--token", ADMIN, "pin", "0"])
    assert done.value.code == 0 and e.engine.shadow.current_version == 0
    with pytest.raises(SystemExit) as done:
        main(["status", "--url", "http://127.0.0.1:9"])
    assert done.value.code == 2 and "cannot reach the edge" in capsys.readouterr().err
