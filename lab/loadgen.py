"""Open-loop load generation and its measures (goodput, SLO attainment, latency percentiles).

Requests are sent at their scheduled times whether or not earlier ones have finished (open
loop: a slow server does not slow the arrivals down). Each request streams, so the client
itself measures time to first token (first content chunk) and time per output token:

    TTFT = t(first content chunk) - t(send)        TPOT = (E2E - TTFT) / (output tokens - 1)

A request meets its SLO iff it completed (HTTP 200, finished normally), TTFT <= ttft_slo and
TPOT <= tpot_slo. Goodput = SLO-meeting requests / duration of the arrival window; failed or
rejected requests count as missing the SLO.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from collm.common.slo import meets_slo
from collm.common.stats import percentile


@dataclass
class Planned:
    at_s: float  # send time, seconds after the start
    body: dict  # OpenAI chat or completion body (stream is forced on)
    path: str = "/v1/chat/completions"
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.2
    tag: str = ""


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
    extra: dict = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason in ("stop", "length")

    @property
    def slo_met(self) -> bool:
        return meets_slo(self.completed, self.ttft_s, self.tpot_s, self.ttft_slo_s, self.tpot_slo_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "slo_met": self.slo_met}


def poisson_schedule(rate: float, duration_s: float, make_body: Callable[[int], dict], seed: int = 0,
                     **kw) -> list[Planned]:
    """Arrivals of a Poisson process of `rate` per second over `duration_s`."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return out
        out.append(Planned(t, make_body(len(out)), **kw))


async def _one(client: httpx.AsyncClient, url: str, p: Planned, t0: float) -> Outcome:
    now = time.perf_counter()
    await asyncio.sleep(max(0.0, t0 + p.at_s - now))
    sent = time.perf_counter()
    out = Outcome(p.tag, sent - t0, "error", ttft_slo_s=p.ttft_slo_s, tpot_slo_s=p.tpot_slo_s)
    body = {**p.body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + p.path, json=body) as r:
            out.status = r.status_code
            out.edge = r.headers.get("X-CoLLM-Edge")
            v = r.headers.get("X-CoLLM-Adapter-Version")
            out.adapter_version = int(v) if v is not None else None
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.status = "stream-error"
                    break
                choice = (chunk.get("choices") or [{}])[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - sent
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        out.status = type(e).__name__
        return out
    out.e2e_s = time.perf_counter() - sent
    if out.ttft_s is None and out.finish_reason:  # finished without any text (e.g. immediate EOS)
        out.ttft_s = out.e2e_s
    if out.ttft_s is not None and out.output_tokens > 1:
        out.tpot_s = (out.e2e_s - out.ttft_s) / (out.output_tokens - 1)
    return out


async def run_open_loop(plan: list[Planned], url: str | Callable[[int], str], timeout_s: float = 300.0) -> list[Outcome]:
    """Send every planned request at its time to `url` (or `url(i)`); wait for all of them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, url(i) if callable(url) else url, p, t0))
                 for i, p in enumerate(plan)]
        return list(await asyncio.gather(*tasks))


def replay(plan: list[Planned], url: str | Callable[[int], str], timeout_s: float = 300.0) -> list[Outcome]:
    return asyncio.run(run_open_loop(plan, url, timeout_s))


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
