"""The co-execution controller: how much of serving's slack training may take, from measured latencies.

`SlackController` sets f, the training seconds per wall-clock second the co-execution rule's bucket
accrues while only decodes run (`co_schedule.SlackFeedback`; the rule and where f enters it are in
co_schedule's docstring). Every `period_s` it takes the `quantile` of the TTFT and TPOT of the last
finished requests and of the requests in flight (by their latencies so far), each as a fraction of
its own target: slack s = 1 - the larger of the two. AIMD with a dead band (PARTIES' and Heracles'
shape; shared/research/slo-feedback.md):

* load gate first: serving busier than `rho_max` over the rule's window sets f to 0 until it falls
  below `rho_resume` (near saturation any work beside serving queues requests);
* a miss (s < 0), a request waiting longer than `queue_cut` of its TTFT target, or a request shed
  as late halves f, empties the bucket and holds growth for `cool_s`;
* s below `slack_low` steps f down by `step`; above `slack_high` steps it up, but only while the
  bucket is what refuses units (no wind-up while the guards or serving bind);
* fewer than `min_requests` fresh requests: no evidence; f holds, and after `stale_s` falls to 0
  (the idle rule), never to training flat out.

Pure and clock-free: the engine and the simulator feed it the same things through the replica core
(finished requests as `RequestOutcome`s, the replica's `ServingLoad` and its busy fraction) and read f.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from collm.common.stats import percentile
from collm.edge_client.config import FeedbackConfig

if TYPE_CHECKING:
    from collm.edge_client.engine.co_schedule import ServingLoad

SHED_RATIO = 2.0  # a request shed as late counts as a TTFT of twice its target (a miss)


@dataclass(frozen=True)
class RequestOutcome:
    """What the controller learns from a request that ended: its latencies against its own targets.
    `shed`: refused as late before its first token (a TTFT miss that never ran)."""

    ttft_s: float | None
    tpot_s: float | None
    ttft_slo: float
    tpot_slo: float
    shed: bool = False


class SlackController:
    """f, training's share of busy time, from measured latency slack: AIMD with a dead band.

    Pure and clock-free: the engine and the simulator feed it the same things (finished requests
    through `observe`, the replica's `ServingLoad` through `update`) and read `f`."""

    def __init__(self, params: FeedbackConfig | None = None):
        self.p = params or FeedbackConfig()
        self.f = 0.0
        self.slack: float | None = None  # the last measured slack (None: no evidence)
        self.action = "start"            # what the last period did: up | down | hold | cut | stale | ...
        self._ended: deque[tuple[float, float, float | None]] = deque(maxlen=self.p.window_requests)
        self._tick_at: float | None = None
        self._hold_until = -math.inf
        self._fresh_at: float | None = None
        self._cut_pending = False
        self._loaded = False  # the load gate is closed (serving was busier than rho_max)
        self._refused = self._bucket_refused = 0

    def observe(self, end: float, o: RequestOutcome) -> None:
        if o.shed:
            self._ended.append((end, SHED_RATIO, None))
            self._cut_pending = True  # a request shed as late: serving is short of time now
            return
        if o.ttft_s is None:
            return  # cancelled or failed: says nothing about latency
        tpot = o.tpot_s / o.tpot_slo if o.tpot_s else None  # a one-token answer has no TPOT
        self._ended.append((end, o.ttft_s / o.ttft_slo, tpot))

    def note_refusal(self, reason: str) -> None:
        """A unit refused while only decodes ran, and which constraint refused it."""
        self._refused += 1
        self._bucket_refused += reason == "bucket"

    def ratios(self, load: ServingLoad) -> list[tuple[float, float | None]]:
        """(TTFT / target, TPOT / target) of the fresh finished requests and the ones in flight (their
        latencies so far: a request still before its first token by its wait, a decoding one by the
        time since its first token per token out); TPOT None where there is none yet (before the first
        token, a one-token answer, a shed request): a queue must not dilute the TPOT percentile."""
        now = load.now
        out = [(a, b) for t, a, b in self._ended if now - t <= self.p.window_s]
        for r in load.requests:
            if r.first_token_at is None:
                out.append(((now - r.arrival) / r.ttft_slo, None))
            else:
                out.append(((r.first_token_at - r.arrival) / r.ttft_slo,
                            (now - r.first_token_at) / max(r.tokens_out, 1) / r.tpot_slo))
        return out

    def update(self, load: ServingLoad, rho: float = 0.0) -> bool:
        """Adjust f if a period has passed (`rho`: serving's busy fraction over the last window); True if
        it was cut (the caller empties its bucket)."""
        p, now = self.p, load.now
        if self._tick_at is None:
            self._tick_at = self._fresh_at = now
            return False
        if now - self._tick_at < p.period_s:
            return False
        self._tick_at = now
        binds = self._refused > 0 and self._bucket_refused * 2 > self._refused
        self._refused = self._bucket_refused = 0
        if rho > p.rho_max or (self._loaded and rho >= p.rho_resume):
            self._loaded = True
            self.f, self.action = 0.0, "load-gate"
            return True
        self._loaded = False
        fresh = sum(1 for t, _, _ in self._ended if now - t <= p.window_s)
        waited = any(r.first_token_at is None and now - r.arrival > p.queue_cut * r.ttft_slo for r in load.requests)
        if self._cut_pending or waited:
            self._cut_pending = False
            return self._cut(now, "cut-shed" if not waited else "cut-wait")
        if fresh < p.min_requests:
            self.slack = None
            if now - self._fresh_at > p.stale_s:
                self.f, self.action = 0.0, "stale"
            else:
                self.action = "no-evidence"
            return False
        self._fresh_at = now
        ratios = self.ratios(load)
        tpots = [b for _, b in ratios if b is not None]
        worst = max(percentile([a for a, _ in ratios], p.quantile), percentile(tpots, p.quantile) if tpots else 0.0)
        self.slack = s = 1.0 - worst
        if s < 0:
            return self._cut(now, "cut-miss")
        if s < p.slack_low:
            self.f, self.action = max(0.0, self.f - p.step), "down"
        elif s > p.slack_high and now >= self._hold_until and binds:
            self.f, self.action = min(p.f_max, self.f + p.step), "up"
        else:
            self.action = "hold"
        return False

    def _cut(self, now: float, why: str) -> bool:
        self.f *= self.p.backoff
        self._hold_until = now + self.p.cool_s
        self.action = why
        return True
