"""Percentiles for every latency figure CoLLM reports (edge telemetry, load generator, benchmarks)."""

from __future__ import annotations

import math


def percentile(values, q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(math.floor(x))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)
