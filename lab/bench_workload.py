"""collm-bench's workload: the trace's requests at a chosen rate, as chat requests the load generator
replays (prompts from the edges' Dolly domains, each request's SLO in its body)."""

from __future__ import annotations

from collm.common.data import Record, load_records
from collm.common.slo import SLO
from collm.common.traces import TraceRequest
from collm.lab.bench_analysis import window_span
from collm.lab.bench_config import BenchConfig
from collm.lab.loadgen import Planned


class PromptMaker:
    """Chat prompts from the edges' Dolly domains, about `tokens` long (4 characters per token)."""

    def __init__(self, records: list[Record]):
        self.records = records
        self.i = 0

    def __call__(self, tokens: int) -> str:
        want = max(8, tokens * 4)
        parts = []
        while sum(len(p) for p in parts) < want:
            parts.append(self.records[self.i % len(self.records)].prompt())
            self.i += 1
        return "\n\n".join(parts)[:want]


class Workload:
    """The trace's requests from `trace.start_s` on, replayed at a chosen mean rate.

    Every probe and load point replays a prefix of the same request sequence (the longer the point,
    the longer the prefix), its arrival times stretched to the point's mean rate with the trace's
    bursts kept: a higher load is the same workload, only faster, so attainment against rate is
    not blurred by one segment of the trace being burstier than another.
    """

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.requests = cfg.trace.load()
        self.prompts = PromptMaker(load_records()[::7])

    def segment(self, rate: float, seconds: float, min_requests: int) -> list[TraceRequest]:
        """The first max(min_requests, rate * seconds) requests at mean rate `rate` (the trace repeats
        if it is shorter)."""
        return self.cfg.trace.segment(self.requests, rate, seconds, min_requests)

    def plan(self, reqs: list[TraceRequest], model_id: str) -> list[Planned]:
        cfg = self.cfg
        slo = SLO.from_ms(cfg.ttft_ms, cfg.tpot_ms)
        return [Planned(r.arrival_s, {
            "model": model_id, "messages": [{"role": "user", "content": self.prompts(r.prompt_tokens)}],
            "max_tokens": r.output_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True,
            "slo": {"ttft_ms": cfg.ttft_ms, "tpot_ms": cfg.tpot_ms}},
            ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s) for i, r in enumerate(reqs)]


def window_of(plan: list[Planned]) -> float:
    """Seconds the plan's arrivals span, as n / rate: goodput = SLO-meeting requests / this."""
    return window_span(plan[-1].at_s if plan else 0.0, len(plan))
