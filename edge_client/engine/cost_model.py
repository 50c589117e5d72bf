"""Online cost models: how long a serving step, a unit of background work or a micro-batch will take.

Each is a linear model over a few features, refit by least squares on the measurements of the
last `max_age_s` seconds (so it follows the machine as it gets busier or quieter), pulled toward
a prior and floored at zero. Warmup measures a few shapes on this machine and the prior becomes
what they show (`adopt_fit_as_prior`): with fewer samples than `min_samples` (warmup's six step
shapes cannot pin four correlated terms) that is the default prior scaled by the median ratio of
measured to predicted time; so an edge that has been idle for a while falls back to its own
calibration.

* serving step:  t = c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * attended_kv_tokens / 1000
                 (the formula and its features: common/step_cost.py, which the router and simulator use too)
* one unit:      t = c0 + c1 * tokens           per (job kind, unit kind): train/eval x forward/head/backward
* micro-batch:   t = c0 + c1 * tokens           the sum of one whole pass's units, per job kind: what the
                                                load report's idle training throughput is computed from
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from collm.common.step_cost import step_features


class LinearCostModel:
    def __init__(self, n_features: int, prior: list[float], window: int = 200, min_samples: int = 8,
                 max_age_s: float = 120.0):
        self.prior = np.asarray(prior, dtype=float)
        assert len(self.prior) == n_features + 1
        self.coef = self.prior.copy()
        self._xs: deque[np.ndarray] = deque(maxlen=window)
        self._ys: deque[float] = deque(maxlen=window)
        self._ts: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self.max_age_s = max_age_s
        self._dirty = False
        self._lock = threading.Lock()
        self.samples = 0

    def observe(self, features: list[float], seconds: float) -> None:
        with self._lock:
            self._xs.append(np.concatenate([[1.0], np.asarray(features, dtype=float)]))
            self._ys.append(float(seconds))
            self._ts.append(time.monotonic())
            self.samples += 1
            self._dirty = True

    def adopt_fit_as_prior(self) -> None:
        """Use the current fit (e.g. after warmup) as the prior from now on."""
        with self._lock:
            self._refit()
            self.prior = self.coef.copy()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        while self._ts and self._ts[0] < cutoff:
            self._ts.popleft()
            self._xs.popleft()
            self._ys.popleft()
            self._dirty = True

    def _refit(self) -> None:
        if len(self._ys) < self._min:
            # Few samples: scale the prior so it matches what was seen so far.
            if self._ys:  # the median ratio: one hiccup (a page fault, another process) must not count
                x, y = np.stack(self._xs), np.asarray(self._ys)
                ratio = float(np.median(y / np.maximum(x @ self.prior, 1e-9)))
                self.coef = self.prior * min(max(ratio, 0.05), 20.0)
            return
        x, y = np.stack(self._xs), np.asarray(self._ys)
        coef = self._ridge(x, y)
        # one robust pass: refit without samples far off the first fit (outliers inflate every term)
        resid = np.abs(y - x @ coef)
        keep = resid <= 3 * np.median(resid) + 1e-4
        if keep.sum() >= self._min and not keep.all():
            coef = self._ridge(x[keep], y[keep])
        self.coef = np.maximum(coef, 0.0)
        if self.coef.sum() == 0:
            self.coef = self.prior.copy()

    def _ridge(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Least squares pulled toward the prior (features that never varied keep their prior value)."""
        lam = 1e-3 * len(y)
        scale = np.maximum(np.abs(x).mean(axis=0), 1e-9)
        xs = x / scale
        a = xs.T @ xs + lam * np.eye(x.shape[1])
        b = xs.T @ y + lam * self.prior * scale
        return np.linalg.solve(a, b) / scale

    def predict(self, features: list[float]) -> float:
        with self._lock:
            self._expire()
            if not self._ys:
                self.coef = self.prior.copy()
            elif self._dirty:
                self._refit()
                self._dirty = False
            return float(self.coef @ np.concatenate([[1.0], np.asarray(features, dtype=float)]))


UNIT_PRIORS = {"forward": [0.002, 2e-5], "head": [0.002, 1e-4], "backward": [0.004, 4e-5]}


class CostModels:
    """The models one engine keeps; priors are deliberately pessimistic until measured."""

    def __init__(self):
        self.step = LinearCostModel(3, [0.01, 0.01, 0.002, 0.001])
        self.train = LinearCostModel(1, [0.05, 0.004])  # one training micro-batch pass
        self.eval = LinearCostModel(1, [0.02, 0.0015])  # one evaluation pass
        self.units = {(job, kind): LinearCostModel(1, prior) for job in ("train", "eval")
                      for kind, prior in UNIT_PRIORS.items()}

    def all_models(self) -> list[LinearCostModel]:
        return [self.step, self.train, self.eval, *self.units.values()]

    def step_time(self, decode_seqs: int, prefill_tokens: int, attended_kv: int) -> float:
        return self.step.predict(step_features(decode_seqs, prefill_tokens, attended_kv))

    def microbatch_time(self, kind: str, tokens: int) -> float:
        """One whole micro-batch pass of a job of `kind` over `tokens` input tokens."""
        return (self.train if kind == "train" else self.eval).predict([float(tokens)])

    def unit_time(self, job_kind: str, unit_kind: str, tokens: int) -> float:
        return self.units[(job_kind, unit_kind)].predict([float(tokens)])

    def observe_unit(self, job_kind: str, unit_kind: str, tokens: int, seconds: float) -> None:
        self.units[(job_kind, unit_kind)].observe([float(tokens)], seconds)

    def snapshot(self) -> dict:
        return {
            "step_coef": [round(float(c), 6) for c in self.step.coef],
            "train_coef": [round(float(c), 6) for c in self.train.coef],
            "eval_coef": [round(float(c), 6) for c in self.eval.coef],
        }


class FixedCosts(CostModels):
    """Constant costs (deterministic tests of the co-execution rule)."""

    def __init__(self, step_s: float, unit_s: float, train_s: float | None = None):
        super().__init__()
        self._step, self._unit = step_s, unit_s
        self._train = train_s if train_s is not None else 10 * unit_s

    def step_time(self, decode_seqs: int, prefill_tokens: int, attended_kv: int) -> float:
        return self._step

    def unit_time(self, job_kind: str, unit_kind: str, tokens: int) -> float:
        return self._unit

    def microbatch_time(self, kind: str, tokens: int) -> float:
        return self._train
