"""Percentiles and confidence intervals for every figure CoLLM reports (edge telemetry, the load
generator, the benchmarks): one rule each, so the edge's p99 and the benchmark's p99 agree."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000


def percentile(values, q: float) -> float | None:
    """The q-quantile (0..1) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(math.floor(x))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


LARGE = 5000  # rows: beyond this, resample by counts of distinct rows (same distribution, bounded memory)


def _resampled_sums(columns: Sequence[Sequence[float]], resamples: int, seed: int) -> list[np.ndarray]:
    """Sums of each column over the same `resamples` bootstrap resamples of the rows (paired).

    Above LARGE rows with few distinct rows (per-request SLO flags: at most 4 kinds of pair), a
    bootstrap resample is a multinomial draw of how often each distinct row is taken, so the sums
    are drawn that way: the same distribution as index resampling, without an n x resamples array."""
    arrays = [np.asarray(c, dtype=float) for c in columns]
    n = len(arrays[0])
    rng = np.random.default_rng(seed)
    if n > LARGE:
        rows, counts = np.unique(np.stack(arrays, axis=1), axis=0, return_counts=True)
        if len(rows) <= 64:
            taken = rng.multinomial(n, counts / n, size=resamples)  # resamples x distinct rows
            return [taken @ rows[:, j] for j in range(len(arrays))]
    idx = rng.integers(0, n, size=(resamples, n))
    return [a[idx].sum(axis=1) for a in arrays]


def mean_ci(values: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
            seed: int = 0) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): the mean and its percentile-bootstrap confidence interval; Nones if empty."""
    if not len(values):
        return None, None, None
    (sums,) = _resampled_sums([values], resamples, seed)
    lo, hi = np.quantile(sums / len(values), [(1 - level) / 2, (1 + level) / 2])
    return float(np.mean(values)), float(lo), float(hi)


def ratio_ci(a: Sequence[float], b: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
             seed: int = 0) -> tuple[float | None, float | None, float | None]:
    """(sum a / sum b, low, high) with a paired bootstrap: a[i] and b[i] are the same request (the same
    arrival replayed against two deployments), resampled together. Nones if undefined."""
    if not len(a) or len(a) != len(b) or sum(b) == 0:
        return None, None, None
    sa, sb = _resampled_sums([a, b], resamples, seed)
    ok = sb > 0
    lo, hi = np.quantile(sa[ok] / sb[ok], [(1 - level) / 2, (1 + level) / 2])
    return float(sum(a) / sum(b)), float(lo), float(hi)
