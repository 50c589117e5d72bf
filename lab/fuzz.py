"""Fuzz the HTTP API of collm-edge or collm-router: seeded, reproducible, hostile but well-formed HTTP.

    python -m collm.lab.fuzz --url http://127.0.0.1:8080 --calls 1000 --seed 0
    python -m collm.lab.fuzz --self --calls 1000        # starts a tiny edge and a router in front of it

Each call is one request built from a grammar of what clients send and what they get wrong: valid
bodies with one field broken (wrong types, huge or non-finite numbers, negative or empty values,
lone surrogates, deep nesting, unknown fields, stop lists, SLO overrides, content parts), raw
bytes that are not JSON or not UTF-8, wrong methods, paths and content types. A server passes
when it answers every call with a status below 500 within the timeout (a 503 saying the edge is
loading or shutting down is the only 5xx allowed) and still serves a plain request at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

VALID_COMPLETION = {"prompt": "Say hi.", "max_tokens": 4, "temperature": 0.0}
VALID_CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
ODD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, -0.0,
              "", "x", "\ud800", "a" * 5000, "é🙂", [], [1], ["a", "b"], {}, {"a": 1}, [[[]]], "1e400"]
RAW_BODIES = [b"", b"{", b"null", b"[]", b"42", b'"str"', b"\xff\xfe\x00", b'{"prompt": "\xff"}',
              b'{"prompt": "hi", "max_tokens": 1e400}', b'{"prompt": "hi", "max_tokens": 1' + b"0" * 310 + b"}",
              b'{"prompt": "hi", "slo": {"ttft_ms": 1' + b"0" * 310 + b"}}", b'{"prompt": "hi", "temperature": NaN}',
              b'{"prompt": "hi", "slo": {"ttft_ms": Infinity}}', b'{"prompt": "x"}' * 3]
PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/adapters",
         "/admin/train", "/admin/adapters", "/v1/nope", "/../etc/passwd", "/v1/completions/extra", "/%00"]


@dataclass
class Report:
    calls: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list = field(default_factory=list)  # (case, status, body)
    hangs: list = field(default_factory=list)  # cases that timed out
    transport_errors: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.server_errors and not self.hangs and not self.transport_errors

    def line(self) -> str:
        by_class = Counter(f"{s // 100}xx" if isinstance(s, int) else s for s in self.statuses.elements())
        return (f"{self.calls} calls: " + ", ".join(f"{k} {v}" for k, v in sorted(by_class.items()))
                + f"; 5xx {len(self.server_errors)}, hung {len(self.hangs)}, connection errors "
                  f"{len(self.transport_errors)}")


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def case(rng: random.Random) -> tuple[str, str, dict, bytes]:
    """One fuzz case: (method, path, headers, body)."""
    kind = rng.random()
    headers = {"content-type": "application/json"}
    if kind < 0.08:
        return rng.choice(["GET", "PUT", "DELETE", "POST"]), rng.choice(PATHS), headers, b""
    if kind < 0.18:
        body = rng.choice(RAW_BODIES)
        if rng.random() < 0.2:
            headers = {"content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])}
        return "POST", rng.choice(PATHS[:2]), headers, body
    if kind < 0.22:
        return "POST", rng.choice(PATHS[:2]), headers, _deep(rng.choice([100, 2000, 100_000])).encode()
    chat = rng.random() < 0.5
    body = json.loads(json.dumps(VALID_CHAT if chat else VALID_COMPLETION))
    for _ in range(rng.randint(1, 3)):
        _mutate(rng, body, chat)
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5, allow_nan=True)
    return "POST", "/v1/chat/completions" if chat else "/v1/completions", headers, raw.encode("utf-8", "surrogatepass")


def _mutate(rng: random.Random, body: dict, chat: bool) -> None:
    fields = ["model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n", "logprobs",
              "presence_penalty", "ignore_eos", "slo", "user", "stream_options", "max_completion_tokens", "extra"]
    fields.append("messages" if chat else "prompt")
    f = rng.choice(fields)
    r = rng.random()
    if f == "slo":
        body["slo"] = {rng.choice(["ttft_ms", "tpot_ms", "bogus"]): rng.choice(ODD_VALUES)} if r < 0.8 \
            else rng.choice(ODD_VALUES)
    elif f == "messages":
        if r < 0.3:
            body["messages"] = rng.choice(ODD_VALUES)
        elif r < 0.6:
            body["messages"] = [{"role": rng.choice(["user", "system", "robot", 5, None]),
                                 "content": rng.choice(ODD_VALUES)}]
        else:
            part = {"type": rng.choice(["text", "image_url", 3]), "text": rng.choice(ODD_VALUES)}
            body["messages"] = [{"role": "user", "content": [part] * rng.randint(0, 3)}]
    elif f == "stop":
        body["stop"] = rng.choice(ODD_VALUES + [["a"] * 5, ["", "x"], ["\ud800"]])
    elif f == "stream":
        body["stream"] = rng.choice([True, False, "yes", 1, None])
        body["max_tokens"] = 3
    else:
        body[f] = rng.choice(ODD_VALUES)


def run(url: str, calls: int, seed: int = 0, timeout_s: float = 60.0, progress: bool = False) -> Report:
    """Send `calls` fuzz cases to `url`, one at a time, and report what came back."""
    rng = random.Random(seed)
    rep = Report()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        for i in range(calls):
            method, path, headers, body = case(rng)
            rep.calls += 1
            try:
                r = client.request(method, url + path, headers=headers, content=body)
                status = r.status_code
                if status >= 500 and not (status == 503 and _benign_503(r)):
                    rep.server_errors.append(((method, path, body[:200]), status, r.text[:300]))
            except httpx.TimeoutException:
                rep.hangs.append((method, path, body[:200]))
                status = "timeout"
            except httpx.HTTPError as e:
                rep.transport_errors.append(((method, path, body[:200]), f"{type(e).__name__}: {e}"))
                status = type(e).__name__
            rep.statuses[status] += 1
            if progress and (i + 1) % 100 == 0:
                print(f"  {i + 1}/{calls}: {rep.line()}", flush=True)
    return rep


def _benign_503(r: httpx.Response) -> bool:
    """A 503 is the server saying it cannot serve right now (loading, stopping), not a crash."""
    try:
        return "loading" in r.text or "shutting down" in r.text or "no healthy edge" in r.text
    except Exception:  # noqa: BLE001
        return False


def still_serves(url: str) -> bool:
    r = httpx.post(url + "/v1/completions", json=VALID_COMPLETION, timeout=60)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collm.lab.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the edge or router to fuzz")
    p.add_argument("--self", action="store_true", help="start a tiny collm-edge and a collm-router, fuzz both")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    targets = {}
    stack = None
    if args.self:
        stack = SelfTopology().start()
        targets = {"edge": stack.edge_url, "router": stack.router_url}
    elif args.url:
        targets = {"target": args.url}
    else:
        p.error("give --url or --self")
    ok = True
    try:
        for name, url in targets.items():
            t0 = time.time()
            print(f"fuzzing {name} at {url}: {args.calls} calls, seed {args.seed}", flush=True)
            rep = run(url, args.calls, args.seed, progress=True)
            served = still_serves(url)
            print(f"{name}: {rep.line()}; still serves: {served} ({time.time() - t0:.0f} s)", flush=True)
            for case_, status, text in rep.server_errors[:10]:
                print(f"  {status}: {case_} -> {text}")
            for h in rep.hangs[:10]:
                print(f"  hung: {h}")
            ok = ok and rep.ok and served
    finally:
        if stack is not None:
            stack.stop()
    return 0 if ok else 1


class SelfTopology:
    """A tiny collm-edge and a collm-router in front of it, as processes, for `--self`."""

    def start(self) -> SelfTopology:
        import tempfile
        from pathlib import Path

        from collm.common.procs import BIN_DIR
        from collm.lab.topology import ProcessGroup, edge_config, edge_url, start_router, wait_http, write_config

        self.out = Path(tempfile.mkdtemp(prefix="collm-fuzz-"))
        self.group = ProcessGroup(self.out)
        cfg = edge_config("tiny", "fuzz-edge", self.out, categories=["open_qa"],
                          overrides={"api": {"admin": True, "admin_without_token": True}})
        self.group.spawn("edge", [str(BIN_DIR / "collm-edge"), "--config", str(write_config(self.out / "edge.yaml",
                                                                                           cfg))])
        self.edge_url = edge_url(cfg)
        wait_http(self.edge_url + "/health", self.group, 120, "the fuzzed edge")
        self.router_url = start_router(self.group, self.out, {"fuzz-edge": self.edge_url}, what="the fuzzed router")
        return self

    def stop(self) -> None:
        self.group.stop()


if __name__ == "__main__":
    sys.exit(main())
