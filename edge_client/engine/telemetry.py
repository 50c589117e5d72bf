"""What a replica reports: per-request latencies and SLO outcome, per-replica load and training.

The engine thread records; any thread may take a `snapshot()` (the API, the Flower load report,
the router). Rates and fractions are over a sliding window (default 60 s).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from collm.common.slo import meets_slo
from collm.common.stats import percentile


@dataclass(frozen=True)
class RequestRecord:
    """The outcome of one finished request."""

    id: str
    adapter_version: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    finish_reason: str  # stop | length | cancelled | error
    finished_at: float  # wall clock

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def slo_met(self) -> bool:
        return meets_slo(self.completed, self.ttft_s, self.tpot_s, self.ttft_slo_s, self.tpot_slo_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "slo_met": self.slo_met}


class Telemetry:
    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._requests: deque[tuple[float, RequestRecord]] = deque()
        self._steps: deque[tuple[float, float, int]] = deque()  # (t_end, seconds, batch size)
        self._background: deque[tuple[float, str, float, int]] = deque()  # (t_end, kind, s, tokens)
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self.totals = {"requests": 0, "completed": 0, "slo_met": 0, "cancelled": 0, "output_tokens": 0,
                       "steps": 0, "train_tokens": 0, "eval_tokens": 0, "train_microbatches": 0,
                       "deferrals": 0, "preemptions": 0, "preempted_s": 0.0}

    def _trim(self, now: float) -> None:
        for dq in (self._requests, self._steps, self._background):
            while dq and dq[0][0] < now - self.window_s:
                dq.popleft()

    def record_request(self, rec: RequestRecord) -> None:
        now = time.perf_counter()
        with self._lock:
            self._requests.append((now, rec))
            self.totals["requests"] += 1
            self.totals["completed"] += rec.completed
            self.totals["slo_met"] += rec.slo_met
            self.totals["cancelled"] += rec.finish_reason == "cancelled"
            self.totals["output_tokens"] += rec.output_tokens
            self._trim(now)
        for fn in list(self.listeners):
            fn(rec)

    def record_step(self, seconds: float, batch_size: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self._steps.append((now, seconds, batch_size))
            self.totals["steps"] += 1
            self._trim(now)

    def record_background(self, kind: str, seconds: float, tokens: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self._background.append((now, kind, seconds, tokens))
            self.totals[f"{kind}_tokens"] += tokens
            if kind == "train":
                self.totals["train_microbatches"] += 1
            self._trim(now)

    def record_preemption(self, seconds: float) -> None:
        with self._lock:
            self.totals["preemptions"] += 1
            self.totals["preempted_s"] += seconds

    def record_deferral(self) -> None:
        with self._lock:
            self.totals["deferrals"] += 1

    def snapshot(self) -> dict:
        now = time.perf_counter()
        with self._lock:
            self._trim(now)
            span = max(min(self.window_s, now - self.started), 1e-6)
            recs = [r for _, r in self._requests]
            steps = list(self._steps)
            bg = list(self._background)
            totals = dict(self.totals)
        done = [r for r in recs if r.completed]
        serve_busy = sum(s for _, s, _ in steps)
        train_busy = sum(s for _, k, s, _ in bg if k == "train")
        eval_busy = sum(s for _, k, s, _ in bg if k == "eval")
        step_times = [s for _, s, _ in steps]
        return {
            "window_s": round(span, 3),
            "request_rate": len(recs) / span,
            "completed_rate": len(done) / span,
            "goodput": sum(r.slo_met for r in done) / span,
            "slo_attainment": (sum(r.slo_met for r in done) / len(done)) if done else None,
            "ttft_p50": percentile([r.ttft_s for r in done if r.ttft_s is not None], 0.5),
            "ttft_p99": percentile([r.ttft_s for r in done if r.ttft_s is not None], 0.99),
            "tpot_p50": percentile([r.tpot_s for r in done if r.tpot_s], 0.5),
            "tpot_p99": percentile([r.tpot_s for r in done if r.tpot_s], 0.99),
            "step_p50_s": percentile(step_times, 0.5),
            "step_p99_s": percentile(step_times, 0.99),
            "batch_mean": (sum(b for _, _, b in steps) / len(steps)) if steps else 0.0,
            "serving_busy_frac": min(serve_busy / span, 1.0),
            "training_busy_frac": min(train_busy / span, 1.0),
            "eval_busy_frac": min(eval_busy / span, 1.0),
            "spare_capacity": max(0.0, 1.0 - serve_busy / span),
            "train_tokens_per_s": sum(t for _, k, _, t in bg if k == "train") / span,
            "totals": totals,
        }
