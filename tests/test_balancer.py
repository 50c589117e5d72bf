"""The workload balancer on synthetic load reports (pure function, no Flower)."""

import math
import random

import pytest

from collm.common.protocol import LoadReport
from collm.server.balancer import BALANCERS, BalancerParams, balance, capacity, uniform, water_fill

P = BalancerParams(target_attainment=0.95, round_deadline_s=120.0, round_token_budget=20000,
                   min_edge_tokens=256, spare_use=0.8, fill_budget=False)


def edge(name, *, spare=0.9, attain=0.99, queue=0.0, n=100, gain=1.0, tps=100.0, rate=1.0):
    return LoadReport(name=name, request_rate=rate, slo_attainment=attain, spare_capacity=spare,
                      queue_depth=queue, running=0, train_examples=n, gain_per_ktok=gain, train_tokens_per_s=tps)


def by_name(decisions):
    return {d.name: d for d in decisions}


def test_busy_edge_gets_less_training_than_idle_one():
    d = by_name(balance([edge("idle", spare=0.9), edge("busy", spare=0.1)], P))
    assert d["idle"].take_part and d["busy"].take_part
    assert d["busy"].budget_tokens < d["idle"].budget_tokens
    # both are capacity-bound here (Σ cap < B): each gets its own cap c·s·u·D
    assert d["busy"].budget_tokens == int(100 * 0.1 * 0.8 * 120)
    assert d["idle"].budget_tokens == int(100 * 0.9 * 0.8 * 120)
    assert "spare 0.10" in d["busy"].reason and "cap 960" in d["busy"].reason


def test_queue_shrinks_capacity():
    assert capacity(edge("q", queue=3), P) == pytest.approx(capacity(edge("q"), P) / 4)


def test_edge_below_slo_target_gets_no_training_when_the_gate_is_set():
    d = by_name(balance([edge("ok"), edge("slow", attain=0.91)], P))
    assert not d["slow"].take_part and d["slow"].budget_tokens == 0
    assert d["slow"].reason == "below SLO target: attainment 0.91 < 0.95"
    assert d["ok"].take_part


def test_without_the_gate_a_busy_edge_trains_in_its_spare_time():
    ungated = BalancerParams(None, 120.0, 20000, 256, 0.8, False)
    d = by_name(balance([edge("ok"), edge("slow", attain=0.5, spare=0.3)], ungated))
    assert d["slow"].take_part and d["slow"].budget_tokens == int(100 * 0.3 * 0.8 * 120)


def test_unknown_attainment_is_eligible_and_no_data_is_not():
    d = by_name(balance([edge("fresh", attain=None), edge("empty", n=0)], P))
    assert d["fresh"].take_part
    assert not d["empty"].take_part and "no local training examples" in d["empty"].reason


def test_total_respects_round_budget():
    reports = [edge(f"e{i}", spare=1.0, tps=1000.0, n=100 + 37 * i, gain=1.0 + 0.2 * i) for i in range(6)]
    d = balance(reports, P)
    total = sum(x.budget_tokens for x in d)
    assert all(x.take_part for x in d)
    assert P.round_token_budget - len(d) <= total <= P.round_token_budget
    assert all(x.deadline_s == P.round_deadline_s for x in d)


def test_unsaturated_edges_get_shares_proportional_to_weight():
    reports = [edge("a", n=100), edge("b", n=200), edge("c", n=300)]
    params = BalancerParams(0.95, 120.0, 6000, 256, 0.8, False)   # caps (8640 each) do not bind
    d = by_name(balance(reports, params))
    assert [d[k].budget_tokens for k in "abc"] == [1000, 2000, 3000]


def test_leftovers_of_a_capped_edge_go_to_the_others():
    reports = [edge("capped", n=300, spare=0.05), edge("b", n=100), edge("c", n=300)]
    params = BalancerParams(0.95, 120.0, 6000, 256, 0.8, False)
    d = by_name(balance(reports, params))
    cap = 100 * 0.05 * 0.8 * 120                         # 480 < its proportional share 3600
    assert d["capped"].budget_tokens == int(cap)
    rest = 6000 - cap                                    # split 1:3 between b and c
    assert d["b"].budget_tokens == int(rest / 4)
    assert d["c"].budget_tokens == int(rest * 3 / 4)


def test_unknown_gain_uses_mean_of_known_gains():
    reports = [edge("lo", gain=1.0), edge("hi", gain=3.0), edge("new", gain=None)]
    params = BalancerParams(0.95, 120.0, 6000, 256, 0.8, False)
    d = by_name(balance(reports, params))
    assert d["new"].weight == pytest.approx(2.0 * 100)
    assert [d[k].budget_tokens for k in ("lo", "new", "hi")] == [1000, 2000, 3000]


def test_all_gains_unknown_splits_by_examples():
    reports = [edge("a", gain=None, n=100), edge("b", gain=None, n=300)]
    params = BalancerParams(0.95, 120.0, 4000, 256, 0.8, False)
    d = by_name(balance(reports, params))
    assert (d["a"].budget_tokens, d["b"].budget_tokens) == (1000, 3000)


def test_plateaued_edge_still_gets_something():
    reports = [edge("learning", gain=2.0), edge("flat", gain=0.0), edge("worse", gain=-0.5)]
    params = BalancerParams(0.95, 120.0, 20000, 10, 0.8, False)
    d = by_name(balance(reports, params))
    assert d["flat"].take_part and d["worse"].take_part
    assert 0 < d["flat"].budget_tokens < d["learning"].budget_tokens


def test_share_below_minimum_sits_out_and_tokens_are_redistributed():
    reports = [edge("big", n=1000), edge("small", n=5)]
    params = BalancerParams(0.95, 120.0, 5000, 256, 0.8, False)   # small's share ≈ 25 tokens
    d = by_name(balance(reports, params))
    assert not d["small"].take_part and "< minimum 256" in d["small"].reason
    assert d["big"].budget_tokens == 5000


def test_no_spare_capacity_means_no_training():
    d = by_name(balance([edge("full", spare=0.0), edge("ok")], P))
    assert not d["full"].take_part and "cap 0 tokens" in d["full"].reason


def test_water_fill_is_the_kkt_solution():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        w = {i: rng.uniform(0.1, 10) for i in range(n)}
        cap = {i: rng.uniform(0, 5000) for i in range(n)}
        budget = rng.uniform(0, 20000)
        x = water_fill(w, cap, budget)
        assert sum(x.values()) == pytest.approx(min(budget, sum(cap.values())), rel=1e-9, abs=1e-6)
        assert all(-1e-9 <= x[i] <= cap[i] + 1e-9 for i in range(n))
        free = [i for i in range(n) if x[i] < cap[i] - 1e-6]
        if free:  # one level θ for every unsaturated edge; saturated ones have cap ≤ θ·w
            theta = x[free[0]] / w[free[0]]
            assert all(math.isclose(x[i] / w[i], theta, rel_tol=1e-9) for i in free)
            assert all(cap[i] <= theta * w[i] + 1e-6 for i in range(n) if i not in free)


def test_uniform_baseline_ignores_load_and_slo():
    assert BALANCERS["uniform"] is uniform and BALANCERS["slo"] is balance
    reports = [edge("a", rate=5.0, attain=0.5, spare=0.0, queue=9.0, gain=None),
               edge("b", rate=0.0, attain=None, spare=1.0, gain=None),
               edge("c", rate=0.0, attain=None, spare=1.0, gain=None, n=0)]
    p = BalancerParams(0.95, 60.0, 9000, 256, 0.8, False)
    d = {x.name: x for x in uniform(reports, p)}
    assert d["a"].take_part and d["a"].budget_tokens == d["b"].budget_tokens == 4500
    assert not d["c"].take_part


def test_fill_budget_hands_out_what_the_caps_leave_by_weight():
    from dataclasses import replace

    reports = [edge("idle", spare=0.9, gain=1.0), edge("busy", spare=0.1, gain=3.0)]
    capped = by_name(balance(reports, P))
    filled = by_name(balance(reports, replace(P, fill_budget=True)))
    left = P.round_token_budget - capped["idle"].budget_tokens - capped["busy"].budget_tokens
    assert left > 0
    # weights 1 x 100 and 3 x 100: a quarter and three quarters of what is left
    assert filled["idle"].budget_tokens == pytest.approx(capped["idle"].budget_tokens + left / 4, abs=1)
    assert filled["busy"].budget_tokens == pytest.approx(capped["busy"].budget_tokens + 3 * left / 4, abs=1)
    assert sum(d.budget_tokens for d in filled.values()) <= P.round_token_budget
    assert "of the budget the caps left" in filled["busy"].reason
    tight = replace(P, fill_budget=True, round_token_budget=5000)  # B binds: nothing is left to hand out
    assert by_name(balance(reports, tight)) == by_name(balance(reports, replace(tight, fill_budget=False)))


def test_tokens_carried_between_rounds_count_toward_an_edges_cap():
    """A busy edge (no spare time now) that trained in idle time since its last update still takes
    part: its next update sends that work, so the balancer must not sit it out."""
    busy = LoadReport(name="busy", request_rate=1.0, slo_attainment=0.99, spare_capacity=0.0, queue_depth=0.0,
                      running=1, train_examples=100, gain_per_ktok=1.0, train_tokens_per_s=100.0,
                      carried_tokens=400)
    assert capacity(busy, P) == 400
    d = by_name(balance([busy, edge("idle")], P))
    assert d["busy"].take_part and d["busy"].budget_tokens == 400 and "400 carried" in d["busy"].reason
    without = by_name(balance([LoadReport(**{**busy.__dict__, "carried_tokens": 0}), edge("idle")], P))
    assert not without["busy"].take_part


def test_an_edge_that_could_not_train_its_last_budget_gets_its_cap_but_none_of_the_leftover():
    """The load report says how much of its last budget an edge trained by the deadline; the budget the
    caps leave goes to the edges that kept up (an edge that fell short would only carry more of it)."""
    from dataclasses import replace

    fp = replace(P, fill_budget=True)
    short = LoadReport(**{**edge("short", spare=0.5).__dict__, "budget_fill": 0.6})
    kept = LoadReport(**{**edge("kept", spare=0.5).__dict__, "budget_fill": 1.0})
    d = by_name(balance([short, kept], fp))
    assert d["short"].budget_tokens == pytest.approx(d["short"].cap_tokens, abs=1)
    assert d["kept"].budget_tokens == pytest.approx(P.round_token_budget - d["short"].budget_tokens, abs=1)
    assert "trained 60% of its last budget" in d["short"].reason
    unknown = by_name(balance([edge("a", spare=0.5), edge("b", spare=0.5)], fp))  # no history: both share it
    assert unknown["a"].budget_tokens == unknown["b"].budget_tokens
    both_short = by_name(balance([short, LoadReport(**{**short.__dict__, "name": "short2"})], fp))
    assert sum(x.budget_tokens for x in both_short.values()) == pytest.approx(2 * d["short"].cap_tokens, abs=2)


def test_the_load_report_carries_share_and_budget_fill_over_the_wire():
    r = LoadReport(**{**edge("e").__dict__, "train_share": 0.35, "budget_fill": 0.8})
    back = LoadReport.from_record("e", r.to_record())
    assert back.train_share == pytest.approx(0.35) and back.budget_fill == pytest.approx(0.8)
    assert LoadReport.from_record("e", edge("e").to_record()).budget_fill is None  # unknown stays unknown
    hostile = LoadReport.from_record("e", {**r.to_record(), "train-share": 1e30, "budget-fill": float("nan")})
    assert hostile.train_share == 1.0 and hostile.budget_fill is None


def test_every_load_report_key_has_its_own_bounds():
    from collm.common.protocol import REPORT_BOUNDS

    assert set(REPORT_BOUNDS) == set(LoadReport.keys())  # a renamed field must not fall back to +-1e12


@pytest.mark.parametrize("huge", [{"gain-per-ktok": 1e300, "train-examples": 1e10},
                                  {"gain-per-ktok": 1e308}, {"train-tokens-per-s": 1e308, "carried-tokens": 1e308},
                                  {"gain-per-ktok": -1e308, "queue-depth": 1e308}])
def test_a_report_with_huge_finite_values_cannot_break_the_balancer(huge):
    """A finite 1e300 passed the non-finite filter and overflowed the weights to inf, then NaN shares (the
    ServerApp ended on int(nan)); every value is now clamped to a range no honest edge leaves."""
    hostile = LoadReport.from_record("evil", {**edge("evil", spare=0.5).to_record(), **huge})
    decisions = balance([hostile, edge("a", spare=0.5), edge("b", spare=0.5)], P)
    assert all(d.budget_tokens >= 0 for d in decisions)
    assert sum(d.budget_tokens for d in decisions) <= P.round_token_budget + len(decisions)
    assert all(math.isfinite(d.weight) and math.isfinite(d.cap_tokens) for d in decisions)


# ------------------------------------------------------------------------------ partial participation
def test_participants_wanted_counts_as_flower_does_with_a_floor():
    from collm.server.balancer import participants_wanted

    assert participants_wanted(10, 0.25, 1) == 2      # int(10 x 0.25)
    assert participants_wanted(3, 0.2, 1) == 1        # the minimum
    assert participants_wanted(2, 0.5, 3) == 2        # never more than are available
    assert participants_wanted(5, 1.0, 1) == 5


def test_choose_participants_rotates_and_skips_an_edge_too_busy_to_use_a_slot():
    from collm.server.balancer import choose_participants

    reports = [edge("a", spare=0.5), edge("b", spare=0.9), edge("c", spare=0.9, gain=3.0),
               edge("busy", spare=0.001), edge("nodata", n=0)]
    everyone, none_left = choose_participants(reports, P, 5, {})
    assert everyone == reports and none_left == {}
    # never trained first; among them the largest expected gain (gain x cap): c, then b, then a
    chosen, left = choose_participants(reports, P, 2, {})
    assert [r.name for r in chosen] == ["b", "c"]     # in the reports' order
    assert set(left) == {"a", "busy", "nodata"} and "trained last never" in left["a"]
    # c and b trained: a (never) comes first, then the one that trained longer ago
    chosen, left = choose_participants(reports, P, 2, {"c": 2, "b": 1})
    assert [r.name for r in chosen] == ["a", "b"] and "in round 2" in left["c"]
    # busy (cap ~10 tokens < min_edge_tokens) and nodata go last, even though they never trained
    chosen, _ = choose_participants(reports, P, 3, {"a": 3, "b": 3, "c": 3})
    assert {r.name for r in chosen} == {"a", "b", "c"}


def test_the_learning_rate_starts_at_lr_decays_a_step_at_a_time_and_stops_at_its_floor():
    from collm.server.lr_schedule import round_lr

    assert [round_lr(2e-3, 0.8, 5e-4, r) for r in (1, 2, 3)] == pytest.approx([2e-3, 1.6e-3, 1.28e-3])
    assert round_lr(2e-3, 0.8, 5e-4, 50) == 5e-4           # the floor: the federation never stops adapting
    assert [round_lr(1e-3, 1.0, 0.0, r) for r in (1, 7)] == [1e-3, 1e-3]  # no decay: the old fixed rate
    with pytest.raises(ValueError, match="step must be 1 or more"):
        round_lr(1e-3, 0.8, 0.0, 0)
