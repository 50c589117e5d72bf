"""`collm-lab --tls`: the local lab with TLS and SuperNode authentication on loopback.

Two edges on the tiny model, one round under light load. While the lab runs, a SuperNode with a
key that was never registered tries to join the same SuperLink and must be refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from collm.common.procs import processes_mentioning
from collm.lab.certs import make_certs
from collm.lab.lab import lab_edge_configs
from collm.lab.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EDGES = ["edge0", "edge1"]


def _wait_for(lines: list[str], pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            if m := re.search(pattern, line):
                return m
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"collm-lab never printed {pattern!r}:\n" + "".join(lines)[-4000:])


def test_tls_edge_configs_carry_the_ca_and_each_edge_its_own_key(tmp_path):
    certs = make_certs(tmp_path / "certs", EDGES)
    plain = lab_edge_configs("tiny", 2, "127.0.0.1:9", tmp_path)
    tls = lab_edge_configs("tiny", 2, "127.0.0.1:9", tmp_path, None, certs)
    for cfg in plain:  # the default is unchanged: plain HTTP, no keys
        f = cfg.federation
        assert f.enabled and f.insecure and f.root_certificates is None and f.auth_private_key is None
    for cfg in tls:
        assert cfg.federation.insecure is False
        assert cfg.federation.root_certificates == str(certs["ca"])
        assert cfg.federation.auth_private_key == str(certs[cfg.name])
    assert {c.federation.bootstrap_from for c in plain} == {str(tmp_path / "checkpoints")}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Run the lab; meanwhile start a SuperNode with an unregistered key. Stop everything, always."""
    base = tmp_path_factory.mktemp("lab_tls")
    out = base / "run"
    rogue_key = make_certs(base / "rogue", ["rogue"])["rogue"]  # a valid key nobody registered
    lines: list[str] = []
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "collm-lab"), "--tls", "--model", "tiny", "--edges", "2", "--rounds", "1",
                             "--load", "1", "--no-router", "--round-deadline", "10", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    rogue = None
    result = SimpleNamespace(out=out)
    try:
        superlink = _wait_for(lines, r"\[lab\] SuperLink on (\S+);", proc, 60).group(1)
        for name in EDGES:
            _wait_for(lines, rf"\[lab\] TLS \+ SuperNode auth: {name} registered as node \d+", proc, 120)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the SuperLink's port: no answer
            httpx.get(f"http://{superlink}/health", timeout=5)
        result.https_health = httpx.get(f"https://{superlink}/health", timeout=5,
                                        verify=str(out / "certs" / "ca.crt")).status_code
        rogue_log = base / "rogue.log"
        with rogue_log.open("w") as log:
            rogue = subprocess.Popen(
                [str(BIN / "flower-supernode"), "--root-certificates", str(out / "certs" / "ca.crt"),
                 "--auth-supernode-private-key", str(rogue_key), "--superlink", superlink,
                 "--isolation", "process", "--host", "127.0.0.1", "--port", str(free_port()),
                 "--node-config", 'name="rogue"'],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})  # fmt: skip
            try:
                result.rogue_rc = rogue.wait(90)
            except subprocess.TimeoutExpired:
                result.rogue_rc = None  # still running: it was let in (or hangs), the test says which
        result.rogue_log = rogue_log.read_text(errors="replace")
        result.rc = proc.wait(540)
        result.wall_s = time.monotonic() - t0
    finally:
        if rogue is not None and rogue.poll() is None:
            os.killpg(rogue.pid, signal.SIGKILL)
            rogue.wait(10)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # collm-lab stops its processes on ^C / SIGTERM
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        reader.join(10)
        result.leftovers = processes_mentioning(str(base))
        for pid in result.leftovers:
            os.kill(pid, signal.SIGKILL)
    result.stdout = "".join(lines)
    print(f"collm-lab --tls: exit {getattr(result, 'rc', None)} in {getattr(result, 'wall_s', 0):.0f} s")
    return result


@pytest.mark.slow
def test_registered_edges_complete_a_round_over_tls(lab):
    assert lab.rc == 0, lab.stdout[-4000:]
    assert "finished:completed" in lab.stdout and lab.https_health == 200
    metrics = json.loads((lab.out / "checkpoints" / "round-0001" / "metrics.json").read_text())
    assert set(metrics["eval"]) == set(EDGES)
    assert "Uvicorn running on https://" in (lab.out / "logs" / "superlink.log").read_text()
    report = json.loads((lab.out / "lab.json").read_text())
    assert report["load"]["failed"] == 0
    assert all(view["serving_version"] == 1 for view in report["edges"].values())


@pytest.mark.slow
def test_each_edge_signs_in_as_the_node_its_key_was_registered_as(lab):
    for name in EDGES:
        node_id = re.search(rf"{name} registered as node (\d+)", lab.stdout).group(1)
        log = (lab.out / "logs" / f"{name}.log").read_text()
        assert f"SuperNode ID: {node_id}" in log and "Failed to activate" not in log
        assert (lab.out / "certs" / name).stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_a_supernode_with_an_unregistered_key_is_refused(lab):
    assert lab.rogue_rc not in (None, 0), lab.rogue_log[-3000:]
    assert "Failed to activate SuperNode" in lab.rogue_log


@pytest.mark.slow
def test_every_process_is_stopped(lab):
    assert lab.leftovers == [], "processes left running"
