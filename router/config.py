"""Configuration of `collm-router` (`configs/router.yaml`).

Unknown keys are errors and every mistake is reported on one line that names the field
(see `collm.common.config.load_config`), e.g.

    configs/router.yaml: routing.policy: expected 'slo', 'slo_pack', 'round_robin' or 'least_outstanding', got 'fastest'
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from collm.common.auth import AuthConfig, KeySource
from collm.common.config import ServerTls, Strict
from collm.common.slo import SLO
from collm.router.policy import Assumptions


class EdgeEndpoint(Strict):
    """One `collm-edge` replica the router sends requests to."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="label in metrics and logs; X-CoLLM-Edge if the "
                                                                "edge does not send one")
    url: str = Field(description="base URL of the edge's HTTP API, e.g. http://127.0.0.1:8081")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or len(v.split("://", 1)[1].strip("/")) == 0:
            raise ValueError("expected an http:// or https:// URL such as http://127.0.0.1:8081")
        return v.rstrip("/")


class RouterApiConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8090, ge=0, le=65535)
    shutdown_grace_s: float = Field(30.0, ge=0, description="SIGTERM: let in-flight requests finish")
    keepalive_s: float = Field(65.0, gt=0, description="keep an idle client connection open this long (longer "
                                                       "than clients keep theirs)")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="a request body over this many bytes is "
                                "answered 413 before it is read whole (common/http_guard.py)")
    tls: ServerTls = Field(ServerTls(), description="serve HTTPS to clients with this certificate")
    max_in_flight: int = Field(512, ge=1, description="requests in flight to the edges, all clients together; one "
                               "more is answered 503 at once (code router_busy) instead of waiting for a connection")


class HealthConfig(Strict):
    """How the router learns each edge's state: /health and /metrics, polled."""

    interval_s: float = Field(0.5, gt=0, description="poll every edge's /health and /metrics this often ...")
    max_polls_per_s: float = Field(100.0, gt=0, description="... but all edges together at most this many polls "
                                   "per second (two requests each): a large fleet is polled less often per edge")
    timeout_s: float = Field(2.0, gt=0, description="a poll slower than this counts as a failure (unless the "
                                                    "edge is streaming to the router meanwhile)")
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed polls that take an edge out")
    healthy_after: int = Field(1, ge=1, description="consecutive good polls that put it back")
    stale_after_s: float = Field(5.0, gt=0, description="metrics older than this are ignored (router counts only)")
    cooldown_s: float = Field(1.0, ge=0, description="after a 503 or 429 from an edge, prefer other edges this long")


def check_margins(cfg) -> None:
    """The router's and collm-sim's margins: admission_margin_max left at its default below an
    admission_margin that was set (a config from before the margin adapted) means that fixed margin;
    set below it explicitly, it is a mistake."""
    if cfg.admission_margin_max is None or cfg.admission_margin_max >= cfg.admission_margin:
        return
    if "admission_margin_max" not in cfg.model_fields_set:
        cfg.admission_margin_max = None
        return
    raise ValueError(f"admission_margin_max ({cfg.admission_margin_max:g}) must be at least admission_margin "
                     f"({cfg.admission_margin:g}), the tightest margin; set admission_margin_max: null for a fixed "
                     "margin")


class AdmissionFeedback(Strict):
    """How the admission margin follows the first tokens the router relays (router/admission.py)."""

    period_s: float = Field(1.0, gt=0, le=60, description="the margin is adjusted at most this often (seconds)")
    window_s: float = Field(30.0, gt=0, le=3600, description="over the first tokens of this many seconds")
    min_requests: int = Field(8, ge=1, le=100_000, description="fewer fresh first tokens: no evidence, the margin holds")
    quantile: float = Field(0.9, gt=0, le=1, description="the TTFT / target percentile the slack is measured at")
    slack_low: float = Field(0.1, ge=-1, lt=1, description="slack (1 - that percentile) below this: the margin drops "
                             "to routing.admission_margin at once")
    slack_high: float = Field(0.2, gt=-1, lt=1, description="slack above this: the margin grows by `step`, up to "
                              "routing.admission_margin_max")
    step: float = Field(0.1, gt=0, le=10, description="additive growth of the margin per period")
    cool_s: float = Field(30.0, ge=0, le=3600, description="no growth this long after a drop (seconds)")

    @model_validator(mode="after")
    def _band(self) -> AdmissionFeedback:
        if self.slack_low >= self.slack_high:
            raise ValueError(f"slack_low ({self.slack_low:g}) must be below "
                             f"slack_high ({self.slack_high:g}): between them the margin holds")
        return self


class RoutingConfig(Strict):
    """The routing rule (`collm.router.policy`) and what it assumes about the edges."""

    policy: Literal["slo", "slo_pack", "round_robin", "least_outstanding"] = Field(
        "slo_pack", description="slo: the most SLO slack; slo_pack (the default): slo, gathering a light load on "
        "fewer edges while the first tokens show room (pack_gate), so the others train in idle time: 1.6-2.0x the "
        "training tokens at 0.3-0.5 x C at 0.99-1.00x serve-only's goodput, 1.05x slo's goodput at 0.8 x C in its "
        "same-run A/B, docs/benchmarks.md")
    tie_margin: float = Field(0.05, ge=0, le=1, description="edges within this normalised slack of the best are "
                                                             "near-ties, broken by power of two choices")
    comfort: float = Field(0.5, ge=0, le=1, description="edges whose slack is at least this are all near-ties "
                                                        "(the SLOs are met with room to spare)")
    probe_after_s: float = Field(5.0, gt=0, description="an idle edge left out this long gets the next request "
                                                         "(refreshes a stale cost estimate)")
    pack_slack: float = Field(0.4, ge=0, le=1, description="slo_pack policy: near-ties with at least this much "
                              "slack ...")
    pack_spare: float = Field(0.0, ge=0, le=1, description="... and at least this spare capacity (the fraction of "
                              "their window not spent serving) go to the edge with the most requests, so the others "
                              "train in idle time")
    pack_newest: bool = Field(True, description="slo_pack policy: gather on the edge serving the newest global "
                              "adapter first (then the one with the most requests): after a round, the edge that "
                              "trained evaluates and swaps first, takes the light load, and the other drains and "
                              "evaluates in idle time instead of behind its traffic. Same-run A/B (steady trace, "
                              "docs/benchmarks.md): 1.70x the quality-weighted goodput at 0.3 x C, 0.97x at 0.8 x C "
                              "with 1.01x the goodput, 3 rounds instead of 2")
    pack_free_slot: bool = Field(True, description="slo_pack policy: gather only onto an edge where the request "
                                 "gets a running slot at once, never into the queue behind its full batch while "
                                 "another edge has room (same-run A/B on the unseen bursts, docs/benchmarks.md: "
                                 "1.05x goodput at 1.0 x C, 1.01x at 0.8 x C; false: gather into the queue too)")
    pack_gate: float | None = Field(0.5, ge=-1, lt=1, allow_inf_nan=False, description="slo_pack policy: gather "
                                    "only while the measured TTFT slack of the router's recent first tokens (1 - "
                                    "admission_feedback.quantile of TTFT / target over its window) is at least this; "
                                    "below it spread as slo (a burst shows there within seconds; null: always "
                                    "gather, as a late first token can take the slack below -1)")
    retry_429: bool = Field(True, description="retry a 429 (edge queue full) once on another edge")
    admission: bool = Field(True, description="slo policy: answer 429 when no edge's estimated TTFT meets the "
                            "request's target, unless it asks for best effort")
    admission_margin: float = Field(1.0, ge=1.0, allow_inf_nan=False,
                                    description="refuse only when the soonest estimated TTFT is past this many "
                                                "times the target (the estimate is pessimistic inside bursts); "
                                                "the tightest margin when it adapts")
    admission_margin_max: float | None = Field(
        2.0, ge=1.0, allow_inf_nan=False, description="the loosest margin: above admission_margin, the margin "
        "follows the first tokens the router relays (loosens while they come with room to spare, drops back at "
        "once when they come late; router/admission.py; same-run A/B in docs/benchmarks.md: a tie on the steady "
        "trace at 0.8-1.5 x C, 1.03x goodput under bursts); null or equal: a fixed margin")
    admission_feedback: AdmissionFeedback = AdmissionFeedback()
    drain_rate: Literal["serving", "window"] = Field(
        "serving", description="how the wait estimate reads an edge's finished requests per second: per second "
        "it spent serving (serving), or over its whole window (window, the rule before 2026-12-06: after a calm "
        "stretch it put a burst's wait at 2-2.5x the TTFT that followed)")
    chars_per_token: float = Field(4.0, gt=0, description="prompt size estimate: characters per token")
    typical_output_tokens: int = Field(64, ge=1, description="prior of the output length of running requests "
                                                             "(then a moving average of what the edges returned)")
    step_token_budget: int = Field(256, ge=2, description="engine.step_token_budget assumed until an edge's metrics are read")
    edge_slo_safety: float = Field(0.8, gt=0, le=1, description="slo.safety assumed until an edge's metrics are read")
    default_max_running: int = Field(16, ge=1, description="assumed until an edge's metrics are read")
    default_ttft_ms: float = Field(2000.0, gt=0, description="TTFT target assumed until an edge's metrics are read")
    default_tpot_ms: float = Field(200.0, gt=0, description="TPOT target assumed until an edge's metrics are read")
    seed: int | None = Field(None, description="seed of the tie-breaking sampler (None: random)")

    @model_validator(mode="after")
    def _margins(self) -> RoutingConfig:
        check_margins(self)
        return self

    @property
    def default_slo(self) -> SLO:
        return SLO.from_ms(self.default_ttft_ms, self.default_tpot_ms)

    def assumptions(self, typical_output_tokens: float | None = None) -> Assumptions:
        """The rule's assumptions from these settings, each field by name (the router and collm-sim
        both build them here; a positional call once put probe_after_s into pack_slack)."""
        return Assumptions(
            step_token_budget=self.step_token_budget, slo_safety=self.edge_slo_safety,
            typical_output_tokens=float(self.typical_output_tokens if typical_output_tokens is None
                                        else typical_output_tokens),
            tie_margin=self.tie_margin, comfort=self.comfort, pack_slack=self.pack_slack,
            pack_spare=self.pack_spare, pack_newest=self.pack_newest, pack_free_slot=self.pack_free_slot,
            probe_after_s=self.probe_after_s, drain_per_serving_s=self.drain_rate == "serving")


class ProxyConfig(Strict):
    connect_timeout_s: float = Field(2.0, gt=0, description="give up connecting to an edge after this long")
    read_timeout_s: float = Field(600.0, gt=0, description="longest silence from an edge inside one response")
    max_connections: int = Field(1000, ge=1, description="open connections to all edges together")
    ca_file: str | None = Field(None, description="verify https:// edges with this CA (PEM) instead of the system's "
                                "(collm-certs makes one)")
    pool_timeout_s: float = Field(10.0, gt=0, description="give up waiting for a free connection to an edge after "
                                  "this long (slow-reading clients can hold them all)")
    keepalive_s: float = Field(2.0, ge=0, description="close a connection to an edge idle this long (keep it "
                                                      "below the edges' keep-alive timeout, 5 s)")


class RouterConfig(Strict):
    """Configuration of one `collm-router` process."""

    name: str = Field("router", pattern=r"^[A-Za-z0-9_.-]+$")
    edges: list[EdgeEndpoint] = Field(min_length=1)
    api: RouterApiConfig = RouterApiConfig()
    health: HealthConfig = HealthConfig()
    routing: RoutingConfig = RoutingConfig()
    proxy: ProxyConfig = ProxyConfig()
    auth: AuthConfig = Field(AuthConfig(), description="keys the router's clients must send (collm.common.auth)")
    edge_key: KeySource = Field(KeySource(), description="the API key the router sends to the edges (the first "
                                "one given), when the edges require keys; a client's own key is never forwarded")
    open_proxy: bool = Field(False, description="allow an edge_key with no auth.api_keys: then anyone who reaches the "
                             "router is served on the router's key (refused at start unless set)")
    best_effort_keys: KeySource = Field(KeySource(), description="keys whose requests may skip admission "
                                        "(X-CoLLM-Best-Effort: 1 or best_effort: true); with auth.api_keys set, "
                                        "any other key asking for it gets 403; admin tokens may too")

    @model_validator(mode="after")
    def _unique_edges(self) -> RouterConfig:
        for key in ("name", "url"):
            seen: set[str] = set()
            for e in self.edges:
                v = getattr(e, key)
                if v in seen:
                    raise ValueError(f"edges: two edges have the {key} {v!r}; each edge needs its own")
                seen.add(v)
        return self
