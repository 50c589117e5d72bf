"""The router's view of its edges, kept fresh: each edge polled on its own staggered clock
(`/health` and a `/metrics` scrape, `health.interval_s`, stretched to `health.max_polls_per_s` in all),
the answers written into the edges' `EdgeState` (and so the `FleetTable` the rule reads)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import httpx

from collm.router.config import RouterConfig
from collm.router.metrics import RouterMetrics
from collm.router.state import EdgeState, scrape_from_metrics

log = logging.getLogger("collm.router")


def describe(e: Exception) -> str:
    """An httpx error in one line, led by its class (a timeout's text is often empty)."""
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if text != type(e).__name__ else text


class EdgePoller:
    def __init__(self, cfg: RouterConfig, edges: list[EdgeState], metrics: RouterMetrics, rng: random.Random):
        self.cfg, self.edges, self.metrics, self.rng = cfg, edges, metrics, rng
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self, transport: httpx.AsyncBaseTransport | None, headers: dict | None, verify=True) -> None:
        """Poll every edge once (route from the first request on), then each on its own clock, on a client
        of its own (a poll never waits for a connection the proxied requests hold)."""
        self.client = httpx.AsyncClient(timeout=self.cfg.health.timeout_s, transport=transport, headers=headers,
                                        verify=verify)
        await self.poll_all()
        self._tasks = [asyncio.create_task(self._poll_loop(e), name=f"collm-router-poll-{e.name}")
                       for e in self.edges]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.client is not None:
            await self.client.aclose()

    def poll_interval(self) -> float:
        """Seconds between two polls of one edge: health.interval_s, stretched so that all edges together
        stay within health.max_polls_per_s (1,000 edges at 100 polls/s: each every 10 s)."""
        h = self.cfg.health
        return max(h.interval_s, len(self.edges) / h.max_polls_per_s)

    async def _poll_loop(self, edge: EdgeState) -> None:
        """Each edge on its own clock (staggered), so one that hangs does not delay what we learn about the others."""
        interval = self.poll_interval()
        await asyncio.sleep(self.rng.random() * interval)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.poll(edge)
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad answer
                log.exception("polling edge %s failed", edge.name)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(e) for e in self.edges))

    async def poll(self, edge: EdgeState) -> None:
        """One health check (and metrics scrape) of one edge."""
        h = self.cfg.health
        at, outstanding_at = time.monotonic(), edge.outstanding
        try:
            health, metrics = await asyncio.gather(self.client.get(edge.url + "/health"),
                                                   self.client.get(edge.url + "/metrics"))
        except httpx.TimeoutException as e:
            edge.poll_timed_out(h, describe(e))
            self.metrics.failures.labels(edge.name, "poll_timeout").inc()
            return
        except httpx.HTTPError as e:
            edge.check_failed(h, describe(e))
            self.metrics.failures.labels(edge.name, "poll").inc()
            return
        body: dict = {}
        with contextlib.suppress(ValueError):
            body = health.json()
        status = body.get("status") if isinstance(body, dict) else None
        if health.status_code != 200 or status != "ready":
            edge.check_failed(h, f"/health answered {health.status_code} ({status or 'no status'})")
            return
        if metrics.status_code == 200:
            try:
                edge.scrape = scrape_from_metrics(metrics.text, at, outstanding_at)
            except (KeyError, ValueError) as e:
                log.warning("edge %s: /metrics lacks %s; routing on the router's own counts", edge.name, e)
        edge.poll_ok(h)
