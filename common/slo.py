"""The SLO every CoLLM component counts goodput by, kept in one place.

Targets are written in milliseconds where people write them (configs, the `slo` field of a
request) and become an `SLO` in seconds once, where they are read (`SLO.from_ms`).

A request meets its SLO when it completed, its first token came within the TTFT target and its
mean time per output token stayed within the TPOT target (a one-token answer has no TPOT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request, in seconds."""

    ttft_s: float
    tpot_s: float

    @classmethod
    def from_ms(cls, ttft_ms: float, tpot_ms: float) -> SLO:
        return cls(ttft_ms / 1000.0, tpot_ms / 1000.0)

    def override(self, ttft_ms: float | None = None, tpot_ms: float | None = None, floor: float = 0.0) -> SLO:
        """These targets with a request's own (milliseconds; None, non-finite or <= 0: keep ours), each at
        least `floor` x ours: a client cannot set a target so tight that it stops the replica's training
        (the slack guard would go negative) while it decodes."""
        def pick(ms: float | None, default_s: float) -> float:
            ok = isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0
            return max(ms / 1000.0, floor * default_s) if ok else default_s

        return SLO(pick(ttft_ms, self.ttft_s), pick(tpot_ms, self.tpot_s))


def slo_miss(completed: bool, ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
             tpot_slo_s: float) -> str | None:
    """Why a request missed its SLO, first reason first: "failed" (no complete answer), "ttft" (first
    token late), "tpot" (tokens after it too slow); None if it met it."""
    if not completed or ttft_s is None:
        return "failed"
    if ttft_s > ttft_slo_s:
        return "ttft"
    if (tpot_s or 0.0) > tpot_slo_s:
        return "tpot"
    return None


def meets_slo(completed: bool, ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
              tpot_slo_s: float) -> bool:
    return slo_miss(completed, ttft_s, tpot_s, ttft_slo_s, tpot_slo_s) is None
