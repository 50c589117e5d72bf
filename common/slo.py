"""The SLO rule every CoLLM component counts goodput by, kept in one place.

A request meets its SLO when it completed, its first token came within the TTFT target and its
mean time per output token stayed within the TPOT target (a one-token answer has no TPOT).
"""

from __future__ import annotations


def meets_slo(completed: bool, ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
              tpot_slo_s: float) -> bool:
    return completed and ttft_s is not None and ttft_s <= ttft_slo_s and (tpot_s or 0.0) <= tpot_slo_s
