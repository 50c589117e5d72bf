"""Request traces in the Azure LLM inference CSV format (`TIMESTAMP, ContextTokens, GeneratedTokens`).

A real trace is sized for a GPU cluster; replaying it on one small machine needs knobs, and a
report must state them: `speed` divides inter-arrival times (2.0 = twice as fast), `token_scale`
multiplies token counts, `max_*`/`min_*` clip them, and `start_s`/`duration_s` select a window.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from collm.common.errors import UserError, reading


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the first request of the (windowed, sped-up) trace
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceScaling:
    speed: float = 1.0
    token_scale: float = 1.0
    min_prompt_tokens: int = 1
    max_prompt_tokens: int = 4096
    min_output_tokens: int = 1
    max_output_tokens: int = 4096
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None

    def describe(self) -> dict:
        return asdict(self)


def default_trace_path() -> Path:
    from collm.data import AZURE_CONV_TRACE

    return AZURE_CONV_TRACE


def _parse_ts(text: str) -> float:
    text = text.strip()
    if "." in text:  # the Azure files carry 7 fractional digits; datetime takes at most 6
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text).timestamp()


def load_trace(path: str | Path | None = None, scaling: TraceScaling = TraceScaling()) -> list[TraceRequest]:
    p = Path(path).expanduser() if path else default_trace_path()
    if not p.is_file():
        raise UserError(f"trace {p} does not exist")
    if scaling.speed <= 0 or scaling.token_scale <= 0:
        raise UserError("trace scaling: speed and token_scale must be positive")
    rows: list[tuple[float, int, int]] = []
    # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
    with reading(p, "trace"), open(p, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not reader.fieldnames or not need <= set(reader.fieldnames):
            raise UserError(f"{p}: expected CSV columns {sorted(need)}, got {reader.fieldnames}")
        for lineno, row in enumerate(reader, 2):
            try:
                rows.append((_parse_ts(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (ValueError, TypeError, AttributeError) as e:  # a short row leaves fields None
                raise UserError(f"{p}:{lineno}: bad row: {type(e).__name__}: {e}; expected "
                                f"TIMESTAMP,ContextTokens,GeneratedTokens") from None
    if not rows:
        raise UserError(f"{p}: no requests")
    rows.sort()
    t0 = rows[0][0]
    out: list[TraceRequest] = []
    for ts, ctx, gen in rows:
        rel = ts - t0 - scaling.start_s
        if rel < 0:
            continue
        if scaling.duration_s is not None and rel > scaling.duration_s:
            break
        out.append(TraceRequest(
            arrival_s=rel / scaling.speed,
            prompt_tokens=_clip(ctx * scaling.token_scale, scaling.min_prompt_tokens, scaling.max_prompt_tokens),
            output_tokens=_clip(gen * scaling.token_scale, scaling.min_output_tokens, scaling.max_output_tokens),
        ))
        if scaling.max_requests and len(out) >= scaling.max_requests:
            break
    if out:
        first = out[0].arrival_s
        out = [TraceRequest(r.arrival_s - first, r.prompt_tokens, r.output_tokens) for r in out]
    return out


def _clip(v: float, lo: int, hi: int) -> int:
    return int(min(max(round(v), lo), hi))


def mean_rate(trace: list[TraceRequest]) -> float:
    """Requests per second over the trace's span."""
    if len(trace) < 2:
        return 0.0
    return (len(trace) - 1) / max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)


def at_rate(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same requests from t = 0, arrival times stretched so the mean rate is `rate` per second
    ((n - 1) / span); the trace's bursts and lulls keep their shape."""
    if len(trace) < 2:
        return [TraceRequest(0.0, r.prompt_tokens, r.output_tokens) for r in trace]
    t0, span = trace[0].arrival_s, trace[-1].arrival_s - trace[0].arrival_s
    k = (len(trace) - 1) / (rate * span) if span > 0 else 0.0
    return [TraceRequest((r.arrival_s - t0) * k, r.prompt_tokens, r.output_tokens) for r in trace]


def trace_segment(requests: list[TraceRequest], rate: float, seconds: float, min_requests: int) -> list[TraceRequest]:
    """The first max(min_requests, rate * seconds) requests of `requests` at mean rate `rate` (the
    trace repeats if it is shorter), bursts kept: collm-bench's load points and probes, and collm-sim's."""
    n = max(min_requests, math.ceil(rate * seconds), 2)
    span = requests[-1].arrival_s + 1.0
    reqs = [TraceRequest(r.arrival_s + (i // len(requests)) * span, r.prompt_tokens, r.output_tokens)
            for i, r in ((i, requests[i % len(requests)]) for i in range(n))]
    return at_rate(reqs, rate)


def bursts(trace: list[TraceRequest], period_s: float, peak: float, duty: float) -> list[TraceRequest]:
    """The same arrivals with on/off bursts laid over them, mean rate kept: in the first `duty` of every
    `period_s` requests come `peak` times as fast as the trace has them, in the rest slower by
    (1 - duty * peak) / (1 - duty). A time warp of the trace's own clock, so its bursts stay inside ours
    (a synthetic burst schedule, for a burstier workload than the trace's own)."""
    if not 0 < duty < 1 or peak < 1 or peak * duty >= 1 or period_s <= 0:
        raise ValueError(f"bursts need 0 < duty < 1, peak >= 1, peak * duty < 1 and period_s > 0 "
                         f"(got duty {duty:g}, peak {peak:g}, period_s {period_s:g})")
    slow = (1 - duty * peak) / (1 - duty)
    on = peak * duty * period_s  # trace seconds that pass during one on-phase

    def wall(a: float) -> float:
        k, r = divmod(a, period_s)
        return k * period_s + (r / peak if r < on else duty * period_s + (r - on) / slow)

    t0 = trace[0].arrival_s if trace else 0.0
    return [TraceRequest(t0 + wall(r.arrival_s - t0), r.prompt_tokens, r.output_tokens) for r in trace]
