"""Prometheus metrics of one edge: per-request histograms, and gauges from the engine's snapshot.

Every gauge is a field of `EdgeSnapshot`, read at scrape time. Names are shared with the router
(which scrapes them to route) through `collm.common.metric_names`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from collm.common import metric_names as M

from collm.edge_client.engine.telemetry import RequestRecord
from collm.edge_client.model.lora import BASE, LOCAL_VERSION

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 60.0)


class EdgeMetrics:
    """One registry per edge process (tests run several edges in one process)."""

    def __init__(self, engine, edge_name: str):
        self.engine = engine
        self.registry = CollectorRegistry()
        self.ttft = Histogram(M.TTFT, "Time to first token (s)", registry=self.registry, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram(M.TPOT, "Time per output token after the first (s)", registry=self.registry,
                              buckets=LATENCY_BUCKETS)
        self.e2e = Histogram(M.E2E, "End-to-end request latency (s)", registry=self.registry,
                             buckets=LATENCY_BUCKETS)
        self.finished = Counter(M.REQUESTS, "Finished requests", ["finish_reason"], registry=self.registry)
        self.slo_met = Counter(M.REQUESTS_SLO_MET, "Completed requests that met every SLO", registry=self.registry)
        # per served version, so a dashboard can tell how each round's adapter (or the base) performs
        self.v_finished = Counter(M.VERSION_REQUESTS, "Finished requests by adapter version", ["version", "finish_reason"],
                                  registry=self.registry)
        self.v_slo_met = Counter(M.VERSION_SLO_MET, "Completed requests that met every SLO, by adapter version",
                                 ["version"], registry=self.registry)
        self.v_ttft = Histogram(M.VERSION_TTFT, "Time to first token by adapter version (s)", ["version"],
                                registry=self.registry, buckets=LATENCY_BUCKETS)
        self.v_tpot = Histogram(M.VERSION_TPOT, "Time per output token by adapter version (s)", ["version"],
                                registry=self.registry, buckets=LATENCY_BUCKETS)
        self._series: set[tuple[str, str]] = set()  # (version, finish_reason) label sets in use
        self._pruned_at = -1  # the latest published version when the series were last pruned
        self.registry.register(_SnapshotCollector(engine, edge_name))
        engine.telemetry.listeners.append(self.observe)

    def observe(self, rec: RequestRecord) -> None:
        self.finished.labels(rec.finish_reason).inc()
        version = {BASE.version: "base", LOCAL_VERSION: "local"}.get(rec.adapter_version, str(rec.adapter_version))
        if rec.adapter_version != -1:  # -1: never admitted, so no version served it
            self._prune()
            self._series.add((version, rec.finish_reason))
            self.v_finished.labels(version, rec.finish_reason).inc()
        if not rec.completed:
            return
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
            self.v_ttft.labels(version).observe(rec.ttft_s)
        if rec.tpot_s:
            self.tpot.observe(rec.tpot_s)
            self.v_tpot.labels(version).observe(rec.tpot_s)
        self.e2e.observe(rec.e2e_s)
        if rec.slo_met:
            self.slo_met.inc()
            self.v_slo_met.labels(version).inc()

    def _prune(self) -> None:
        """Drop the per-version series of versions no longer retained: one series per round would
        grow the scrape (the router reads it twice a second) without bound."""
        latest = self.engine.shadow.latest_version
        if latest == self._pruned_at:  # retention changes only when a version is published
            return
        self._pruned_at = latest
        live = {str(v) for v in self.engine.shadow.retained_versions()} | {"base", "local"}
        stale = {s for s in self._series if s[0] not in live}
        for version, reason in stale:
            self.v_finished.remove(version, reason)
            self._series.discard((version, reason))
        for version in {v for v, _ in stale}:
            for family in (self.v_slo_met, self.v_ttft, self.v_tpot):
                try:
                    family.remove(version)
                except KeyError:  # this version never completed a request
                    pass

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges computed from the engine snapshot when Prometheus scrapes."""

    def __init__(self, engine, edge_name: str):
        self.engine = engine
        self.edge = edge_name

    def collect(self):
        s = self.engine.snapshot()
        w = s.window
        gauges = {
            M.SLO_ATTAINMENT: ("SLO attainment of completed requests over the window", w.slo_attainment),
            M.GOODPUT: ("Completed requests per second that met every SLO (window)", w.goodput),
            M.REQUEST_RATE: ("Finished requests per second (window)", w.request_rate),
            M.QUEUE_DEPTH: ("Requests waiting for admission", s.waiting),
            M.RUNNING: ("Requests being served", s.running),
            M.MAX_RUNNING: ("Most requests served at once", s.max_running),
            M.BATCH_SIZE: ("Mean requests per engine step (window)", w.batch_mean),
            M.SPARE_CAPACITY: ("Fraction of time not spent serving (window)", w.spare_capacity),
            M.TRAINING_BUSY: ("Fraction of time spent training (window)", w.training_busy_frac),
            M.TRAINING_BESIDE_SERVING: ("Fraction of time spent training while requests were running or waiting "
                                        "(window): what stretches serving", w.training_beside_serving_frac),
            M.TRAIN_SHARE: ("Training seconds per second the co-execution rule grants beside serving now (its "
                            "controller's share)", s.train_share),
            M.TRAIN_TOKENS_PER_S: ("Training tokens per second (window)", w.train_tokens_per_s),
            M.TRAINING_ACTIVE: ("1 while a training job is queued or running", float(s.jobs > 0)),
            M.ADAPTER_VERSION: ("Serving adapter version", s.adapter_version),
            M.STEP_P50: ("Median engine step time (s, window)", w.step_p50_s),
            M.DECODE_STEP_PRED: ("Predicted decode step time for the running batch (s)", s.predicted_decode_step_s),
            M.SLO_TTFT: ("Default TTFT target (s)", s.ttft_target_s),
            M.SLO_TPOT: ("Default TPOT target (s)", s.tpot_target_s),
            M.MAX_CONTEXT: ("Longest prompt + output this edge accepts (tokens)", s.max_context),
            M.STEP_TOKEN_BUDGET: ("Tokens per engine step (prefill chunking)", s.step_token_budget),
            M.SLO_SAFETY: ("Fraction of each SLO the co-scheduler plans to use", s.slo_safety),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float("nan") if value is None else float(value))
            yield g
        coef = GaugeMetricFamily(M.STEP_COST, "Online step cost model: seconds per unit", labels=["term"])
        for term, v in zip(M.STEP_COST_TERMS, s.step_coef):
            coef.add_metric([term], v)
        yield coef
        for name, doc, value in ((M.TRAIN_TOKENS, "Training tokens processed", w.totals["train_tokens"]),
                                 (M.SWAPS, "Adapter swaps", s.swaps),
                                 (M.DEFERRALS, "Background units held back because serving needed the replica",
                                  w.totals["deferrals"])):
            c = CounterMetricFamily(name.removesuffix("_total"), doc)
            c.add_metric([], float(value))
            yield c
