"""What a replica reports: per-request latencies and SLO outcome, per-replica load and training.

One state, one vocabulary: `EdgeSnapshot` is everything a replica says about itself. The engine
builds it (`Engine.snapshot()`); the Prometheus gauges (`serve.metrics`), the federated load
report (`federation.client`) and, through the gauges, the router's view of the edge all derive
from it. The engine thread records; any thread may take a snapshot. Rates and fractions are over
a sliding window (default 60 s).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

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
    finish_reason: str  # stop | length | cancelled | error | expired
    finished_at: float  # wall clock

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def slo_met(self) -> bool:
        return meets_slo(self.completed, self.ttft_s, self.tpot_s, self.ttft_slo_s, self.tpot_slo_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "slo_met": self.slo_met}


@dataclass(frozen=True)
class WindowStats:
    """Requests, steps and background work over the telemetry window."""

    window_s: float
    request_rate: float  # finished requests per second
    completed_rate: float
    goodput: float  # completed requests per second that met every SLO
    slo_attainment: float | None  # None: nothing completed in the window
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    step_p50_s: float | None
    step_p99_s: float | None
    batch_mean: float
    serving_busy_frac: float
    training_busy_frac: float
    training_beside_serving_frac: float  # training units that ran while requests were running or waiting
    eval_busy_frac: float
    spare_capacity: float  # 1 - serving busy fraction
    train_tokens_per_s: float
    totals: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EdgeSnapshot:
    """Everything one replica reports about itself (see the module docstring)."""

    window: WindowStats
    # load now
    running: int
    waiting: int
    jobs: int  # background jobs queued or running
    pending_decode_tokens: int
    pending_prefill_tokens: int
    running_kv_tokens: int
    # adapters
    adapter_version: int
    adapter_versions_alive: list[int]
    swaps: int
    # limits and targets
    max_context: int
    max_running: int
    step_token_budget: int
    ttft_target_s: float
    tpot_target_s: float
    slo_safety: float
    # training
    train_examples: int
    train_steps_total: int
    last_train_loss: float | None
    idle_train_tokens_per_s: float  # what one micro-batch pass costs when nothing else runs
    # cost model
    step_coef: tuple[float, float, float, float]
    predicted_decode_step_s: float
    train_share: float = 0.0  # training seconds per second the co-execution rule grants beside serving now
    failure: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class Telemetry:
    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._requests: deque[tuple[float, RequestRecord]] = deque()
        self._steps: deque[tuple[float, float, int]] = deque()  # (t_end, seconds, batch size)
        self._background: deque[tuple[float, str, float, int, bool]] = deque()  # (t_end, kind, s, tokens, beside)
        self.listeners: list[Callable[[RequestRecord], None]] = []
        self.totals = {"requests": 0, "completed": 0, "slo_met": 0, "cancelled": 0, "expired": 0, "output_tokens": 0,
                       "steps": 0, "train_tokens": 0, "eval_tokens": 0, "train_microbatches": 0,
                       "background_units": 0, "deferrals": 0}

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
            self.totals["expired"] += rec.finish_reason == "expired"
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

    def record_background(self, kind: str, seconds: float, tokens: int, beside_serving: bool = False) -> None:
        """One unit of a background job took `seconds`; `tokens` > 0 when it completed a micro-batch of them;
        `beside_serving`: it ran while requests were running or waiting (not in idle time)."""
        now = time.perf_counter()
        with self._lock:
            self._background.append((now, kind, seconds, tokens, beside_serving))
            self.totals["background_units"] += 1
            self.totals[f"{kind}_tokens"] += tokens
            if kind == "train" and tokens:
                self.totals["train_microbatches"] += 1
            self._trim(now)

    def record_deferral(self) -> None:
        with self._lock:
            self.totals["deferrals"] += 1

    def snapshot(self) -> WindowStats:
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
        train_busy = sum(s for _, k, s, _, _ in bg if k == "train")
        train_beside = sum(s for _, k, s, _, beside in bg if k == "train" and beside)
        eval_busy = sum(s for _, k, s, _, _ in bg if k == "eval")
        step_times = [s for _, s, _ in steps]
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        tpots = [r.tpot_s for r in done if r.tpot_s]
        return WindowStats(
            window_s=round(span, 3),
            request_rate=len(recs) / span,
            completed_rate=len(done) / span,
            goodput=sum(r.slo_met for r in done) / span,
            slo_attainment=(sum(r.slo_met for r in done) / len(done)) if done else None,
            ttft_p50=percentile(ttfts, 0.5), ttft_p99=percentile(ttfts, 0.99),
            tpot_p50=percentile(tpots, 0.5), tpot_p99=percentile(tpots, 0.99),
            step_p50_s=percentile(step_times, 0.5), step_p99_s=percentile(step_times, 0.99),
            batch_mean=(sum(b for _, _, b in steps) / len(steps)) if steps else 0.0,
            serving_busy_frac=min(serve_busy / span, 1.0),
            training_busy_frac=min(train_busy / span, 1.0),
            training_beside_serving_frac=min(train_beside / span, 1.0),
            eval_busy_frac=min(eval_busy / span, 1.0),
            spare_capacity=max(0.0, 1.0 - serve_busy / span),
            train_tokens_per_s=sum(t for _, k, _, t, _ in bg if k == "train") / span,
            totals=totals,
        )
