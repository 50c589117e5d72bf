"""The router's columnar rule (router/fleet.py) makes the very decisions of the reference rule
(router/policy.py) on fixed snapshots, and the FleetTable gives the rule what EdgeState.view gives."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from collm.router import fleet, policy
from collm.router.config import EdgeEndpoint, RoutingConfig
from collm.router.policy import Assumptions, EdgeView, RequestView
from collm.router.state import EdgeState, Scrape


def random_view(i: int, rng: random.Random) -> EdgeView:
    scraped = rng.random() < 0.8
    return EdgeView(
        f"edge{i}", outstanding=rng.randint(0, 5), outstanding_at=rng.randint(0, 3),
        queue_depth=float(rng.choice([0, 0, 1, 4])) if scraped else None,
        running=float(rng.randint(0, 8)) if scraped else None, max_running=float(rng.choice([4, 8, 16])),
        step_coef=(0.01 + rng.random() * 0.02, 0.002 * rng.random(), 2e-5, 0.001 * rng.random()),
        ttft_target_s=rng.choice([0.5, 2.0]), tpot_target_s=rng.choice([0.05, 0.2]),
        training_active=rng.random() < 0.5, training_busy=rng.random() * 0.6, spare_capacity=rng.random(),
        finish_rate=rng.choice([0.0, rng.random() * 3]), unused_s=rng.random() * 10,
        step_token_budget=rng.choice([None, 0.0, 64.0, 512.0]), slo_safety=rng.choice([None, 0.7]),
        training_share=rng.choice([0.0, 0.3, rng.random()]),
        adapter_version=rng.choice([None, float("nan"), float("inf"), -float("inf"), 1.0, float(rng.randint(0, 3))]))


def random_request(rng: random.Random) -> RequestView:
    return RequestView(rng.randint(1, 600), rng.randint(1, 200), rng.choice([None, 0.3, 3.0]),
                       rng.choice([None, 0.1]))


@pytest.mark.parametrize("n_edges", [1, 2, 7, 60])
def test_columnar_slo_rule_decides_as_the_reference_rule(n_edges):
    rng = random.Random(n_edges)
    kinds = set()
    for trial in range(300):
        views = [random_view(i, rng) for i in range(n_edges)]
        x = random_request(rng)
        a = Assumptions(probe_after_s=rng.choice([float("inf"), 5.0]), comfort=rng.choice([0.5, 2.0]),
                        typical_output_tokens=rng.choice([16.0, 64.0]), drain_per_serving_s=rng.random() < 0.5)
        seed = rng.random()
        pack = trial % 2 == 1  # the slo_pack variant on every other snapshot, at random thresholds
        if pack:
            a = replace(a, pack_slack=rng.choice([0.0, 0.3, 0.6]), pack_spare=rng.choice([0.0, 0.3, 0.6]),
                        pack_newest=rng.random() < 0.5, pack_free_slot=rng.random() < 0.5)
        ref = policy.choose_slo(views, x, random.Random(seed), a, pack)
        got = fleet.choose_slo(fleet.columns_from_views(views), x, random.Random(seed), a, pack)
        assert got == ref, (trial, views, x)  # same edge, same estimate to the bit, same reason, same soonest
        kinds.add(ref.why.split(" ")[0])
    if n_edges > 2:
        assert kinds == {"best", "p2c", "probe", "pack"}  # the snapshots reach every branch of the rule


def test_columnar_baselines_decide_as_the_reference():
    rng = random.Random(3)
    for counter in range(50):
        views = [random_view(i, rng) for i in range(rng.randint(1, 9))]
        x = random_request(rng)
        for name in ("round_robin", "least_outstanding"):
            seed = rng.random()
            ref = policy.choose(name, views, x, random.Random(seed), counter)
            got = fleet.choose(name, fleet.columns_from_views(views), x, random.Random(seed), counter)
            assert (got.edge, got.why) == (ref.edge, ref.why)
            assert got.estimate == policy.estimate(next(v for v in views if v.name == got.edge), x)
    with pytest.raises(ValueError, match="unknown policy"):
        fleet.choose("fastest", fleet.columns_from_views(views), x, random.Random(0))


def _scrape(rng: random.Random, at: float) -> Scrape:
    return Scrape(at=at, outstanding_at=rng.randint(0, 3), queue_depth=float(rng.randint(0, 4)),
                  running=float(rng.randint(0, 8)), max_running=8.0,
                  step_coef=(0.02, 0.003 * rng.random(), 3e-5, 0.0008), ttft_target_s=1.0, tpot_target_s=0.1,
                  training_active=rng.random() < 0.5, training_busy=0.3 * rng.random(),
                  spare_capacity=rng.random(), finish_rate=rng.random(),
                  step_token_budget=rng.choice([None, 128.0]), slo_safety=rng.choice([None, 0.9]),
                  training_share=rng.choice([0.0, rng.random()]))


def test_fleet_table_gives_the_rule_what_edge_state_view_gives():
    """The table's rows follow every change of the edges (written through) and match their views."""
    rng = random.Random(7)
    routing = RoutingConfig()
    edges = [EdgeState(EdgeEndpoint(name=f"e{i}", url=f"http://127.0.0.1:{9000 + i}")) for i in range(12)]
    table = fleet.FleetTable(edges, routing.default_max_running, routing.default_slo.ttft_s,
                             routing.default_slo.tpot_s)
    now, stale_after = 1000.0, 2.0
    for step in range(5):  # scrapes arrive and age; counts change between decisions
        for e in edges:
            r = rng.random()
            if r < 0.3:
                e.scrape = _scrape(rng, now - rng.random())  # fresh
            elif r < 0.4:
                e.scrape = _scrape(rng, now - 5.0)  # stale: only what it says about the edge counts
            e.outstanding = rng.randint(0, 4)
            e.last_sent = now - 3 * rng.random()
            e.healthy = rng.random() < 0.8
            e.cooldown_until = now + (1.0 if rng.random() < 0.3 else -1.0)
            if rng.random() < 0.05:
                e.scrape = None  # a restarted edge: back to the router's defaults
        exclude = rng.sample(range(len(edges)), 2)
        ok = [i for i, e in enumerate(edges) if e.healthy and i not in exclude]
        want_pool = [i for i in ok if not edges[i].cooling(now)] or ok  # healthy, not tried, cooling last
        pool = table.routable(now, exclude)
        assert (pool is None and not ok) or list(np.flatnonzero(pool)) == want_pool
        for rows in (sorted(rng.sample(range(len(edges)), 8)), list(range(len(edges))), want_pool):
            got = table.columns(rows, stale_after, now)
            want = fleet.columns_from_views([edges[i].view(routing, stale_after, now) for i in rows])
            assert got.names == want.names
            for field in fleet.Columns.__dataclass_fields__:
                if field != "names":
                    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
        now += 1.0
