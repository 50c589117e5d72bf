"""The router's own Prometheus metrics: counters and histograms of what it routed, and gauges per edge."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# Prometheus names the router exports
ROUTED = "collm_router_routed_total"
RESPONSES = "collm_router_responses_total"
RETRIES = "collm_router_retries_total"
FAILURES = "collm_router_edge_failures_total"
NO_EDGE = "collm_router_no_healthy_edge_total"
REFUSED = "collm_router_refused_total"
TTFT_ESTIMATED = "collm_router_ttft_estimated_seconds"
TTFT_OBSERVED = "collm_router_ttft_observed_seconds"
EDGE_HEALTHY = "collm_router_edge_healthy"
EDGE_OUTSTANDING = "collm_router_edge_outstanding"
EDGE_SLACK = "collm_router_edge_last_slack"
HEALTHY_EDGES = "collm_router_healthy_edges"
ADMISSION_MARGIN = "collm_router_admission_margin"
TTFT_SLACK = "collm_router_ttft_slack"
GATHERING = "collm_router_gathering"
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, router):
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(ROUTED, "Requests sent to each edge (a retry counts again)", ["edge"], registry=r)
        self.responses = Counter(RESPONSES, "Responses relayed, by edge and outcome", ["edge", "outcome"], registry=r)
        self.retries = Counter(RETRIES, "Requests retried on another edge, by reason", ["reason"], registry=r)
        self.failures = Counter(FAILURES, "Edge failures seen by the router", ["edge", "kind"], registry=r)
        self.no_edge = Counter(NO_EDGE, "Requests answered 503 because no edge was healthy", registry=r)
        self.refused = Counter(REFUSED, "Requests answered 429 because no edge could meet their TTFT target",
                               registry=r)
        self.ttft_est = Histogram(TTFT_ESTIMATED, "TTFT the rule estimated for the chosen edge (s)", ["edge"],
                                  registry=r, buckets=BUCKETS)
        self.ttft_obs = Histogram(TTFT_OBSERVED, "TTFT observed: router to first token event for streams, the "
                                                 "edge's own ttft_s otherwise (s)", ["edge"], registry=r,
                                  buckets=BUCKETS)
        r.register(_EdgeGauges(router))
        for e in router.edges:  # every edge shows up from the start, at zero
            self.routed.labels(e.name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EdgeGauges:
    def __init__(self, router):
        self.router = router

    def collect(self):
        healthy = GaugeMetricFamily(EDGE_HEALTHY, "1 while the edge is routed to", labels=["edge"])
        outstanding = GaugeMetricFamily(EDGE_OUTSTANDING, "Requests in flight from this router", labels=["edge"])
        slack = GaugeMetricFamily(EDGE_SLACK, "Normalised SLO slack estimated at the last pick", labels=["edge"])
        for e in self.router.edges:
            healthy.add_metric([e.name], float(e.healthy))
            outstanding.add_metric([e.name], float(e.outstanding))
            slack.add_metric([e.name], float("nan") if e.last_slack is None else e.last_slack)
        total = GaugeMetricFamily(HEALTHY_EDGES, "Edges being routed to")
        total.add_metric([], float(self.router.healthy_count()))
        margin = GaugeMetricFamily(ADMISSION_MARGIN, "Admission refuses a request whose soonest estimated TTFT is "
                                   "past this many times its target (router/admission.py)")
        margin.add_metric([], float(self.router.admission.margin))
        measured = GaugeMetricFamily(TTFT_SLACK, "1 - the 0.9 quantile of TTFT / target over the recent first tokens "
                                     "relayed (NaN: too few); routing.pack_gate reads it")
        s = self.router.admission.slack
        measured.add_metric([], float("nan") if s is None else float(s))
        gathering = GaugeMetricFamily(GATHERING, "1 while slo_pack gathers a light load (its gate open), else 0")
        gathering.add_metric([], float(self.router.policy_now() == "slo_pack"))
        yield from (healthy, outstanding, slack, total, margin, measured, gathering)
