"""HTTPS on the edge's and the router's APIs (issue #34: keys travelled in clear text): real processes, a CA
from collm-certs, a client that verifies the router and a router that verifies the edge."""

import ssl

import httpx
import pytest
import yaml

from collm.common.procs import BIN_DIR
from collm.lab.certs import make_certs
from collm.lab.topology import ProcessGroup, edge_config, free_port, wait_http, write_config

pytestmark = pytest.mark.slow
CLIENT, EDGE = "k-client", "k-edge"


def test_router_and_edge_speak_https_and_verify_each_other(tmp_path):
    (tmp_path / "logs").mkdir()
    certs = make_certs(tmp_path / "certs", edges=[])
    tls = {"certfile": str(certs["superlink_cert"]), "keyfile": str(certs["superlink_key"])}  # names 127.0.0.1
    cfg = edge_config("tiny", "secure", tmp_path, categories=["open_qa"],
                      overrides={"api": {"tls": tls}, "auth": {"api_keys": {"keys": [EDGE]}}})
    edge = f"https://127.0.0.1:{cfg.api.port}"
    port = free_port()
    (tmp_path / "router.yaml").write_text(yaml.safe_dump({
        "edges": [{"name": "secure", "url": edge}], "api": {"port": port, "tls": tls},
        "proxy": {"ca_file": str(certs["ca"])}, "auth": {"api_keys": {"keys": [CLIENT]}},
        "edge_key": {"keys": [EDGE]}, "health": {"interval_s": 0.2}}))
    group = ProcessGroup(tmp_path)
    try:
        group.spawn("edge", [str(BIN_DIR / "collm-edge"), "--config", str(write_config(tmp_path / "e.yaml", cfg))])
        wait_http(edge + "/health", group, 120, "the edge over https", ca=certs["ca"])
        group.spawn("router", [str(BIN_DIR / "collm-router"), "--config", str(tmp_path / "router.yaml")])
        router = f"https://127.0.0.1:{port}"
        wait_http(router + "/health", group, 60, "the router over https", ca=certs["ca"])
        ca = ssl.create_default_context(cafile=str(certs["ca"]))
        r = httpx.post(router + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, verify=ca, timeout=60,
                       headers={"Authorization": f"Bearer {CLIENT}"})
        assert r.status_code == 200 and r.headers["x-collm-edge"] == "secure", r.text
        with pytest.raises(httpx.ConnectError):  # a certificate from a CA the client does not trust
            httpx.get(router + "/health", timeout=10)
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port: no answer in clear text
            httpx.get(f"http://127.0.0.1:{cfg.api.port}/health", timeout=10)
    finally:
        group.stop()
