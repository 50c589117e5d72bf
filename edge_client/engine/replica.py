"""The replica's decisions that the engine and the simulator share, as pure functions over plain records.

`Engine` (edge_client/engine/engine.py) runs them with its threads, the model and the wall clock;
`SimEdge` (sim/edge.py) runs the same functions on a logical clock with a profile's costs. A
decision written here is made the same way in both.
"""

from __future__ import annotations

from collm.edge_client.engine.co_schedule import RequestOutcome


def latencies(arrival: float, first_token_at: float | None, tokens: int, end: float) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) of a request that ended at `end` with `tokens` output tokens: TPOT is the mean gap
    after the first token (0 for a one-token answer; None for none)."""
    if first_token_at is None:
        return None, None
    tpot = (end - first_token_at) / (tokens - 1) if tokens > 1 else 0.0
    return first_token_at - arrival, tpot


def outcome(reason: str, ttft: float | None, tpot: float | None, ttft_slo: float,
            tpot_slo: float) -> RequestOutcome | None:
    """What the co-execution controller learns from a request that ended for `reason`: its latencies if
    it completed, a shed (a TTFT miss) if it expired waiting; None if it says nothing (cancelled, failed)."""
    if reason in ("stop", "length"):
        return RequestOutcome(ttft, tpot, ttft_slo, tpot_slo)
    if reason == "expired":
        return RequestOutcome(None, None, ttft_slo, tpot_slo, shed=True)
    return None
