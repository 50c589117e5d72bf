"""What the router knows about each edge: health, the last scrape of its /metrics, its own counts.

The router polls every edge's `/health` and `/metrics` (names in `collm.common.metric_names`) and
mirrors each scrape into the router's `fleet.FleetTable`, whose columns the routing rule reads;
`EdgeState.view()` gives one edge as the plain `EdgeView` of `policy.py`'s readable rule (tests, the
decisions benchmark).

Health: an edge starts out (unknown), comes in after `healthy_after` good polls in a row, and
goes out after `unhealthy_after` failed polls in a row, or at once when a request cannot connect
to it. A poll that times out while the edge is still streaming tokens to this router does not
count: the edge is slow (overloaded), not gone, and taking it out would turn slow answers into
503s. A 503 or 429 answer to a request puts it on a short cooldown (other edges are preferred).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families

from collm.common import metric_names as M

from collm.router.config import EdgeEndpoint, HealthConfig, RoutingConfig
from collm.router.policy import LOAD_FIELDS, EdgeView

log = logging.getLogger("collm.router")


@dataclass(frozen=True)
class Scrape:
    """The gauges of one edge /metrics response that routing uses: `policy.EdgeView`'s fields by the same
    names (the rule's columns are filled from either through `policy.COLUMN_FIELDS`)."""

    at: float  # monotonic time the scrape was sent
    outstanding_at: int  # router requests in flight to the edge when it was sent
    queue_depth: float
    running: float
    max_running: float
    step_coef: tuple[float, float, float, float]
    ttft_target_s: float
    tpot_target_s: float
    training_active: bool
    training_busy: float
    spare_capacity: float
    finish_rate: float
    step_token_budget: float | None  # None: an edge that does not export it (config default)
    slo_safety: float | None
    training_share: float = 0.0  # all training over the window, idle time included (a tie-break)
    adapter_version: float | None = None  # the global version it serves (routing.pack_newest); NaN: not exported


def parse_prometheus(text: str) -> dict[str, float]:
    """`name` -> value for unlabelled samples and `name{k="v"}` -> value for labelled ones, read
    with prometheus_client's own text parser (ValueError: not Prometheus text)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def scrape_from_metrics(text: str, at: float, outstanding_at: int) -> Scrape:
    """Read the gauges routing needs; KeyError names a missing one (an edge of another version) or one
    that is not a finite number (a broken or hostile edge: one +Inf step cost would make every estimate NaN)."""
    s = parse_prometheus(text)

    def num(name: str, default: float | None = None) -> float:
        v = s.get(name)
        if v is None or not math.isfinite(v):
            if default is None:
                raise KeyError(name)
            return default
        return v

    coef = tuple(num(f'{M.STEP_COST}{{term="{t}"}}') for t in M.STEP_COST_TERMS)
    return Scrape(
        at=at, outstanding_at=outstanding_at, queue_depth=num(M.QUEUE_DEPTH), running=num(M.RUNNING),
        max_running=num(M.MAX_RUNNING), step_coef=coef,  # type: ignore[arg-type]
        ttft_target_s=num(M.SLO_TTFT), tpot_target_s=num(M.SLO_TPOT),
        training_active=num(M.TRAINING_ACTIVE, 0.0) > 0,
        # b of the stretch g: training that shares time with serving. Idle-time training (all of it
        # under the default rule) does not slow the requests; older edges export only the total.
        training_busy=num(M.TRAINING_BESIDE_SERVING, 0.0) if M.TRAINING_BESIDE_SERVING in s
        else num(M.TRAINING_BUSY, 0.0),
        spare_capacity=num(M.SPARE_CAPACITY, 1.0), finish_rate=num(M.REQUEST_RATE, 0.0),
        step_token_budget=s.get(M.STEP_TOKEN_BUDGET), slo_safety=s.get(M.SLO_SAFETY),
        training_share=num(M.TRAINING_BUSY, 0.0), adapter_version=num(M.ADAPTER_VERSION, math.nan))


MIRRORED = ("healthy", "cooldown_until", "outstanding", "last_sent", "scrape")


@dataclass
class EdgeState:
    """One edge as the router sees it. Fields the routing decision reads (`MIRRORED`) are written
    through to the router's `FleetTable` as they change, so a decision reads arrays instead of
    walking every edge object (`fleet.FleetTable.attach`)."""

    endpoint: EdgeEndpoint
    healthy: bool = False
    good_polls: int = 0
    bad_polls: int = 0
    last_error: str | None = None
    cooldown_until: float = 0.0
    outstanding: int = 0
    scrape: Scrape | None = None
    last_slack: float | None = None
    last_sent: float = field(default_factory=time.monotonic)
    last_progress: float = 0.0  # monotonic time the edge last sent this router response bytes
    mirror: Callable[[str, object], None] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in MIRRORED and (mirror := self.__dict__.get("mirror")) is not None:
            mirror(name, value)

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def url(self) -> str:
        return self.endpoint.url

    def cooling(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) < self.cooldown_until

    # ---------------------------------------------------------------- health transitions
    def poll_ok(self, cfg: HealthConfig) -> None:
        self.good_polls += 1
        self.bad_polls = 0
        if not self.healthy and self.good_polls >= cfg.healthy_after:
            self.healthy = True
            self.last_error = None
            log.info("edge %s (%s) is healthy: routing to it", self.name, self.url)

    def poll_timed_out(self, cfg: HealthConfig, why: str) -> None:
        if time.monotonic() - self.last_progress < cfg.timeout_s + cfg.interval_s:
            log.info("edge %s: health check timed out but it is streaming to us: slow, not down", self.name)
            return
        self.check_failed(cfg, why)

    def check_failed(self, cfg: HealthConfig, why: str) -> None:
        self.good_polls = 0
        self.bad_polls += 1
        self.last_error = why
        if self.healthy and self.bad_polls >= cfg.unhealthy_after:
            self.healthy = False
            log.warning("edge %s (%s) failed %d checks in a row (%s): taken out", self.name, self.url,
                        self.bad_polls, why)

    def connect_failed(self, why: str) -> None:
        """A request could not reach the edge: out at once, until a health check says otherwise."""
        self.good_polls = 0
        self.last_error = why
        if self.healthy:
            self.healthy = False
            log.warning("edge %s (%s) refused a request (%s): taken out until its health check passes",
                        self.name, self.url, why)

    def cool_down(self, seconds: float, why: str) -> None:
        self.cooldown_until = max(self.cooldown_until, time.monotonic() + seconds)
        self.last_error = why

    # ---------------------------------------------------------------- the rule's input
    def view(self, routing: RoutingConfig, stale_after_s: float, now: float | None = None) -> EdgeView:
        now = now if now is not None else time.monotonic()
        s = self.scrape
        unused = now - self.last_sent
        if s is None:
            return EdgeView(self.name, self.outstanding, max_running=routing.default_max_running,
                            ttft_target_s=routing.default_slo.ttft_s, tpot_target_s=routing.default_slo.tpot_s,
                            unused_s=unused)
        fresh = now - s.at <= stale_after_s  # an old scrape: keep what it says about the edge, not its load
        said = {f.name: getattr(s, f.name) for f in fields(s) if f.name != "at" and (fresh or f.name not in LOAD_FIELDS)}
        return EdgeView(self.name, self.outstanding, unused_s=unused, **said)

    def describe(self) -> dict:
        s = self.scrape
        return {"name": self.name, "url": self.url, "healthy": self.healthy, "cooling": self.cooling(),
                "outstanding": self.outstanding, "last_error": self.last_error,
                "queue_depth": s.queue_depth if s else None, "running": s.running if s else None,
                "training_active": s.training_active if s else None,
                "metrics_age_s": round(time.monotonic() - s.at, 2) if s else None,
                "last_slack": self.last_slack}
