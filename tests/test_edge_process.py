"""`collm-edge` as an operator runs it: a real process, /health while loading, graceful SIGTERM."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import yaml
from helpers import TINY, free_port

from collm.common.config import deep_merge


def start_edge(tmp_path, **overrides):
    port = free_port()
    cfg = deep_merge(TINY, {"state_dir": str(tmp_path / "state"), "api": {"port": port, "shutdown_grace_s": 20},
                            **overrides})
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "collm.edge_client", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, url, timeout=60):
    seen = set()
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(url + "/health", timeout=2)
            seen.add(r.status_code)
            if r.status_code == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("edge did not become ready")


def test_sigterm_finishes_in_flight_requests_saves_state_and_exits_zero(tmp_path):
    proc, url = start_edge(tmp_path)
    try:
        wait_ready(proc, url)
        result = {}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "go", "max_tokens": 300, "stream": True, "temperature": 0,
                                    "ignore_eos": True}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
                result["events"] = events

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.3)  # the stream is running
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "Traceback" not in out
        events = result["events"]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 300
        assert (tmp_path / "state" / "training" / "adapter_model.safetensors").is_file()
        assert (tmp_path / "state" / "training" / "optimizer.pt").is_file()
    finally:
        proc.kill()


def test_restart_restores_the_serving_adapter(tmp_path):
    """An adapter published before a crash is served again after the restart."""
    from helpers import LiveEdge, random_adapter_state, tiny_config

    cfg = tiny_config(state_dir=str(tmp_path / "state"))
    e = LiveEdge(cfg)
    try:
        e.runtime.publish(random_adapter_state(e.engine, 4), 7, round=7, eval_loss=1.5)
        before = httpx.post(e.url + "/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0,
                                                             "ignore_eos": True}).json()
    finally:
        e.close()
    proc, url = start_edge(tmp_path)  # same state_dir, a new process: nothing shut it down cleanly
    try:
        wait_ready(proc, url)
        ad = httpx.get(url + "/v1/adapters").json()
        assert ad["serving_version"] == 7 and ad["round"] == 7 and ad["eval_loss"] == 1.5
        after = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True}).json()
        assert after["adapter_version"] == 7 and after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_health_is_503_until_loaded(tmp_path):
    from helpers import LiveEdge, tiny_config

    e = LiveEdge(tiny_config(state_dir=str(tmp_path)), load=False)
    try:
        r = httpx.get(e.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(e.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["type"]
        e.runtime.load()
        assert httpx.get(e.url + "/health").json()["status"] == "ready"
        assert httpx.post(e.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        e.close()


def test_port_conflict_is_one_line(tmp_path):
    proc, url = start_edge(tmp_path)
    try:
        wait_ready(proc, url)
        port = int(url.rsplit(":", 1)[1])
        clash = subprocess.run([sys.executable, "-m", "collm.edge_client", "--config", str(tmp_path / "edge.yaml")],
                               capture_output=True, text=True, timeout=60)
        assert clash.returncode == 2
        assert f"api.port: cannot listen on 127.0.0.1:{port}" in clash.stderr and "Traceback" not in clash.stderr
    finally:
        proc.terminate()
        proc.wait(30)
