"""Open-loop load generation and its measures (goodput, SLO attainment, latency percentiles).

Requests are sent at their scheduled times whether or not earlier ones have finished (open
loop: a slow server does not slow the arrivals down). Each request streams, so the client
itself measures time to first token (`common.sse.is_first_token`) and time per output token:

    TTFT = t(first token chunk) - t(send)        TPOT = (E2E - TTFT) / (output tokens - 1)

A request meets its SLO iff it completed (HTTP 200, finished normally), TTFT <= ttft_slo and
TPOT <= tpot_slo. Goodput = SLO-meeting requests / duration of the arrival window; failed or
rejected requests count as missing the SLO.

`replay` sends a fixed plan (benchmarks); `BackgroundLoad` sends Poisson arrivals from its own
thread until stopped (collm-lab's load during the rounds). Both send each request the same way.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from collm.common import sse

from collm.common.slo import meets_slo, slo_miss
from collm.common.stats import percentile


@dataclass
class Planned:
    at_s: float  # send time, seconds after the start
    body: dict  # OpenAI chat or completion body (stream is forced on)
    path: str = "/v1/chat/completions"
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.2
    tag: str = ""
    stream: bool = True  # False: one JSON answer (a router can retry it on another edge until it is complete)


@dataclass
class Outcome:
    tag: str
    sent_at: float
    status: int | str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    adapter_version: int | None = None
    edge: str | None = None
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.2
    soonest_ttft_s: float | None = None  # the router's TTFT estimate on its soonest edge (slo policy)
    sent_wall: float = 0.0  # time.time() when sent: where the request lies on the edges' timelines

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason in ("stop", "length")

    @property
    def slo_met(self) -> bool:
        return meets_slo(self.completed, self.ttft_s, self.tpot_s, self.ttft_slo_s, self.tpot_slo_s)

    @property
    def miss(self) -> str | None:
        """`common.slo.slo_miss`: failed | ttft | tpot, None if the SLO was met."""
        return slo_miss(self.completed, self.ttft_s, self.tpot_s, self.ttft_slo_s, self.tpot_slo_s)


def poisson_arrivals(rate: float, seed: int = 0) -> Iterator[float]:
    """Arrival times (seconds from 0) of a Poisson process of `rate` per second, without end."""
    rng, t = random.Random(seed), 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def poisson_schedule(rate: float, duration_s: float, make_body: Callable[[int], dict], seed: int = 0,
                     **kw) -> list[Planned]:
    """Arrivals of a Poisson process of `rate` per second over `duration_s`."""
    out = []
    for t in poisson_arrivals(rate, seed):
        if t > duration_s:
            return out
        out.append(Planned(t, make_body(len(out)), **kw))


def _read_headers(out: Outcome, h: httpx.Headers) -> None:
    """What the edge and the router say about a response: edge, adapter version, the router's estimate."""
    out.edge = h.get("X-CoLLM-Edge")
    v = h.get("X-CoLLM-Adapter-Version")
    out.adapter_version = int(v) if v is not None and v.lstrip('-').isdigit() else None
    try:
        out.soonest_ttft_s = float(h["X-CoLLM-Soonest-TTFT"])
    except (KeyError, ValueError):
        out.soonest_ttft_s = None


async def _one(client: httpx.AsyncClient, url: str, p: Planned, t0: float) -> Outcome:
    now = time.perf_counter()
    await asyncio.sleep(max(0.0, t0 + p.at_s - now))
    if not p.stream:
        return await _one_json(client, url, p, t0)
    sent = time.perf_counter()
    out = Outcome(p.tag, sent - t0, "error", ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s,
                  sent_wall=time.time())
    body = {**p.body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + p.path, json=body) as r:
            out.status = r.status_code
            _read_headers(out, r.headers)
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                chunk = sse.data_of(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    out.status = "stream-error"
                    break
                if out.ttft_s is None and sse.is_first_token(chunk):
                    out.ttft_s = time.perf_counter() - sent
                if (reason := sse.finish_reason_of(chunk)) is not None:
                    out.finish_reason = reason
                if (n := sse.completion_tokens(chunk)) is not None:
                    out.output_tokens = n
    except httpx.HTTPError as e:
        out.status = type(e).__name__
        return out
    out.e2e_s = time.perf_counter() - sent
    if out.ttft_s is not None and out.output_tokens > 1:
        out.tpot_s = (out.e2e_s - out.ttft_s) / (out.output_tokens - 1)
    return out


async def _one_json(client: httpx.AsyncClient, url: str, p: Planned, t0: float) -> Outcome:
    """A non-streaming request: E2E measured here, TTFT and TPOT as the edge measured them."""
    sent = time.perf_counter()
    out = Outcome(p.tag, sent - t0, "error", ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s,
                  sent_wall=time.time())
    try:
        r = await client.post(url + p.path, json={**p.body, "stream": False})
    except httpx.HTTPError as e:
        out.status = type(e).__name__
        return out
    out.status, out.e2e_s = r.status_code, time.perf_counter() - sent
    _read_headers(out, r.headers)
    if r.status_code == 200:
        try:
            body = r.json()
            out.finish_reason = body["choices"][0]["finish_reason"]
            out.output_tokens = body["usage"]["completion_tokens"]
            out.ttft_s, out.tpot_s = body["collm"]["ttft_s"], body["collm"]["tpot_s"]
        except (ValueError, KeyError, IndexError, TypeError):
            out.status = "bad-body"
    return out


def _client(timeout_s: float, api_key: str | None = None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, headers=headers)


async def run_open_loop(plan: list[Planned], url: str, timeout_s: float = 300.0) -> list[Outcome]:
    """Send every planned request at its time to `url`; wait for all of them."""
    async with _client(timeout_s) as client:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, url, p, t0) for p in plan)))


def replay(plan: list[Planned], url: str, timeout_s: float = 300.0) -> list[Outcome]:
    return asyncio.run(run_open_loop(plan, url, timeout_s))


class BackgroundLoad:
    """Open-loop Poisson requests at `rate` per second to `url`, from a thread of its own, until `stop()`.

    `make(i)` gives the i-th request (a Planned whose `at_s` is ignored: the arrivals are Poisson);
    `api_key` is sent as a bearer token."""

    def __init__(self, url: str, rate: float, make: Callable[[int], Planned], seed: int = 0,
                 timeout_s: float = 300.0, api_key: str | None = None):
        self.url, self.rate, self.make, self.seed, self.timeout_s = url, rate, make, seed, timeout_s
        self.api_key = api_key
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="collm-load", daemon=True)

    def start(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def stop(self, drain_s: float = 60.0) -> list[Outcome]:
        """Send nothing more; wait up to `drain_s` for the requests in flight; return every outcome."""
        self._stop.set()
        self._thread.join(drain_s)
        return list(self.outcomes)

    async def _run(self) -> None:
        async with _client(self.timeout_s, self.api_key) as client:
            t0 = time.perf_counter()
            tasks = []
            for i, at in enumerate(poisson_arrivals(self.rate, self.seed)):
                while time.perf_counter() - t0 < at:
                    if self._stop.is_set():
                        break
                    await asyncio.sleep(min(0.1, max(0.0, at - (time.perf_counter() - t0))))
                if self._stop.is_set():
                    break
                p = self.make(i)
                p = Planned(at, p.body, p.path, p.ttft_slo_s, p.tpot_slo_s, p.tag, p.stream)
                task = asyncio.create_task(_one(client, self.url, p, t0))
                task.add_done_callback(lambda t: self.outcomes.append(t.result()))
                tasks.append(task)
            if tasks:
                await asyncio.gather(*tasks)


def summarize(outcomes: list[Outcome], window_s: float) -> dict:
    done = [o for o in outcomes if o.completed]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    tpot = [o.tpot_s for o in done if o.tpot_s is not None]
    e2e = [o.e2e_s for o in done if o.e2e_s is not None]
    good = sum(o.slo_met for o in outcomes)
    return {
        "requests": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done),
        "slo_met": good, "slo_attainment": good / len(outcomes) if outcomes else None,
        "goodput_rps": good / window_s if window_s > 0 else None,
        "throughput_rps": len(done) / window_s if window_s > 0 else None,
        **{f"ttft_p{q}": percentile(ttft, q / 100) for q in (50, 90, 99)},
        **{f"tpot_p{q}": percentile(tpot, q / 100) for q in (50, 90, 99)},
        **{f"e2e_p{q}": percentile(e2e, q / 100) for q in (50, 90, 99)},
    }
