"""The co-scheduling rule as a pure function, and layer-granular preemption of background passes."""

import math
import time

import pytest
import torch
from helpers import prompt, tiny_engine

from collm.edge_client.engine.co_schedule import RequestSlack, allowance, pick_microbatch
from collm.edge_client.engine.preemption import Preempted, preemptible
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.trainer import TrainBudget

KW = dict(step_s=0.05, step_token_budget=100, default_ttft_slo=2.0, new_arrival_prefill_s=0.2, safety=0.8)


def test_idle_replica_is_bounded_by_a_new_arrival_only():
    a = allowance(10.0, [], **KW)
    assert a.binding == "new-arrival"
    assert a.seconds == pytest.approx(0.8 * 2.0 - 0.2 - 0.05)
    # with layer preemption an arrival waits for one layer of background work, not all of it
    assert allowance(10.0, [], n_layers=30, **KW).seconds == pytest.approx(30 * (0.8 * 2.0 - 0.25))


def test_decoding_request_slack_grows_with_tokens():
    # first token at t=9, 10 tokens out, TPOT target 0.2 s: budget 0.8*0.2*10 = 1.6 s, used 1.0 s
    r = RequestSlack(arrival=8.5, first_token_at=9.0, tokens_out=10, ttft_slo=2.0, tpot_slo=0.2, prefill_left=0)
    a = allowance(10.0, [r], n_layers=30, **KW)
    assert a.binding == "tpot" and a.seconds == pytest.approx(1.6 - 1.0 - 0.05)
    just_started = RequestSlack(9.9, 9.95, 1, 2.0, 0.2, 0)
    assert allowance(10.0, [just_started], n_layers=30, **KW).seconds < 0.2


def test_waiting_requests_queue_up_their_prefill():
    # two waiting requests of 150 prompt tokens each; the second needs ceil(300/100)=3 steps
    w1 = RequestSlack(9.0, None, 0, 2.0, 0.2, 150)
    w2 = RequestSlack(9.5, None, 0, 2.0, 0.2, 150)
    a = allowance(10.0, [w2, w1], n_layers=30, **KW)
    assert a.binding == "ttft"
    assert a.seconds == pytest.approx(min(1.6 - 1.0 - 2 * 0.05, 1.6 - 0.5 - 3 * 0.05))


def test_pick_microbatch():
    opts = [("k2", 1.0), ("k1", 0.5), ("cut", 0.2)]
    assert pick_microbatch(opts, allowance_s=2.0) == "k2"
    assert pick_microbatch(opts, allowance_s=0.6) == "k1"
    assert pick_microbatch(opts, allowance_s=0.1) is None
    # arrivals every 0.3 s: prefer what likely finishes before the next one
    assert pick_microbatch(opts, allowance_s=2.0, arrival_gap_s=0.3) == "cut"
    assert pick_microbatch([("k2", 1.0)], allowance_s=2.0, arrival_gap_s=0.3) == "k2"
    assert math.isinf(allowance(0.0, [], **{**KW, "default_ttft_slo": float("inf")}).seconds)


def test_preempted_training_pass_leaves_no_partial_gradients():
    eng = tiny_engine(start=False)
    job = eng.trainer.job(TrainBudget(steps=1))
    job.start()
    option = job.options()[0]
    calls = {"n": 0}

    def stop_in_backward():
        calls["n"] += 1
        return calls["n"] > len(eng.runner.layers) + 1  # all forward checks pass, then stop

    with pytest.raises(Preempted), preemptible(eng.runner.layers, stop_in_backward):
        job.run(option)
    assert all(p.grad is None for p in eng.trainer.adapter.parameters())
    assert job.report.microbatches == 0
    queued = [e.input_ids for e in eng.trainer.stream.peek(option.k)]
    job.run(option)  # the same micro-batch runs again, complete
    assert job.report.microbatches == 1
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in eng.trainer.adapter.parameters())
    assert [e.input_ids for e in eng.trainer.stream.peek(option.k)] != queued


def test_arrival_preempts_a_long_background_pass():
    """A request arriving during training waits about one layer of it, not the whole micro-batch."""
    eng = tiny_engine(start=False, training={"micro_batch_size": 1, "grad_accum_steps": 1})

    def slow_layer(module, args):  # make each layer of a *training* pass take 0.1 s, like a big model
        if torch.is_grad_enabled():
            time.sleep(0.1)

    for layer in eng.runner.layers:
        layer.register_forward_pre_hook(slow_layer)
    eng.start()
    try:
        job = eng.train(TrainBudget(steps=10_000, deadline_s=30))
        time.sleep(0.5)  # training now runs back to back (each micro-batch >= 0.2 s)
        ttfts = []
        for _ in range(3):
            ttfts.append(eng.generate(prompt(eng, "hello"), SamplingParams(max_tokens=2, temperature=0)).record.ttft_s)
            time.sleep(0.15)
        assert eng.telemetry.totals["preemptions"] >= 1
        assert max(ttfts) < 0.15, ttfts  # at most one slow layer, not a 0.2+ s micro-batch
        assert eng.telemetry.totals["train_microbatches"] >= 1  # and training still progressed
    finally:
        eng.stop()
        job.cancel()


def test_preemption_hooks_are_removed():
    eng = tiny_engine(start=False)
    with preemptible(eng.runner.layers, lambda: False):
        pass
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        eng.lm.model(ids)
    assert all(not layer._forward_hooks for layer in eng.runner.layers)


def test_naive_mode_trains_regardless_of_slack():
    """The colocated-naive baseline: the same fixed costs that make CoLLM defer make it train anyway."""
    from collm.edge_client.engine.cost_model import FixedCosts

    eng = tiny_engine(costs=FixedCosts(step_s=0.01, train_s=5.0), engine={"warmup": False},
                      training={"co_schedule": "naive"})
    try:
        rep = eng.train(TrainBudget(steps=2)).result(timeout=60)
        assert rep.steps == 2 and rep.deferrals == 0
    finally:
        eng.stop()
