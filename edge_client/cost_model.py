"""Online cost models: how long a serving step or a training micro-batch will take.

Each is a linear model over a few features, refit by least squares on a window of recent
measurements (so it follows the machine as it gets busier or quieter), with a floor of zero on
every coefficient. Before there are enough measurements it answers from its prior.

* serving step:  t = c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * attended_kv_tokens / 1000
* micro-batch:   t = c0 + c1 * tokens           (separate models for training and evaluation)
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np


class LinearCostModel:
    def __init__(self, n_features: int, prior: list[float], window: int = 200, min_samples: int = 8):
        self.prior = np.asarray(prior, dtype=float)
        assert len(self.prior) == n_features + 1
        self.coef = self.prior.copy()
        self._xs: deque[np.ndarray] = deque(maxlen=window)
        self._ys: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self._dirty = False
        self._lock = threading.Lock()
        self.samples = 0

    def observe(self, features: list[float], seconds: float) -> None:
        with self._lock:
            self._xs.append(np.concatenate([[1.0], np.asarray(features, dtype=float)]))
            self._ys.append(float(seconds))
            self.samples += 1
            self._dirty = True

    def _refit(self) -> None:
        if len(self._ys) < self._min:
            # Few samples: scale the prior so it matches what was seen so far.
            if self._ys:
                x, y = np.stack(self._xs), np.asarray(self._ys)
                pred = x @ self.prior
                ratio = float(y.sum() / max(pred.sum(), 1e-9))
                self.coef = self.prior * min(max(ratio, 0.05), 20.0)
            return
        x, y = np.stack(self._xs), np.asarray(self._ys)
        # Ridge toward the prior keeps features that never varied at their prior value.
        lam = 1e-3 * len(y)
        scale = np.maximum(np.abs(x).mean(axis=0), 1e-9)
        xs = x / scale
        p = self.prior * scale
        a = xs.T @ xs + lam * np.eye(x.shape[1])
        b = xs.T @ y + lam * p
        coef = np.linalg.solve(a, b) / scale
        self.coef = np.maximum(coef, 0.0)
        if self.coef.sum() == 0:
            self.coef = self.prior.copy()

    def predict(self, features: list[float]) -> float:
        with self._lock:
            if self._dirty:
                self._refit()
                self._dirty = False
            return float(self.coef @ np.concatenate([[1.0], np.asarray(features, dtype=float)]))


def step_features(decode_seqs: int, prefill_tokens: int, attended_kv: int) -> list[float]:
    return [float(decode_seqs), float(prefill_tokens), attended_kv / 1000.0]


class CostModels:
    """The three models one engine keeps; priors are deliberately pessimistic until measured."""

    def __init__(self):
        self.step = LinearCostModel(3, [0.01, 0.01, 0.002, 0.001])
        self.train = LinearCostModel(1, [0.05, 0.004])
        self.eval = LinearCostModel(1, [0.02, 0.0015])

    def step_time(self, decode_seqs: int, prefill_tokens: int, attended_kv: int) -> float:
        return self.step.predict(step_features(decode_seqs, prefill_tokens, attended_kv))

    def microbatch_time(self, kind: str, tokens: int) -> float:
        return (self.train if kind == "train" else self.eval).predict([float(tokens)])

    def snapshot(self) -> dict:
        return {
            "step_coef": [round(float(c), 6) for c in self.step.coef],
            "train_coef": [round(float(c), 6) for c in self.train.coef],
            "eval_coef": [round(float(c), 6) for c in self.eval.coef],
        }


class FixedCosts(CostModels):
    """Constant costs (deterministic tests of the scheduling rule)."""

    def __init__(self, step_s: float, train_s: float, eval_s: float | None = None):
        super().__init__()
        self._step, self._train, self._eval = step_s, train_s, eval_s if eval_s is not None else train_s / 3

    def step_time(self, decode_seqs: int, prefill_tokens: int, attended_kv: int) -> float:
        return self._step

    def microbatch_time(self, kind: str, tokens: int) -> float:
        return self._train if kind == "train" else self._eval
