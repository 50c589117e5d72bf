"""collm-sim: CoLLM's own policy code on simulated edges (collm/sim).

Deterministic cost profiles (a hand-written profile with no noise) pin the mechanics; the same
policy objects are shown to steer both a real engine and the simulator; a 2-edge run of a fixed
trace is reproducible bit for bit; `collm-edge --profile` writes a profile the simulator loads.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from collm.common.config import load_config
from collm.common.data import chat_prompt_ids
from collm.common.errors import UserError
from collm.common.traces import TraceRequest
from collm.edge_client.config import EdgeConfig
from collm.edge_client.engine import co_schedule
from collm.edge_client.model.loading import load_model
from collm.router.requests import ROLE_MARKER_TOKENS
from collm.sim import edge as sim_edge
from collm.sim.config import SimConfig
from collm.sim.profile import SCHEMA, EdgeProfile, from_dict, load_profile, shipped
from collm.sim.run import simulate
from collm.sim.world import World

ROOT = Path(__file__).resolve().parents[1]


TEMPLATE = 10  # fixed_profile's chat template tokens


def fixed_profile(**kw) -> EdgeProfile:
    """Step = 10 ms + 5 ms per decoding sequence + 1 ms per prefill token; a 1 s training micro-batch
    of 100 tokens in 10 units; a 0.5 s evaluation micro-batch of 4 records in 5 units; no noise; a chat
    template of TEMPLATE tokens around each prompt."""
    p = EdgeProfile("fixed", (0.010, 0.005, 0.001, 0.0), 0.0, 0.0, max_running=4, step_token_budget=64,
                    max_context=512, max_queue=64, train_tokens=100, train_s=1.0, train_units=10,
                    eval_tokens=200, eval_s=0.5, eval_units=5, eval_batch=4, template_tokens=TEMPLATE)
    return dataclasses.replace(p, **kw)


def cfg(**kw) -> SimConfig:
    base = {"ttft_ms": 1000, "tpot_ms": 100, "warmup_s": 0.0, "federation": {"round_deadline_s": 5,
            "round_token_budget": 2000}, "network": {"exchange_s": 0.1}, "load": {"drain_s": 0}}
    base.update(kw)
    return SimConfig.model_validate(base)


def world(c: SimConfig, mode: str, n: int = 2, profile: EdgeProfile | None = None, seed: int = 0) -> World:
    return World(c, mode, [profile or fixed_profile()] * n, seed)


def test_one_request_alone_costs_its_prefill_then_one_step_per_token():
    c = cfg()
    w = world(c, "serve-only", 1)
    w.run([[TraceRequest(0.0, 30, 5)]], 0.0, 0.0)
    (s,) = w.out
    prompt = 30 + TEMPLATE  # the edge prefills its chat template's tokens too
    prefill = 0.010 + 0.001 * prompt  # one step: the prompt fits the 64-token budget
    assert s.ttft_s == pytest.approx(prefill + c.network.rtt_s)
    assert s.tpot_s == pytest.approx(0.015)  # 4 decode steps of one sequence
    assert s.met and s.status == "length"


def test_each_edge_prefills_its_own_models_chat_template():
    """A trace counts the message alone; the edge's model wraps it in its chat template (profile
    `model.chat_template_tokens`), so an edge with a longer template takes longer to the first token."""
    c = cfg()
    ttft = {}
    for template in (0, 30):
        w = world(c, "serve-only", 1, fixed_profile(template_tokens=template))
        w.run([[TraceRequest(0.0, 20, 3)]], 0.0, 0.0)
        ttft[template] = w.out[0].ttft_s
    assert ttft[0] == pytest.approx(0.010 + 0.001 * 20 + c.network.rtt_s)
    assert ttft[30] - ttft[0] == pytest.approx(0.030)  # 1 ms per prefill token


def test_decode_runs_fast_forwarded_equal_step_by_step(monkeypatch):
    """Fast-forwarding a decode run (one event up to the next finish, cut by arrivals) gives the
    same per-request times as stepping one step at a time."""
    c = cfg()
    reqs = [TraceRequest(0.03 * i, 10 + 7 * (i % 5), 3 + i % 9) for i in range(60)]

    def times():
        w = world(c, "serve-only", 2)
        w.run([reqs], 0.0, 0.0)
        return sorted((s.index, s.status, round(s.ttft_s, 9), round(s.tpot_s, 9)) for s in w.out)

    fast = times()
    monkeypatch.setattr(sim_edge.SimEdge, "_start_serving", _one_step_at_a_time)
    slow = times()
    assert fast == slow and len(fast) == 60 and {s for _, s, _, _ in fast} == {"length"}


def _one_step_at_a_time(self, now):
    segs, prefilling, shape = self.core.plan()
    by_slot = {r.slot: r for r in self.running}
    dt = self.p.step_s(shape.decode, shape.prefill, shape.attended)
    self.act = (sim_edge.STEP, now, now + dt, (segs, prefilling, by_slot, dt))
    self._schedule(now + dt)


def test_an_idle_edge_trains_back_to_back_and_an_arrival_waits_only_for_the_unit_in_flight():
    c = cfg(federation={"round_deadline_s": 100, "round_token_budget": 100_000, "rounds": 1})
    w = world(c, "collm", 1)
    # the round's job starts after the QUERY exchange (0.1 s); a request arrives at 2.05 s
    w.run([[TraceRequest(2.05, 10, 2)]], 0.0, 0.0)
    (s,) = w.out
    e = w.edges[0]
    # units of 0.1 s from 0.1 s: the unit in flight ends at 2.1 s, then the request is served
    prefill = 0.010 + 0.001 * (10 + TEMPLATE)
    assert s.ttft_s == pytest.approx(0.05 + prefill + c.network.rtt_s)
    assert e.train_tokens == 200  # two whole micro-batches by 2.1 s; the third one's first unit waits, kept
    assert e.core.job is not None and e.core.job.unit_in_mb == 0 and e.beside_s == 0.0


def test_a_load_point_counts_only_the_micro_batches_completed_inside_it():
    """Idle training before a point runs as one fast-forwarded stretch that the point's first arrival
    cuts; the micro-batches it completed before the point started belong to the time before it (they
    were credited to the point, which made collm-sim's training optimistic after every idle gap)."""
    c = cfg(federation={"round_deadline_s": 100, "round_token_budget": 100_000, "rounds": 1})
    w = world(c, "collm", 1)
    (span,) = w.run([[TraceRequest(0.05, 10, 2)]], 5.0, 0.0)["spans"]  # 5 s of warmup, then one request
    e = w.edges[0]
    # units of 0.1 s from 0.1 s: micro-batches complete at 1.1, 2.1, 3.1, 4.1 (before the point) and
    # 5.1 (the unit in flight when the request came: inside it)
    assert e.train_tokens == 500 and span["start"] == pytest.approx(5.0)
    assert span["train_tokens"] == 100


def test_the_naive_policy_runs_a_micro_batch_after_every_step():
    c = cfg(federation={"round_deadline_s": 100, "round_token_budget": 100_000, "rounds": 1})
    w = world(c, "colocated-naive", 1)
    w.run([[TraceRequest(2.0, 10, 4)]], 0.0, 0.0)
    (s,) = w.out
    assert s.tpot_s > 0.9  # each of its decode steps waits for a whole 1 s micro-batch
    assert not s.met and w.edges[0].beside_s > 0


def test_rounds_aggregate_swap_and_quality_follows_the_curve():
    c = cfg(federation={"round_deadline_s": 3, "round_token_budget": 2000, "rounds": 3})
    w = world(c, "collm", 2)
    w.run([[TraceRequest(40.0 + i, 10, 3) for i in range(5)]], 0.0, 0.0)
    done = [r for r in w.rounds if r.aggregated_at is not None]
    assert len(done) == 3 and all(r.tokens > 0 for r in done)
    assert w.version == 3 and all(e.version.version == 3 for e in w.edges)
    losses = [r.loss for r in done]
    assert losses == sorted(losses, reverse=True) and losses[-1] == c.quality.loss(w.tokens_aggregated)
    assert {s.version for s in w.out} == {3}  # the requests came after the last swap


def test_a_rounds_evaluation_waits_for_idle_time_unless_it_has_a_floor_beside_decodes():
    """Round 1 trains in idle time; from 2 s on both edges always decode and the controller grants training
    nothing (f_max 0). Without a floor the new global is evaluated, and served, only once the stream ends;
    with training.eval_share it is served while the stream goes on."""
    stream = [TraceRequest(2.0 + 0.1 * i, 10, 20) for i in range(200)] + [TraceRequest(30.0, 10, 3)]  # 2-22 s
    swapped = {}
    for share in (0.0, 0.5):
        c = cfg(tpot_ms=400, federation={"round_deadline_s": 3, "round_token_budget": 2000, "rounds": 1},
                feedback={"f_max": 0.0}, eval_share=share)
        w = world(c, "collm", 2)
        w.run([stream], 0.0, 0.0)
        assert w.rounds[0].aggregated_at < 4.0
        swapped[share] = w.rounds[0].swapped_at
    assert swapped[0.0] > 22.0 and swapped[0.5] < 15.0, swapped  # the stream runs to 22 s


def test_isolated_trains_on_half_and_serves_the_new_global_after_reloading_it():
    c = cfg(federation={"round_deadline_s": 3, "round_token_budget": 2000, "rounds": 2})
    w = world(c, "isolated", 2)
    w.run([[TraceRequest(30.0, 10, 3)]], 0.0, 0.0)
    serve, train = w.edges
    assert serve.train_tokens == 0 and train.train_tokens > 0 and serve.busy_s > 0 and train.busy_s == 0
    assert serve.version.version == 2 and w.out[0].edge == serve.index


def test_same_policy_objects_steer_the_engine_and_the_simulator(monkeypatch):
    """Change the co-execution rule once (WorkConserving.verdict): a real engine and the simulator
    both stop training in idle time; the balancer the strategy and the simulator look up is one entry."""
    from collm.server import balancer
    from tests.helpers import tiny_engine
    from collm.edge_client.training.jobs import TrainBudget

    def sim_tokens():
        w = world(cfg(federation={"round_deadline_s": 5, "round_token_budget": 2000, "rounds": 1}), "collm", 1)
        w.run([[TraceRequest(8.0, 10, 2)]], 0.0, 0.0)
        return w.edges[0].train_tokens

    def engine_tokens():
        eng = tiny_engine()
        try:
            return eng.train(TrainBudget(tokens=200, deadline_s=1.5)).result(timeout=60).tokens
        finally:
            eng.stop()

    assert sim_tokens() > 0 and engine_tokens() > 0
    refuse = lambda self, load, unit_s, kind="train": co_schedule.Verdict(False, "busy-share-off")  # noqa: E731
    monkeypatch.setattr(co_schedule.WorkConserving, "verdict", refuse)
    assert sim_tokens() == 0 and engine_tokens() == 0

    calls = []

    def nobody(reports, params):
        calls.append(len(reports))
        return [balancer.Decision(r.name, False, 0, 0.0, "test") for r in reports]

    monkeypatch.setitem(balancer.BALANCERS, "slo", nobody)
    w = world(cfg(federation={"round_deadline_s": 2, "round_token_budget": 2000, "rounds": 1}), "collm", 2)
    w.run([[TraceRequest(5.0, 10, 2)]], 0.0, 0.0)
    assert calls == [2] and w.rounds[0].took_part == []


def test_a_two_edge_simulation_of_a_fixed_trace_is_deterministic():
    c = SimConfig.model_validate({"devices": [{"profile": "smollm2-cpu1"}], "warmup_s": 10,
                                  "federation": {"rounds": 3}})
    from collm.sim.run import load_requests
    from collm.common.traces import trace_segment

    seg = trace_segment(load_requests(c), 2.0, 60, 100)
    a = simulate(c, "collm", 2, [seg], [{"fraction": 0.7}], seed=3)
    b = simulate(c, "collm", 2, [seg], [{"fraction": 0.7}], seed=3)
    other = simulate(c, "collm", 2, [seg], [{"fraction": 0.7}], seed=4)
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k != "sim_seconds"}, sort_keys=True)  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(other)  # the seed reaches the noise and the router's draws
    assert a["points"][0]["requests"] == 120 and a["rounds_completed"] >= 1


def test_profiles_load_scale_and_refuse_bad_files(tmp_path):
    assert {"smollm2-cpu1", "tiny-load-cpu1"} <= set(shipped())
    p = load_profile("smollm2-cpu1")
    fast = load_profile("smollm2-cpu1", speed=4.0)
    assert fast.step_s(2, 0, 300) == pytest.approx(p.step_s(2, 0, 300) / 4)
    assert fast.train_s == pytest.approx(p.train_s / 4) and fast.max_running == p.max_running
    assert fast.template_tokens == p.template_tokens == 30  # SmolLM2's system prompt and role markers
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(UserError, match="expected schema"):
        load_profile(str(bad))
    with pytest.raises(UserError, match="not a shipped profile"):
        load_profile("no-such-device")
    d = json.loads((ROOT / "sim/profiles/smollm2-cpu1.json").read_text())
    del d["model"]["chat_template_tokens"]  # a profile written before it was measured: the router's guess
    assert from_dict(d, "old").template_tokens == ROLE_MARKER_TOKENS
    d["model"]["chat_template_tokens"] = "thirty"
    with pytest.raises(UserError, match="not the number"):
        from_dict(d, "x")
    d["model"]["chat_template_tokens"] = 30
    del d["engine"]["max_running"]
    with pytest.raises(UserError, match="missing field 'max_running'"):
        from_dict(d, "x")


def test_collm_edge_profile_writes_a_profile_the_simulator_runs_on(tmp_path):
    out = tmp_path / "tiny.json"
    cfg_path = tmp_path / "edge.yaml"
    cfg_path.write_text((ROOT / "configs/edge-tiny.yaml").read_text() + f"state_dir: {tmp_path / 'state'}\n")
    r = subprocess.run([sys.executable, "-m", "collm.edge_client", "--config", str(cfg_path), "--profile", str(out),
                        "--profile-reps", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["schema"] == SCHEMA and len(d["step"]["samples"]) >= 10 and d["train_microbatch"]["units"] > 1
    p = load_profile(str(out))
    # the template's tokens, as the edge's tokenizer wraps any other message
    tok = load_model(load_config(EdgeConfig, cfg_path).model).tokenizer
    other = "What is the capital of Peru?"
    assert p.template_tokens == d["model"]["chat_template_tokens"] > 0
    assert p.template_tokens == len(chat_prompt_ids(tok, other)) - len(tok.encode(other, add_special_tokens=False))
    # a step with a prefill chunk costs more than a lone decode (decode-only steps of the tiny model are too
    # close to tell apart: on some machines one decode measures slower than four, and the profile keeps that)
    assert p.step_s(4, 256, 656) > p.step_s(1, 0, 100) > 0 and p.idle_train_tokens_per_s > 0
    w = World(cfg(), "collm", [p, p], 0)
    w.run([[TraceRequest(0.5 * i, 20, 4) for i in range(10)]], 0.0, 0.0)
    assert len(w.out) == 10 and all(s.status == "length" for s in w.out)


def test_collm_sim_cli_writes_the_bench_report_and_names_bad_fields(tmp_path):
    conf = tmp_path / "sim.yaml"
    conf.write_text(f"""edges: 2
devices: [{{profile: smollm2-cpu1}}]
capacity: {{start_rate: 0.8, refine: 1, probe_s: 60, min_requests: 60}}
load: {{fractions: [0.3, 1.0], seconds: 60, min_requests: 60}}
sweep: {{fleet_sizes: [10], fractions: [0.8]}}
out: {tmp_path / 'out'}
""")
    r = subprocess.run([str(Path(sys.executable).parent / "collm-sim"), "--config", str(conf)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "out/results.json").read_text())
    assert set(res["modes"]) == {"collm", "isolated", "colocated-naive", "serve-only"}
    assert res["capacity"]["rate"] > 0 and res["ratios"]["collm/isolated"][0]["ci"][0] is not None
    assert res["sweep"][0]["edges"] == 10 and "collm/isolated" in res["sweep"][0]
    md = (tmp_path / "out/report.md").read_text()
    assert md.startswith("# collm-sim report") and "Fleet-size sweep" in md
    conf.write_text("edges: 3\nmodes: [isolated]\n")
    r = subprocess.run([str(Path(sys.executable).parent / "collm-sim"), "--config", str(conf)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "edges must be even" in r.stderr


def test_interference_charges_a_step_by_what_its_neighbour_does_and_the_mode():
    """A step beside a serving neighbour takes `slowdown` longer, beside a training one
    `background_slowdown`, and in a mode with a federation `federation_slowdown` on top."""
    inter = {"per_machine": 2, "slowdown": 0.1, "background_slowdown": 0.5, "federation_slowdown": 0.2}
    prompt = 10 + TEMPLATE
    prefill = 0.010 + 0.001 * prompt

    c = cfg(interference=inter)
    w = world(c, "serve-only", 2)  # two arrivals at once: the second step starts beside the first
    w.run([[TraceRequest(0.0, 10, 2), TraceRequest(0.0, 10, 2)]], 0.0, 0.0)
    ttfts = sorted(s.ttft_s - c.network.rtt_s for s in w.out)
    assert ttfts == pytest.approx([prefill, prefill * 1.1])

    c = cfg(interference=inter, federation={"round_deadline_s": 100, "round_token_budget": 100_000, "rounds": 1})
    w = world(c, "isolated", 2)  # the serving replica beside the trainer, which trains from 0.1 s on
    w.run([[TraceRequest(2.05, 10, 2)]], 0.0, 0.0)
    (s,) = w.out
    assert s.ttft_s - c.network.rtt_s == pytest.approx(prefill * 1.2 * 1.5)

    c = cfg(interference={**inter, "per_machine": 1})  # no neighbour: only the federation's share
    w = world(c, "collm", 1)
    w.run([[TraceRequest(0.0, 10, 2)]], 0.0, 0.0)  # before the round's QUERY (0.1 s): nothing trains yet
    (s,) = w.out
    assert s.ttft_s - c.network.rtt_s == pytest.approx(prefill * 1.2)


def test_interference_settings_are_measured_pass_with_pass():
    """benchmarks/interference.py's settings: serve-only's serving neighbour against its idle one,
    collm against serve-only, isolated's training neighbour with the federation divided out; a
    counterbalanced run's second passes are compared with each other, not with the first."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from interference import settings

    def folder(**states):  # decode batch 1 steps of these medians (ms), 20 of each
        return {"step decode 1": {st: [ms] * 20 for st, ms in states.items()}}

    run = {"serve-only": folder(idle=100, serve=110), "collm": folder(serve=121),
           "isolated": folder(background=165),
           "serve-only-pass2": folder(idle=200, serve=220), "collm-pass2": folder(serve=242),
           "isolated-pass2": folder(background=330)}
    got = {k: v for k, (v, _) in settings(run).items()}
    assert got["slowdown"] == pytest.approx(0.1)
    assert got["federation_slowdown"] == pytest.approx(0.1)  # 121/110 and 242/220; pooled would be ~0.2
    assert got["background_slowdown"] == pytest.approx(1.65 / 1.1 - 1)
    assert settings({"collm": folder(serve=1)})["slowdown"][0] is None  # nothing to compare with


def test_device_classes_take_their_precision_rank_and_uplink():
    """A class's precision scales its steps and training by the measured factors, and a round
    aggregates only once the slowest participant's update (rank x MB per rank over its uplink) is in."""
    from collm.sim.profile import PRECISION_COST

    p = fixed_profile()
    q = p.for_device("nf4", upload_s=3.0)
    step, unit = PRECISION_COST["nf4"]
    assert q.step_s(2, 0, 0) == pytest.approx(p.step_s(2, 0, 0) * step) and step > 1
    assert q.train_s == pytest.approx(p.train_s * unit) and q.upload_s == 3.0
    with pytest.raises(UserError, match="precision"):
        p.for_device("fp8")

    c = SimConfig.model_validate({"devices": [{"lora_r": 16, "uplink_mbps": 8.0}]})
    assert c.devices[0].upload_s(c.network.update_mb_per_rank) == pytest.approx(16 * 1.19)  # 19 MB at 1 MB/s

    def first_aggregation(upload_s: float) -> float:
        c = cfg(federation={"round_deadline_s": 3, "round_token_budget": 2000, "rounds": 1})
        w = world(c, "collm", 2, profile=fixed_profile(upload_s=upload_s))
        w.run([[TraceRequest(60.0, 10, 2)]], 0.0, 0.0)
        return w.rounds[0].aggregated_at

    assert first_aggregation(5.0) == pytest.approx(first_aggregation(0.0) + 5.0)


def test_the_simulated_router_assumes_what_collm_router_assumes():
    """collm-sim's router builds the rule's Assumptions from collm-router's own RoutingConfig: its
    defaults (probe an idle edge after 5 s, not never) and the sim's router settings by name."""
    from collm.router.config import RoutingConfig
    default = world(cfg(slo_safety=0.7), "collm").assumptions[0]
    assert default == RoutingConfig(edge_slo_safety=0.7).assumptions()
    assert default.probe_after_s == RoutingConfig().probe_after_s == 5.0
    a = world(cfg(router={"probe_after_s": 7.0, "pack_slack": 0.55, "pack_spare": 0.05}), "collm").assumptions[0]
    assert (a.probe_after_s, a.pack_slack, a.pack_spare) == (7.0, 0.55, 0.05)


def test_the_simulated_router_learns_the_output_length_as_collm_router_does():
    """L, the wait term's output length per departure, starts at the configured prior and follows the replies
    the router relayed, by collm-router's own `learn_output`: a sim that kept the prior (64) read a queue of
    16-token outputs four times too slow."""
    from collm.router.policy import learn_output
    w = world(cfg(), "collm")
    prior = w.assumptions[0].typical_output_tokens
    assert prior == 64
    w.run([[TraceRequest(1.0 + 2.0 * k, 10, 4) for k in range(5)]], 0.0, 0.0)
    assert [s.status for s in w.out] == ["length"] * 5
    expect = prior
    for _ in range(5):
        expect = learn_output(expect, 4)
    assert w.assumptions[0].typical_output_tokens == pytest.approx(expect)
    assert 4 < expect < 0.65 * prior  # five replies moved it 40% of the way to their 4 tokens


def test_the_simulated_router_gates_slo_pack_on_its_measured_slack_as_collm_router_does():
    """routing.pack_gate in collm-sim: the same `policy_now` over the shard's admission slack. With no first
    tokens seen, slo_pack gathers overlapping requests on one edge; after late ones (edge 429s) it spreads."""
    def edges_used(late: int) -> set[int]:
        c = cfg(collm_routing="slo_pack", router={"pack_slack": 0.0, "pack_spare": 0.0, "pack_gate": 0.5,
                                                  "admission": False, "admission_feedback": {"min_requests": 1}})
        w = world(c, "collm")
        for _ in range(late):
            w.admissions[0].shed(0.5)  # counts as a first token at twice its target
        w.run([[TraceRequest(1.0 + 0.01 * k, 10, 20) for k in range(4)]], 0.0, 0.0)
        assert len(w.out) == 4 and all(s.status == "length" for s in w.out)
        return {s.edge for s in w.out}

    assert len(edges_used(late=0)) == 1
    assert edges_used(late=3) == {0, 1}


def test_estimate_terms_probe_records_the_estimate_admission_judged_and_each_term_off():
    """benchmarks/estimate_terms.py: per routed request the soonest estimate as routed (a request the router
    refused had it past the target) and with the finish-rate guard off (never above it: the guard is a max
    over the cost model's departures), on a burst that queues and finishes requests."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from estimate_terms import VARIANTS, Probe

    c = cfg(ttft_ms=300)
    w = Probe(c, "collm", [fixed_profile()] * 2, 0)
    calm = [TraceRequest(0.5 * k, 30, 8) for k in range(20)]
    burst = [TraceRequest(10.0 + 0.01 * k, 30, 8) for k in range(60)]
    w.run([calm + burst], 0.0, 0.0)
    names = list(VARIANTS)
    routed, guard_off = names.index("as routed"), names.index("no guard")
    refused = [s for s in w.out if s.status == "refused" and s.edge < 0]
    assert refused and len(w.estimates) == len(calm) + len(burst)
    assert all(w.estimates[(s.point, s.index)][routed] > 0.3 for s in refused)
    assert all(e[guard_off] <= e[routed] + 1e-12 for e in w.estimates.values())
    assert any(e[guard_off] < e[routed] for e in w.estimates.values())  # the guard bound at least once
    assert all(g >= 1 and 0 <= b <= 1 for gb in w.stretch.values() for g, b in gb)


@pytest.mark.parametrize("over, said", [({"seed": -1}, "seed"), ({"sweep": {"fleet_sizes": [0]}}, "fleet_sizes"),
                                        ({"sweep": {"fleet_sizes": [10, 15]}}, r"sweep.fleet_sizes \(15\) must be even"),
                                        ({"load": {"fractions": [0, 0.8]}}, "load.fractions")])
def test_sim_settings_that_would_fail_late_are_config_errors(over, said):
    from collm.common.config import validate_config
    from collm.sim.config import SimConfig

    with pytest.raises(UserError, match=said):
        validate_config(SimConfig, over, "sim.yaml")
