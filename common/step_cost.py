"""The serving step's cost formula, written once.

    t = c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * attended_kv_tokens / KV_UNIT

The edge's cost model fits the coefficients online (`edge_client/engine/cost_model.py`) and publishes
them; the router predicts a request's TTFT with them (`router/policy.py`, `router/fleet.py`) and the
simulator's profiles replay them (`sim/profile.py`). The arithmetic works on numbers and numpy arrays alike.
"""

from __future__ import annotations

KV_UNIT = 1000.0
"""Attended KV tokens are counted in thousands, so the four coefficients stay of one size."""


def step_features(decode_seqs, prefill_tokens, attended_kv) -> list[float]:
    """The fitted features of one step (the intercept aside)."""
    return [float(decode_seqs), float(prefill_tokens), attended_kv / KV_UNIT]


def step_seconds(coef, decode_seqs, prefill_tokens, attended_kv):
    """Predicted seconds of one step from coefficients (c0, c1, c2, c3)."""
    c0, c1, c2, c3 = coef
    return c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * attended_kv / KV_UNIT
