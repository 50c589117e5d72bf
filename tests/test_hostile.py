"""A real `collm-edge` process attacked by oversized clients (issue #34's proof): every oversized body is
refused 413 at once, the edge's memory does not grow with what was sent, and /health keeps answering fast
while the attack goes on."""

import socket
import statistics
import sys
import threading
import time

import httpx
import psutil
import pytest

from collm.common.procs import BIN_DIR
from collm.lab.topology import ProcessGroup, edge_config, edge_url, wait_http, write_config

pytestmark = pytest.mark.slow
MB = 1 << 20


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    (out / "logs").mkdir(exist_ok=True)
    group = ProcessGroup(out)
    cfg = edge_config("tiny", "target", out, categories=["open_qa"])
    proc = group.spawn("edge", [str(BIN_DIR / "collm-edge"), "--config", str(write_config(out / "edge.yaml", cfg))])
    url = edge_url(cfg)
    try:
        wait_http(url + "/health", group, 120, "the edge")
        yield url, psutil.Process(proc.pid)
    finally:
        group.stop()


def flood(url: str, declared: int, send: int) -> tuple[int | None, float]:
    """Declare `declared` bytes of body and try to send `send` of them; (status, seconds to the status line)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        t0 = time.perf_counter()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {declared}\r\n\r\n".encode() + b'{"prompt": "')
        sent, block = 0, b"a" * MB
        s.settimeout(0.05)
        first = b""
        while sent < send and not first:
            try:
                s.sendall(block)
                sent += len(block)
            except (BrokenPipeError, ConnectionResetError, TimeoutError, socket.timeout):
                break
            try:
                first = s.recv(64)
            except (TimeoutError, socket.timeout, BlockingIOError):
                pass
        s.settimeout(30)
        try:
            first += s.recv(64) if not first else b""
        except (ConnectionResetError, TimeoutError, socket.timeout):
            pass
        elapsed = time.perf_counter() - t0
    return (int(first.split(b" ")[1]) if first.startswith(b"HTTP/1.1") else None), elapsed


def chunked_flood(url: str, total: int) -> int:
    """A body with no declared length, `total` bytes sent in 64 KiB chunks (the server cuts it off)."""
    def body():
        yield b'{"prompt": "'
        for _ in range(total // (64 * 1024)):
            yield b"a" * (64 * 1024)

    try:
        return httpx.post(url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"},
                          timeout=30).status_code
    except httpx.HTTPError:  # the server answered and closed while we were still sending
        return 413


def test_oversized_bodies_are_refused_at_once_without_growing_the_edge(edge):
    """For 4 s two attackers send 50 MB prompts (declared, and chunked) and 1 MB prompts while /health is
    polled; every attack is refused, the edge stays small and /health fast."""
    url, proc = edge
    httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=60)
    rss0 = proc.memory_info().rss
    latencies: list[float] = []
    declared: list[tuple[int | None, float]] = []
    others: list[tuple[str, int, float]] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.02)

    def attack(k: int):
        while not stop.is_set():
            declared.append(flood(url, 50 * MB, 50 * MB))  # a 50 MB prompt, as the issue measured
            t = time.perf_counter()
            if k == 0:
                others.append(("chunked", chunked_flood(url, 50 * MB), time.perf_counter() - t))
            else:  # the largest body the edge takes, a 1 MB prompt: refused by its length before tokenizing
                r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * (MB - 64) + b'"}',
                               headers={"Content-Type": "application/json"}, timeout=30)
                others.append(("1MB", r.status_code, time.perf_counter() - t))

    threads = [threading.Thread(target=poll, daemon=True)] + [threading.Thread(target=attack, args=(k,), daemon=True)
                                                             for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(30)
    grown = (proc.memory_info().rss - rss0) / MB
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"{len(declared)} declared 50 MB: 413 after p50 {1000 * statistics.median(s for _, s in declared):.1f} ms, "
          f"max {1000 * max(s for _, s in declared):.0f} ms; {len(others)} chunked / 1 MB, max "
          f"{1000 * max(s for *_, s in others):.0f} ms; RSS {grown:+.1f} MB; /health p50 "
          f"{1000 * statistics.median(latencies):.1f} ms, p99 {1000 * p99:.1f} ms over {len(latencies)} polls",
          file=sys.stderr)
    assert len(latencies) >= 50 and len(declared) >= 10 and others
    assert all(status == 413 for status, _ in declared), declared
    assert statistics.median(s for _, s in declared) < 0.1 and max(s for _, s in declared) < 1.0
    assert all(status == (413 if kind == "chunked" else 400) for kind, status, _ in others), others
    assert grown < 100, f"the edge grew {grown:.0f} MB"
    assert p99 < 0.25, f"/health p99 {1000 * p99:.0f} ms while attacked"
    assert httpx.post(url + "/v1/completions", json={"prompt": "still here", "max_tokens": 2},
                      timeout=30).status_code == 200
