"""The `slo` rule over a whole fleet at once: one routing decision in a few numpy operations.

`policy.choose_slo` states the rule one edge at a time (its docstring has the formulas) and stays
the readable reference; `choose_slo` here is the same rule over columns, one row per edge, which
is what the router runs: at 1,000 edges a decision costs a fraction of a millisecond instead of
the ~10 ms of a Python loop that builds an estimate object per edge
(benchmarks/bench_router_decisions.py). tests/test_router_fleet.py pins both forms to the same
decisions on random snapshots.

`FleetTable` keeps the router's edges in that form: each `EdgeState` writes what the rule reads
(health, cooldown, requests in flight, last send, a new scrape) through to its row as it changes,
so a decision reads arrays and builds nothing per edge but the two estimates it returns.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from collm.common.step_cost import step_seconds
from collm.router.policy import (COLUMN_FIELDS, LOAD_FIELDS, POLICIES, Assumptions, Decision, EdgeView, Estimate,
                                 RequestView)
from collm.router.state import MIRRORED

def _opt(v: float | None) -> float:
    return math.nan if v is None else float(v)


def dtype_of(col: str) -> type:
    """A column's array type, decided here only: `training` says yes or no, every other column (the step
    cost's c0..c3 too) is a number, NaN where unknown."""
    return bool if col == "training" else float


def row_of(x) -> dict:
    """One row of the columns from an EdgeView or a router Scrape (same field names; None: NaN),
    through the declared `policy.COLUMN_FIELDS`."""
    row = {col: bool(getattr(x, f)) if dtype_of(col) is bool else _opt(getattr(x, f)) for col, f in COLUMN_FIELDS.items()}
    row.update({f"c{i}": float(c) for i, c in enumerate(x.step_coef)})
    return row


# What a row without a fresh scrape says about the edge's load (only the router's own counts stay):
# an EdgeView's defaults in the load columns. FleetTable's stale rows, and collm-sim's.
_DEFAULT_ROW = row_of(EdgeView("", 0))
UNSCRAPED = {col: v for col, v in _DEFAULT_ROW.items() if COLUMN_FIELDS.get(col) in LOAD_FIELDS}
ROW_KEYS = tuple(_DEFAULT_ROW)  # a row's columns (Columns' fields but names, outstanding, unused)


@dataclass(frozen=True)
class Columns:
    """EdgeView's fields as float arrays, one row per routable edge. queue/running NaN: no fresh
    scrape (only the router's own count); budget/safety NaN or 0: the Assumptions' value."""

    names: list[str]
    outstanding: np.ndarray
    outstanding_at: np.ndarray
    queue: np.ndarray
    running: np.ndarray
    max_running: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    c2: np.ndarray
    c3: np.ndarray
    ttft_target: np.ndarray
    tpot_target: np.ndarray
    training: np.ndarray  # bool
    busy: np.ndarray
    spare: np.ndarray
    finish_rate: np.ndarray
    unused: np.ndarray
    budget: np.ndarray
    safety: np.ndarray
    share: np.ndarray  # training_share: the p2c tie-break after load
    version: np.ndarray  # adapter_version: slo_pack's first key with pack_newest (NaN: unknown)


def columns_from_views(views: list[EdgeView]) -> Columns:
    """The columns of a list of views (tests, benchmarks, collm-sim's first rows)."""
    rows = [row_of(v) for v in views]
    cols = {k: np.array([r[k] for r in rows], dtype_of(k)) for k in ROW_KEYS}
    return Columns([v.name for v in views], np.array([v.outstanding for v in views], float),
                   unused=np.array([v.unused_s for v in views], float), **cols)


def _or(values: np.ndarray, default: float) -> np.ndarray:
    """`v or default` per row (None, NaN and 0 take the default), as the scalar rule reads it."""
    return np.where(np.isnan(values) | (values == 0), default, values)


def stretch(c) -> np.ndarray:
    """g per edge: wall seconds per serving second under co-scheduled training, 1 + b / max(1 - sigma, 0.05)
    where training is active, else 1 (`policy.estimate`'s g)."""
    return np.where(c.training, 1.0 + c.busy / np.maximum(1.0 - c.spare, 0.05), 1.0)


def estimates(c: Columns, x: RequestView, a: Assumptions = Assumptions()) -> dict[str, np.ndarray]:
    """`policy.estimate` for every row: n, ttft, tpot, T, P and slack arrays (same operations, same
    order, so the floats are the scalar rule's to the last bit)."""
    M = np.maximum(1.0, c.max_running)
    B = _or(c.budget, a.step_token_budget)
    scraped = ~(np.isnan(c.queue) | np.isnan(c.running))
    n = np.where(scraped, np.maximum(c.outstanding, c.queue + c.running + c.outstanding - c.outstanding_at),
                 c.outstanding)
    k = np.minimum(n, M)
    w = n - k
    p = max(1, x.prompt_tokens)
    ctx = p + x.max_tokens / 2

    coef = (c.c0, c.c1, c.c2, c.c3)

    def t_dec(d):
        return step_seconds(coef, d, 0, d * ctx)

    chunk = np.maximum(1.0, B - k)
    f = np.minimum(p, chunk)
    t_pf = step_seconds(coef, k, f, k * ctx + f)
    g = stretch(c)
    departure = a.typical_output_tokens * t_dec(M) * g / M
    with np.errstate(divide="ignore"):
        serving = np.maximum(1.0 - c.spare, 0.05) if a.drain_per_serving_s else 1.0
        departure = np.where(c.finish_rate > 0, np.maximum(departure, serving / c.finish_rate), departure)
    wait = np.where(n >= M, (w + 1) * departure, 0.0)
    ttft = wait + t_pf + (np.ceil(p / chunk) - 1) * t_pf * g
    T = np.full(len(n), x.ttft_target_s) if x.ttft_target_s else c.ttft_target
    P = np.full(len(n), x.tpot_target_s) if x.tpot_target_s else c.tpot_target
    bare = t_dec(np.minimum(k + 1, M))
    tpot = np.minimum(bare * g, np.maximum(bare, _or(c.safety, a.slo_safety) * P))
    with np.errstate(divide="ignore", invalid="ignore"):
        slack = np.minimum((T - ttft) / T, (P - tpot) / P)
    slack = np.where(np.isfinite(slack), slack, -np.inf)  # an estimate from broken inputs ranks last
    return {"n": n, "ttft": ttft, "tpot": tpot, "T": T, "P": P, "slack": slack}


def _estimate(c: Columns, e: dict[str, np.ndarray], i: int) -> Estimate:
    return Estimate(c.names[i], float(e["n"][i]), float(e["ttft"][i]), float(e["tpot"][i]), float(e["T"][i]),
                    float(e["P"][i]))


def choose_slo(c: Columns, x: RequestView, rng: random.Random, a: Assumptions = Assumptions(),
               pack: bool = False) -> Decision:
    """`policy.choose_slo` over columns: the same decision, and the same draws from `rng`."""
    if not c.names:
        raise ValueError("no edge to choose from")
    e = estimates(c, x, a)
    slack = e["slack"]
    near_mask = slack >= min(float(slack.max()) - a.tie_margin, a.comfort)
    if not near_mask.any():
        near_mask[:] = True
    near = np.flatnonzero(near_mask)
    ttft = np.where(np.isnan(e["ttft"]), np.inf, e["ttft"])
    soonest = _estimate(c, e, int(np.argmin(ttft)))
    starved = ~near_mask & (e["n"] == 0) & (c.unused >= a.probe_after_s)
    if starved.any():
        i = int(np.argmax(np.where(starved, c.unused, -np.inf)))
        return Decision(c.names[i], _estimate(c, e, i), "probe", soonest)
    if len(near) == 1:
        i = int(near[0])
        return Decision(c.names[i], _estimate(c, e, i), "best", soonest)
    roomy = near[(slack[near] >= a.pack_slack) & (c.spare[near] >= a.pack_spare)] if pack else near[:0]
    if a.pack_free_slot and len(roomy):
        roomy = roomy[e["n"][roomy] < np.maximum(1.0, c.max_running[roomy])]
    if len(roomy):  # (the newest version,) the most requests, the least training, the first (policy.choose_slo)
        keys = (np.arange(len(roomy)), c.share[roomy], -e["n"][roomy])
        if a.pack_newest:
            keys += (-np.where(np.isfinite(c.version[roomy]), c.version[roomy], -np.inf),)  # unknown: last
        order = np.lexsort(keys)
        i = int(roomy[order[0]])
        return Decision(c.names[i], _estimate(c, e, i), f"pack among {len(roomy)}", soonest)
    i, j = rng.sample(range(len(near)), 2)
    one, two = int(near[i]), int(near[j])
    key = lambda r: (c.outstanding[r], e["n"][r], c.share[r])  # noqa: E731
    pick = two if key(two) < key(one) else one
    return Decision(c.names[pick], _estimate(c, e, pick), f"p2c among {len(near)}", soonest)


def stale_after(stale_after_s: float, poll_interval_s: float) -> float:
    """How old a scrape may be and still count: the configured age, but never less than two polls
    (a router that polls each edge every 10 s must not call every scrape stale)."""
    return max(stale_after_s, 2 * poll_interval_s)


def mask_stale(d: dict, fresh: np.ndarray) -> dict:
    """Columns `d` with the rows whose scrape is not fresh reset to what an unscraped edge says
    (`UNSCRAPED`): the router then counts only its own outstanding requests there."""
    if fresh.all():
        return d
    return {**d, **{k: np.where(fresh, d[k], blank) for k, blank in UNSCRAPED.items()}}


class FleetTable:
    """The router's edges as columns, kept current by the edges themselves: each `EdgeState` writes
    its health, cooldown, requests in flight, last send and new scrapes through to its row as they
    change (`attach`), so `columns(rows, ...)` builds the rule's input from arrays alone, with no
    Python work per edge per decision."""

    def __init__(self, edges: list, default_max_running: float, ttft_target_s: float, tpot_target_s: float):
        self.edges = edges  # EdgeState objects
        N = len(edges)
        self.names = [e.name for e in edges]
        self._names = np.array(self.names, dtype=object)
        self.healthy = np.zeros(N, bool)
        self.cooldown_until = np.zeros(N)
        self.outstanding = np.zeros(N)
        self.last_sent = np.zeros(N)
        self.at = np.full(N, -np.inf)
        self.blank = row_of(EdgeView(  # a row never scraped: the router's defaults (EdgeState.view with no scrape)
            "", 0, max_running=default_max_running, ttft_target_s=ttft_target_s, tpot_target_s=tpot_target_s))
        self.data = {k: np.full(N, v, dtype=dtype_of(k)) for k, v in self.blank.items()}
        for i, e in enumerate(edges):
            self.attach(i, e)

    def attach(self, i: int, edge) -> None:
        """Copy the edge's state into row i and have it write its changes there from now on."""
        edge.mirror = lambda name, value: self._write(i, name, value)
        for name in MIRRORED:
            self._write(i, name, getattr(edge, name))

    def _write(self, i: int, name: str, value) -> None:
        if name == "scrape":
            self._sync(i, value)
        else:
            getattr(self, name)[i] = value

    def _sync(self, i: int, s) -> None:
        d = self.data
        if s is None:
            self.at[i] = -np.inf
            for k, v in self.blank.items():
                d[k][i] = v
            return
        self.at[i] = s.at
        for k, v in row_of(s).items():
            d[k][i] = v

    def routable(self, now: float, exclude: list[int] = ()) -> np.ndarray | None:
        """Rows a request may go to: healthy, not among `exclude`, and not cooling down unless every
        such edge is (then the cooling ones too). None: no edge at all."""
        ok = self.healthy.copy()
        ok[list(exclude)] = False
        if not ok.any():
            return None
        warm = ok & (self.cooldown_until <= now)
        return warm if warm.any() else ok

    def columns(self, rows, stale_after_s: float, now: float) -> Columns:
        """The rule's input for edges `rows` (indices or a boolean mask), as `EdgeState.view` would
        give it one by one: an edge whose scrape is older than `stale_after_s` keeps what it says
        about the edge, not its load."""
        rows = np.asarray(rows)
        if rows.dtype != bool:
            mask = np.zeros(len(self.names), bool)
            mask[rows.astype(np.intp)] = True
            rows = mask
        whole = bool(rows.all())  # the usual case: every edge routable, no per-decision gather
        idx = slice(None) if whole else np.flatnonzero(rows)
        fresh = now - self.at[idx] <= stale_after_s
        d = {k: v[idx] for k, v in self.data.items()}  # views when whole: never written below
        d = mask_stale(d, fresh)
        return Columns(names=self.names if whole else self._names[idx].tolist(),
                       outstanding=self.outstanding[idx].copy(), unused=now - self.last_sent[idx], **d)


def choose_round_robin(c: Columns, x: RequestView, rng: random.Random, counter: int, a: Assumptions) -> Decision:
    i = counter % len(c.names)
    return Decision(c.names[i], _estimate(c, estimates(c, x, a), i), "round_robin")


def choose_least_outstanding(c: Columns, x: RequestView, rng: random.Random, counter: int,
                             a: Assumptions) -> Decision:
    i = int(rng.choice(list(np.flatnonzero(c.outstanding == c.outstanding.min()))))
    return Decision(c.names[i], _estimate(c, estimates(c, x, a), i), "least_outstanding")


RULES: dict[str, Callable[[Columns, RequestView, random.Random, int, Assumptions], Decision]] = {
    "slo": lambda c, x, rng, counter, a: choose_slo(c, x, rng, a),
    "slo_pack": lambda c, x, rng, counter, a: choose_slo(c, x, rng, a, pack=True),
    "round_robin": choose_round_robin,
    "least_outstanding": choose_least_outstanding,
}  # `policy.RULES` over columns, one per `routing.policy`


def choose(policy: str, c: Columns, x: RequestView, rng: random.Random, counter: int = 0,
           a: Assumptions = Assumptions()) -> Decision:
    """`policy.choose` over columns, estimate included for every policy (the router logs and learns
    from it): the router's one entry point."""
    if not c.names:
        raise ValueError("no edge to choose from")
    if policy not in RULES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return RULES[policy](c, x, rng, counter, a)
