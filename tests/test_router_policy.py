"""The router's routing rule on synthetic edge states (pure functions, no processes)."""

import math
import random
from dataclasses import replace
from collections import Counter

import pytest

from collm.router.policy import (Assumptions, EdgeView, RequestView, choose, edge_load, estimate, policy_now)

COEF = (0.003, 0.0005, 2e-5, 0.0015)  # about what the tiny model measures on a CPU


def idle(name, **kw):
    base = dict(outstanding=0, outstanding_at=0, queue_depth=0, running=0, max_running=8, step_coef=COEF,
                ttft_target_s=1.0, tpot_target_s=0.1)
    return EdgeView(name, **{**base, **kw})


X = RequestView(prompt_tokens=100, max_tokens=64)
STRICT = Assumptions(comfort=1.0)  # no "comfortable" near-ties: only edges within tie_margin of the best


def test_idle_edge_estimate_is_one_prefill_step_and_one_decode_step():
    est = estimate(idle("a"), X)
    c0, c1, c2, c3 = COEF
    ctx = 100 + 32
    assert est.ttft_s == pytest.approx(c0 + c2 * 100 + c3 * 100 / 1000)
    assert est.tpot_s == pytest.approx(c0 + c1 + c3 * ctx / 1000)
    assert est.slack == pytest.approx(min(1 - est.ttft_s / 1.0, 1 - est.tpot_s / 0.1))
    assert 0.9 < est.slack < 1


def test_queued_edge_is_avoided_and_wait_grows_with_the_queue():
    a = Assumptions(typical_output_tokens=64)
    waits = [estimate(idle("a", running=8, queue_depth=q), X, a).ttft_s for q in (0, 8, 16)]
    assert waits[0] < waits[1] < waits[2]
    # (w + 1)/M * L * t_dec(M): one more wave of 8 requests costs L decode steps at batch 8
    c0, c1, _, c3 = COEF
    t_dec8 = c0 + c1 * 8 + c3 * 8 * 132 / 1000
    assert waits[1] - waits[0] == pytest.approx(8 / 8 * 64 * t_dec8)
    edges = [idle("busy", running=8, queue_depth=16), idle("b"), idle("c")]
    picks = Counter(choose("slo", edges, X, random.Random(s)).edge for s in range(50))
    assert picks["busy"] == 0 and picks["b"] > 10 and picks["c"] > 10


def test_a_queue_drains_at_the_edges_finish_rate_while_it_serves_not_over_its_whole_window():
    """The finish-rate guard on the wait: an edge that finished lam = 1 request/s over a window it spent
    40% serving drains a queue at 2.5/s once busy (a burst after a calm stretch); a saturated edge (no
    spare time) at lam. Read over the whole window, the burst's wait came out 2-2.5x the TTFT it got."""
    a = Assumptions(typical_output_tokens=64)
    c0, c1, _, c3 = COEF
    model_departure = 64 * (c0 + c1 * 8 + c3 * 8 * 132 / 1000) / 8  # the cost model's, about 0.07 s
    calm = idle("a", running=8, queue_depth=4, finish_rate=1.0, spare_capacity=0.6)
    saturated = replace(calm, spare_capacity=0.0)
    unscraped = replace(calm, finish_rate=0.0)
    bare = estimate(unscraped, X, a).ttft_s
    assert model_departure < 0.4
    assert estimate(calm, X, a).ttft_s - bare == pytest.approx(5 * (0.4 - model_departure))
    assert estimate(saturated, X, a).ttft_s - bare == pytest.approx(5 * (1.0 - model_departure))
    # routing.drain_rate: window, the rule before: 1/lam whatever the edge did with its window
    window = Assumptions(typical_output_tokens=64, drain_per_serving_s=False)
    assert estimate(calm, X, window).ttft_s - bare == pytest.approx(5 * (1.0 - model_departure))
    # an edge that spent (nearly) none of its window serving counts 5% of it: 0.05 / 0.1 per departure
    rare = replace(calm, spare_capacity=1.0, finish_rate=0.1)
    assert estimate(rare, X, a).ttft_s - bare == pytest.approx(5 * (0.5 - model_departure))


def test_requests_sent_since_the_scrape_count_as_load():
    # the last scrape saw an idle edge, but this router has sent it 12 requests since (none done)
    e = idle("a", outstanding=12, outstanding_at=0)
    assert edge_load(e) == 12
    assert estimate(e, X).ttft_s > estimate(idle("b"), X).ttft_s
    # requests that finished since the scrape are no longer counted: scrape saw 5 (all ours), 2 are left
    assert edge_load(idle("c", running=5, outstanding=2, outstanding_at=5)) == 2
    # no fresh scrape: only the router's own in-flight requests
    assert edge_load(EdgeView("d", outstanding=3)) == 3
    picks = {choose("slo", [e, idle("b")], X, random.Random(s)).edge for s in range(20)}
    assert picks == {"b"}


def test_training_edge_is_avoided_while_others_have_room_and_used_when_they_do_not():
    train = idle("train", training_active=True, training_busy=0.8, spare_capacity=0.9)
    est = estimate(train, X)
    bare = estimate(idle("x"), X)
    # g = 1 + 0.8 / 0.1 = 9: serving stretched, but never past the co-scheduler's s * P
    assert est.tpot_s == pytest.approx(min(bare.tpot_s * 9, 0.8 * 0.1))
    assert est.slack < bare.slack - 0.05
    assert {choose("slo", [train, idle("b")], X, random.Random(s), a=STRICT).edge for s in range(20)} == {"b"}
    loaded = idle("b", running=8, queue_depth=30)
    assert {choose("slo", [train, loaded], X, random.Random(s), a=STRICT).edge for s in range(20)} == {"train"}
    # training nearly all the time: TPOT planned up to s * P, too close to the target to be comfortable
    busy = idle("train", training_active=True, training_busy=0.9, spare_capacity=0.95, running=4)
    assert estimate(busy, X).tpot_s == pytest.approx(0.08) and estimate(busy, X).slack < 0.5
    assert {choose("slo", [busy, idle("b")], X, random.Random(s)).edge for s in range(20)} == {"b"}


def test_request_slo_override_takes_precedence_over_the_edge_targets():
    e = idle("a", running=8, queue_depth=8)
    default = estimate(e, X)
    tight = estimate(e, RequestView(100, 64, ttft_target_s=0.05, tpot_target_s=0.02))
    assert default.ttft_target_s == 1.0 and tight.ttft_target_s == 0.05 and tight.tpot_target_s == 0.02
    assert tight.slack < 0 < default.slack
    # edges with different default targets: the override makes them comparable on the request's terms
    loose = idle("loose", ttft_target_s=10.0, tpot_target_s=1.0, running=8, queue_depth=4)
    strict = idle("strict", ttft_target_s=0.5, tpot_target_s=0.05)
    strict_best = Assumptions(tie_margin=0.0, comfort=1.0)
    # 0.35 s of queueing is little against loose's own 10 s target ...
    assert choose("slo", [loose, strict], X, random.Random(0), a=strict_best).edge == "loose"
    # ... and a lot against the request's 0.5 s
    y = RequestView(100, 64, ttft_target_s=0.5, tpot_target_s=0.05)
    assert choose("slo", [loose, strict], y, random.Random(0), a=strict_best).edge == "strict"


def test_near_ties_use_two_choices_on_outstanding_and_spread_over_idle_edges():
    edges = [idle("a", outstanding=3, running=3, outstanding_at=3), idle("b"), idle("c")]
    # a looks nearly as good by slack (within the tie margin) but has more in flight
    picks = Counter(choose("slo", edges, X, random.Random(s)).edge for s in range(300))
    assert picks["a"] == 0  # a is in every sampled pair it loses
    d = choose("slo", edges, X, random.Random(1))
    assert d.why.startswith("p2c among 3")
    same = [idle(n) for n in "abc"]
    picks = Counter(choose("slo", same, X, random.Random(s)).edge for s in range(300))
    assert all(picks[n] > 60 for n in "abc"), picks


def test_tie_margin_zero_picks_the_strict_best():
    edges = [idle("a", running=2), idle("b", running=1), idle("c", running=3)]
    d = choose("slo", edges, X, random.Random(0), a=Assumptions(tie_margin=0.0, comfort=1.0))
    assert d.edge == "b" and d.why == "best"


def test_comfortable_edges_are_all_near_ties():
    """An edge whose (maybe stale) cost model makes it look 3x slower still gets traffic while it meets
    the SLOs with room to spare, so its model is refreshed; once slack gets tight the rule is strict."""
    slow = idle("slow", step_coef=tuple(3 * c for c in COEF))
    fast = idle("fast")
    assert 0.5 < estimate(slow, X).slack < estimate(fast, X).slack - 0.05
    picks = Counter(choose("slo", [slow, fast], X, random.Random(s)).edge for s in range(100))
    assert picks["slow"] > 20 and picks["fast"] > 20
    assert {choose("slo", [slow, fast], X, random.Random(s), a=STRICT).edge for s in range(20)} == {"fast"}
    tight = RequestView(100, 64, tpot_target_s=0.02)  # the request's own target: now the difference matters
    assert estimate(slow, tight).slack < 0.5
    assert {choose("slo", [slow, fast], tight, random.Random(s)).edge for s in range(20)} == {"fast"}


def test_when_every_edge_misses_the_least_bad_is_chosen():
    edges = [idle("a", running=8, queue_depth=200), idle("b", running=8, queue_depth=100)]
    ests = {e.name: estimate(e, X) for e in edges}
    assert ests["a"].slack < ests["b"].slack < 0
    assert choose("slo", edges, X, random.Random(0)).edge == "b"


def test_long_prompt_needs_several_prefill_chunks():
    short = estimate(idle("a"), RequestView(100, 16), Assumptions(step_token_budget=128))
    long_ = estimate(idle("a"), RequestView(1000, 16), Assumptions(step_token_budget=128))
    assert long_.ttft_s > 7 * short.ttft_s


def test_baselines():
    edges = [idle("a", outstanding=2), idle("b", outstanding=0), idle("c", outstanding=1)]
    assert [choose("round_robin", edges, X, random.Random(0), counter=i).edge for i in range(4)] == list("abca")
    assert choose("least_outstanding", edges, X, random.Random(0)).edge == "b"
    with pytest.raises(ValueError, match="unknown policy"):
        choose("fastest", edges, X, random.Random(0))
    with pytest.raises(ValueError):
        choose("slo", [], X, random.Random(0))


def test_an_idle_edge_left_out_too_long_is_probed():
    """A stale, pessimistic cost model would starve an idle edge forever: it gets a probe now and then."""
    a = Assumptions(probe_after_s=5.0)
    stale = idle("stale", step_coef=(0.05, 0.02, 0.001, 0.5))  # fit while overloaded; idle now
    fresh = idle("fresh")
    assert estimate(stale, X).slack < 0.5
    assert choose("slo", [stale, fresh], X, random.Random(0), a=a).edge == "fresh"
    probe = choose("slo", [replace(stale, unused_s=6.0), fresh], X, random.Random(0), a=a)
    assert probe.edge == "stale" and probe.why == "probe"
    # never an edge with work on it (its estimate is not stale, it is busy), nor an edge that is near-best
    busy = replace(stale, unused_s=60.0, running=1)
    assert choose("slo", [busy, fresh], X, random.Random(0), a=a).edge == "fresh"
    near = choose("slo", [replace(fresh, name="f2", unused_s=60.0), fresh], X, random.Random(0), a=a)
    assert near.why.startswith("p2c")


def test_an_edges_exported_step_budget_and_safety_override_the_assumptions():
    a = Assumptions(step_token_budget=512, slo_safety=0.8)
    x = RequestView(1000, 16)
    own = estimate(idle("a"), x, a)
    small_chunks = estimate(EdgeView("a", 0, step_token_budget=64), x, a)
    assert small_chunks.ttft_s > own.ttft_s  # 1000 prompt tokens in chunks of 64, not 512
    busy = EdgeView("a", 3, queue_depth=0, running=3, training_active=True, training_busy=0.9, spare_capacity=0.1)
    loose = estimate(replace(busy, slo_safety=1.0), x, a)
    assert loose.tpot_s > estimate(busy, x, a).tpot_s  # training may stretch TPOT up to s*P


def test_admission_refuses_exactly_when_the_soonest_ttft_misses_the_target():
    import random as _random

    from collm.router.policy import unattainable

    a = Assumptions(step_token_budget=256, slo_safety=0.8, typical_output_tokens=32)
    coef = (0.01, 0.002, 2e-4, 0.001)
    x = RequestView(100, 32)
    seen = set()
    for q in range(0, 200):
        views = [EdgeView("busy", 0, 0, 30.0, 16.0, 16, coef, 2.0, 0.2),
                 EdgeView("calm", 0, 0, float(q), 16.0, 16, coef, 2.0, 0.2)]
        d = choose("slo", views, x, _random.Random(0), a=a)
        soonest = min((estimate(v, x, a) for v in views), key=lambda e: e.ttft_s)
        assert d.soonest == soonest
        assert unattainable(d) == (soonest.ttft_s > 2.0)
        assert unattainable(d, margin=1.1) == (soonest.ttft_s > 2.2)  # routing.admission_margin
        seen.add((unattainable(d), unattainable(d, margin=1.1)))
    assert seen == {(True, True), (True, False), (False, False)}  # the sweep crosses both lines
    assert choose("round_robin", views, x, _random.Random(0)).soonest is None  # the baselines never refuse


def _metrics(**gauges) -> str:
    from collm.common import metric_names as M

    lines = [f"{M.QUEUE_DEPTH} 0", f"{M.RUNNING} 1", f"{M.MAX_RUNNING} 8", f"{M.SLO_TTFT} 1.0", f"{M.SLO_TPOT} 0.1",
             f"{M.SPARE_CAPACITY} 0.7", f"{M.TRAINING_ACTIVE} 1"]
    lines += [f'{M.STEP_COST}{{term="{t}"}} {c}' for t, c in zip(M.STEP_COST_TERMS, COEF)]
    lines += [f"{getattr(M, k)} {v}" for k, v in gauges.items()]
    return "\n".join(lines) + "\n"


def test_a_scrape_with_a_non_finite_gauge_is_refused_by_name():
    """An edge publishing +Inf (or NaN) where routing reads a number is not routed on: the router keeps
    its own counts for it (the poller logs the gauge's name)."""
    from collm.common import metric_names as M
    from collm.router.state import scrape_from_metrics

    text = _metrics().replace(f'{M.STEP_COST}{{term="{M.STEP_COST_TERMS[2]}"}} {COEF[2]}',
                              f'{M.STEP_COST}{{term="{M.STEP_COST_TERMS[2]}"}} +Inf')
    with pytest.raises(KeyError, match=M.STEP_COST):
        scrape_from_metrics(text, at=0.0, outstanding_at=0)
    assert scrape_from_metrics(_metrics(), at=0.0, outstanding_at=0).step_coef == tuple(float(c) for c in COEF)


def test_idle_time_training_does_not_count_as_stretching_serving():
    """An edge that trains only in its idle time (the default rule) serves at its bare step cost; the
    stretch g counts only training beside serving. Counting all of it made a lightly loaded edge look
    1/rho times slower, and the router sent every request to whichever edge was not training."""
    from collm.router.state import scrape_from_metrics

    s = scrape_from_metrics(_metrics(TRAINING_BUSY=0.6, TRAINING_BESIDE_SERVING=0.0), at=0.0, outstanding_at=0)
    assert s.training_busy == 0.0
    older = scrape_from_metrics(_metrics(TRAINING_BUSY=0.6), at=0.0, outstanding_at=0)  # an edge without the gauge
    assert older.training_busy == 0.6
    trains = idle("trains", running=1, training_active=True, training_busy=s.training_busy, spare_capacity=0.7)
    serves = idle("serves", running=2, spare_capacity=0.5)  # not training, a little busier
    assert estimate(trains, X).tpot_s == pytest.approx(estimate(idle("x", running=1), X).tpot_s)
    picks = Counter(choose("slo", [trains, serves], X, random.Random(k)).edge for k in range(40))
    assert picks["trains"] > 10  # both are candidates (before: every request went to "serves")
    stretched = replace(trains, training_busy=older.training_busy)
    assert {choose("slo", [stretched, serves], X, random.Random(k), a=STRICT).edge for k in range(20)} == {"serves"}


def test_among_equally_loaded_edges_the_one_that_trains_less_gets_the_request():
    """At low load both edges are empty: the request goes where it costs no training; load still
    comes first (an edge with a request in flight loses to an idle one that trains)."""
    trains = idle("trains", training_active=True, training_share=0.9)
    rests = idle("rests", training_active=True, training_share=0.1)
    assert {choose("slo", [trains, rests], X, random.Random(k)).edge for k in range(20)} == {"rests"}
    busy = replace(rests, outstanding=1)
    assert {choose("slo", [trains, busy], X, random.Random(k)).edge for k in range(20)} == {"trains"}


def test_slo_pack_gathers_a_light_load_on_one_edge_and_spreads_once_it_lacks_room():
    """slo_pack: among edges with room (slack >= pack_slack, spare >= pack_spare) the one already serving
    gets the next request, so the other trains in idle time; `slo` spreads them by power of two choices."""
    serving, empty = idle("serving", running=1, spare_capacity=0.7), idle("empty", spare_capacity=1.0)
    packed = Counter(choose("slo_pack", [serving, empty], X, random.Random(s)).edge for s in range(50))
    spread = Counter(choose("slo", [serving, empty], X, random.Random(s)).edge for s in range(50))
    assert packed == {"serving": 50}
    assert spread["empty"] == 50  # fewer requests in flight wins the p2c tie-break
    full = replace(serving, spare_capacity=0.2)  # serving 80% of its time: no room to gather more
    a = Assumptions(pack_spare=0.3)  # (the default, 0, gathers regardless of spare capacity)
    assert Counter(choose("slo_pack", [full, empty], X, random.Random(s), a=a).edge for s in range(50)) == {"empty": 50}
    assert Counter(choose("slo_pack", [full, empty], X, random.Random(s)).edge for s in range(50)) == {"serving": 50}
    tight = Assumptions(pack_slack=0.999)  # no edge has that much slack: spread
    spread = Counter(choose("slo_pack", [serving, empty], X, random.Random(s), a=tight).edge for s in range(50))
    assert spread == {"empty": 50}
    assert choose("slo_pack", [serving, empty], X, random.Random(0)).why == "pack among 2"


def test_pack_free_slot_never_gathers_a_request_into_the_queue_of_a_full_batch():
    """routing.pack_free_slot (the default): a gathered edge whose batch is full (n >= M) still looks roomy when
    its queue drains fast, and slo_pack without the option queues the request there while the other edge has a
    free slot. With it, it gathers only where the request runs at once; below a full batch it gathers as before."""
    fast = (0.001, 0.0001, 0.00001, 0.0)  # a queue of one waits ~1 ms: slack stays near 1
    full = idle("full", running=2, max_running=2, step_coef=fast)
    other = idle("other", running=1, max_running=2, step_coef=fast)
    into_queue = Assumptions(pack_free_slot=False)
    assert estimate(full, X).slack >= into_queue.pack_slack  # roomy by slack alone
    assert Counter(choose("slo_pack", [full, other], X, random.Random(s), a=into_queue).edge
                   for s in range(20)) == {"full": 20}
    assert Assumptions().pack_free_slot
    assert Counter(choose("slo_pack", [full, other], X, random.Random(s)).edge for s in range(20)) == {"other": 20}
    below = replace(full, running=1)  # the same edge one request short of full: gathered as before
    assert Counter(choose("slo_pack", [below, other], X, random.Random(s)).edge for s in range(20)) \
        == Counter(choose("slo_pack", [below, other], X, random.Random(s), a=into_queue).edge for s in range(20))


def test_pack_newest_gathers_on_the_edge_that_serves_the_newest_global():
    """routing.pack_newest: among edges with room the one serving the newest global version gets the light
    load even while the other holds more requests, so after a round the edge that swapped first serves and
    the other drains (and evaluates in idle time); equal versions fall back to the most requests; an edge
    that exports no version ranks below one that does. Without it the version does not count."""
    from collm.router.state import scrape_from_metrics

    assert scrape_from_metrics(_metrics(ADAPTER_VERSION=4), at=0.0, outstanding_at=0).adapter_version == 4.0
    assert math.isnan(scrape_from_metrics(_metrics(), at=0.0, outstanding_at=0).adapter_version)  # not exported
    newest = Assumptions()  # pack_newest is the default
    old = idle("old", running=2, spare_capacity=0.6, adapter_version=3.0)
    new = idle("new", running=0, spare_capacity=1.0, adapter_version=4.0)
    assert {choose("slo_pack", [old, new], X, random.Random(s), a=newest).edge for s in range(30)} == {"new"}
    assert {choose("slo_pack", [old, new], X, random.Random(s), a=Assumptions(pack_newest=False)).edge
            for s in range(30)} == {"old"}
    assert {choose("slo_pack", [old, replace(new, adapter_version=3.0)], X, random.Random(s), a=newest).edge
            for s in range(30)} == {"old"}
    assert {choose("slo_pack", [replace(old, adapter_version=None), replace(new, adapter_version=0.0)], X,
                   random.Random(s), a=newest).edge for s in range(30)} == {"new"}
    cramped = replace(new, spare_capacity=0.1)  # the newest has no room (pack_spare): the version does not count
    assert {choose("slo_pack", [old, cramped], X, random.Random(s), a=replace(newest, pack_spare=0.3)).edge
            for s in range(30)} == {"old"}


def test_a_gated_slo_pack_gathers_only_while_the_measured_slack_reaches_the_gate():
    """routing.pack_gate: slo_pack gathers while the router's recent first tokens show at least that much
    TTFT slack (or too few to tell: light load) and spreads as slo below it; other policies and an
    ungated slo_pack are never changed."""
    serving, empty = idle("serving", running=1, spare_capacity=0.7), idle("empty", spare_capacity=1.0)

    def picks(slack):
        return Counter(choose(policy_now("slo_pack", slack, 0.5), [serving, empty], X, random.Random(s)).edge
                       for s in range(30))

    assert picks(None) == picks(0.5) == picks(0.9) == {"serving": 30}
    assert picks(0.49) == picks(-1.0) == {"empty": 30}  # spread: fewer requests in flight wins
    assert policy_now("slo_pack", -5.0, None) == "slo_pack"
    assert [policy_now(p, -5.0, 0.5) for p in ("slo", "round_robin", "least_outstanding")] == \
        ["slo", "round_robin", "least_outstanding"]


def test_the_routers_settings_reach_the_rule_by_name():
    """Every routing setting arrives in the rule's Assumptions under its own name, in the router
    process (a positional call once gave pack_slack the probe interval, 5 s, so
    slo_pack never gathered, and probed idle edges after pack_spare's 0.3 s)."""
    from collm.common.config import validate_config
    from collm.router.app import create_app
    from collm.router.config import RouterConfig

    routing = dict(step_token_budget=128, edge_slo_safety=0.7, typical_output_tokens=20, tie_margin=0.02,
                   comfort=0.4, probe_after_s=7.0, pack_slack=0.55, pack_spare=0.05, pack_newest=False,
                   pack_free_slot=False, policy="slo_pack")
    cfg = validate_config(RouterConfig, {"edges": [{"name": "e0", "url": "http://127.0.0.1:1"}],
                                         "routing": routing}, "test")
    a = create_app(cfg).state.router.assumptions()
    assert (a.step_token_budget, a.slo_safety, a.typical_output_tokens, a.tie_margin, a.comfort, a.probe_after_s,
            a.pack_slack, a.pack_spare, a.pack_newest, a.pack_free_slot) == (128, 0.7, 20.0, 0.02, 0.4, 7.0, 0.55,
                                                                             0.05, False, False)
    serving, empty = idle("serving", running=1, spare_capacity=0.1), idle("empty", spare_capacity=1.0)
    assert choose("slo_pack", [serving, empty], X, random.Random(0), a=a).edge == "serving"  # spare 0.1 >= 0.05


def test_learn_output_moves_l_toward_what_finished_and_ignores_nothing_learned():
    """L, the output length per departure in the wait term, moves a tenth of the way to each finished
    request's output; a reply without a usable count (None, 0, negative) leaves it as it was."""
    from collm.router.policy import learn_output
    assert learn_output(64.0, 4) == pytest.approx(58.0)
    assert learn_output(64.0, None) == learn_output(64.0, 0) == learn_output(64.0, -5) == 64.0
    assert learn_output(64.0, 10**310) == learn_output(64.0, 10**7) == learn_output(64.0, 3.5) == 64.0  # an edge's word
    typical = 64.0
    for _ in range(100):
        typical = learn_output(typical, 12)
    assert typical == pytest.approx(12.0, abs=0.01)
