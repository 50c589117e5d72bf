"""The co-execution rule as a pure function over plain data, and the engine living by it."""

import threading
import time

import pytest
import torch
from helpers import prompt, tiny_engine

from collm.common.errors import UserError
from collm.edge_client.config import FeedbackConfig
from collm.edge_client.engine.co_schedule import (BusyWindow, Naive, RequestSlack, ServingLoad, SlackFeedback,
                                                  WorkConserving, allowance, make_policy)
from collm.edge_client.engine.controller import RequestOutcome, SlackController
from collm.edge_client.engine.cost_model import FixedCosts
from collm.edge_client.engine.requests import FinishEvent, TokenEvent
from collm.edge_client.model.lora import TrainingBinding, bind
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.jobs import TrainBudget
from collm.edge_client.training.layerwise import HEAD_CHUNK_TOKENS, LayerwisePass
from collm.edge_client.training.trainer import collate

def decoding(now):
    """A request half a second into its decode, 20 tokens out: plenty of TPOT slack."""
    return RequestSlack(arrival=now - 1.0, first_token_at=now - 0.5, tokens_out=20, ttft_slo=2.0, tpot_slo=0.2,
                        prefill_left=0)


def load(now=10.0, running=0, waiting=0, prefill_left=0, step_s=0.01, requests=None):
    reqs = tuple(requests if requests is not None else ([decoding(now)] * running))
    return ServingLoad(now, running, waiting, prefill_left, step_s, reqs, step_token_budget=100, safety=0.8)


# ------------------------------------------------------------------ the rule, pure
def test_idle_replica_trains_back_to_back():
    p = WorkConserving()
    assert all(p.verdict(load(now=10.0 + i), unit_s=5.0).run for i in range(20))
    assert p.verdict(load(), 5.0).reason == "idle"


def test_nothing_runs_while_requests_wait_or_prefill():
    p = WorkConserving(busy_share=1.0, margin=0.0)
    assert p.verdict(load(running=1, waiting=1), 0.001).reason == "serving-first"
    assert p.verdict(load(running=1, prefill_left=40), 0.001).reason == "serving-first"
    assert not p.verdict(load(waiting=3), 0.001).run  # waiting but not yet admitted counts too


def test_busy_time_is_off_by_default():
    v = WorkConserving().verdict(load(running=1), 0.001)
    assert not v.run and v.reason == "busy-share-off"


def test_bucket_refuses_when_spent_and_resumes_when_accrued():
    p = WorkConserving(busy_share=0.5, margin=0.1, window_s=10.0)
    for t in range(10):  # serving took 2 of the last 10 s: rho = 0.2
        p.observe_step(t + 1.0, 0.2)
    assert p.window.rho(10.0) == pytest.approx(0.2)
    assert p.verdict(load(now=10.0, running=1), 0.05).reason == "bucket"  # nothing accrued yet
    # the bucket fills at 0.5 - rho - 0.1 = 0.2 s per s: after 0.5 s it holds 0.1 s
    v = p.verdict(load(now=10.5, running=1), 0.05)
    assert v.run and v.reason == "busy-share" and p.bucket == pytest.approx(0.1, rel=0.05)
    p.spent(0.1)
    assert p.verdict(load(now=10.5, running=1), 0.05).reason == "bucket"  # spent: refused ...
    assert p.verdict(load(now=11.0, running=1), 0.05).run                 # ... until it accrues again


def test_busy_replica_accrues_nothing():
    p = WorkConserving(busy_share=0.5, margin=0.1, window_s=10.0)
    for t in range(200):
        p.observe_step(t * 0.1 + 0.1, 0.1)  # serving back to back: rho = 1
    p.verdict(load(now=20.0, running=1), 0.001)
    assert p.verdict(load(now=20.0, running=1), 0.001).reason == "bucket" and p.bucket == 0.0


def test_per_step_cap_and_slack_guard():
    p = WorkConserving(busy_share=1.0, margin=0.0, gamma=0.5, bucket_max_s=10.0)
    p.verdict(load(now=0.0, running=1), 0.0)
    p.verdict(load(now=10.0, running=1), 0.0)  # an idle window: the bucket is full
    # cap: 0.5 x 0.8 x 0.2 - 0.01 = 0.07 s
    assert p.verdict(load(now=10.0, running=1), 0.08).reason == "per-step-cap"
    # slack: first token at 9.5, 1 token out: 0.8 x 0.2 x 1 - 0.5 - 0.01 < 0
    late = RequestSlack(9.0, 9.5, 1, 2.0, 0.2, 0)
    assert p.verdict(load(now=10.0, running=1, requests=[late]), 0.05).reason == "slack"
    assert p.verdict(load(now=10.0, running=1), 0.05).run


def test_naive_runs_whole_passes_regardless():
    p = Naive()
    assert p.whole_passes and p.verdict(load(running=4, waiting=9, prefill_left=500), 99.0).run


def test_busy_window_clips_the_oldest_step():
    w = BusyWindow(10.0)
    w.record(5.0, 10.0)  # a 10 s step from -5 to 5
    assert w.rho(5.0) == pytest.approx(1.0)   # window [-5, 5]: all of it
    assert w.rho(10.0) == pytest.approx(0.5)  # window [0, 10]: its last 5 s
    assert w.rho(15.0) == 0.0


def test_policy_is_chosen_by_config():
    from helpers import tiny_config

    assert isinstance(make_policy(tiny_config().training), WorkConserving)
    assert isinstance(make_policy(tiny_config(training={"co_schedule": "naive"}).training), Naive)


def test_slack_guard_formula():
    r = RequestSlack(arrival=8.5, first_token_at=9.0, tokens_out=10, ttft_slo=2.0, tpot_slo=0.2, prefill_left=0)
    a = allowance(10.0, [r], step_s=0.05, step_token_budget=100, safety=0.8)
    assert a.binding == "tpot" and a.seconds == pytest.approx(0.8 * 0.2 * 10 - 1.0 - 0.05)
    w1 = RequestSlack(9.0, None, 0, 2.0, 0.2, 150)
    w2 = RequestSlack(9.5, None, 0, 2.0, 0.2, 150)  # needs ceil(300 / 100) = 3 steps
    a = allowance(10.0, [w2, w1], step_s=0.05, step_token_budget=100, safety=0.8)
    assert a.binding == "ttft" and a.seconds == pytest.approx(min(1.6 - 1.0 - 2 * 0.05, 1.6 - 0.5 - 3 * 0.05))


# ------------------------------------------------------------------ the controller, pure (fake clock)
def served(tpot, ttft=0.5):
    """A finished request with these latencies against targets of 3 s TTFT and 0.4 s TPOT."""
    return RequestOutcome(ttft, tpot, 3.0, 0.4)


def decode_load(now, requests=()):
    return ServingLoad(now, max(1, len(requests)), 0, 0, 0.1, tuple(requests), 256, 0.8)


def feed(c, t0, n, tpot, bucket_binds=True):
    """n periods from t0: one finished request and (if asked) a bucket refusal per second; returns the end."""
    for i in range(n):
        t = t0 + i
        c.observe(t, served(tpot(c.f) if callable(tpot) else tpot))
        if bucket_binds:
            c.note_refusal("bucket")
        c.update(decode_load(t + 0.5))
    return t0 + n


def test_controller_grows_while_slack_is_high_and_the_bucket_binds_and_stops_at_f_max():
    c = SlackController(FeedbackConfig(f_max=0.5))
    feed(c, 0.0, 100, tpot=0.1)  # slack 0.75: grow, 0.03 per period, up to f_max
    assert c.f == pytest.approx(0.5) and c.action == "up" and c.slack == pytest.approx(0.75)


def test_controller_does_not_grow_when_something_other_than_the_bucket_refuses():
    c = SlackController(FeedbackConfig())
    t = feed(c, 0.0, 30, tpot=0.1, bucket_binds=False)  # slack, but the guards (or nothing) refuse: no wind-up
    assert c.f == 0.0
    for i in range(30):  # per-step cap refusals outnumber the bucket's
        c.observe(t + i, served(0.1))
        c.note_refusal("bucket")
        c.note_refusal("per-step-cap")
        c.note_refusal("slack")
        c.update(decode_load(t + i + 0.5))
    assert c.f == 0.0 and c.action == "hold"


def test_controller_holds_in_the_dead_band_and_steps_down_below_it():
    c = SlackController(FeedbackConfig(window_requests=5, min_requests=3))  # the p90 of 5 is their slowest
    c.f = 0.4
    t = feed(c, 0.0, 20, tpot=0.3)  # TPOT 0.3 s: slack 0.25, inside [0.2, 0.3]
    assert c.f == pytest.approx(0.4) and c.action == "hold"
    feed(c, t, 5, tpot=0.34)  # slack 0.15 < 0.2: down by 0.03 a period
    assert c.f == pytest.approx(0.4 - 5 * 0.03) and c.action == "down"


def test_a_miss_at_the_percentile_halves_the_share_and_holds_growth():
    c = SlackController(FeedbackConfig())
    c.f = 0.6
    t = feed(c, 0.0, 10, tpot=0.1)
    f0 = c.f
    t = feed(c, t, 3, tpot=0.6)  # 3 over the target: from the second one on the p90 misses: halved each period
    assert c.action == "cut-miss" and c.f <= (f0 + 0.03) / 4 + 1e-9  # (one more step up before the p90 saw it)
    f1 = c.f
    feed(c, t, 9, tpot=0.1)  # fast again: the misses still set the p90 until they leave the 20, and growth
    assert c.f <= f1 + 1e-9  # waits out the cool-down


def test_a_long_wait_or_a_shed_request_cuts_at_once():
    c = SlackController(FeedbackConfig())
    c.f = 0.4
    feed(c, 0.0, 10, tpot=0.1)
    f0 = c.f
    waiting = RequestSlack(arrival=9.0, first_token_at=None, tokens_out=0, ttft_slo=3.0, tpot_slo=0.4,
                           prefill_left=50)
    c.update(decode_load(11.0, [waiting]))  # waited 2 s > 0.5 x 3 s
    assert c.action == "cut-wait" and c.f == pytest.approx(f0 / 2)
    c.observe(11.5, RequestOutcome(None, None, 3.0, 0.4, shed=True))
    c.update(decode_load(12.5))
    assert c.action == "cut-shed" and c.f == pytest.approx(f0 / 4)


def test_the_load_gate_closes_near_saturation_whatever_the_latencies_and_reopens_below_resume():
    c = SlackController(FeedbackConfig(rho_max=0.85, rho_resume=0.8))
    t = feed(c, 0.0, 20, tpot=0.1)  # plenty of slack: f grew
    assert c.f > 0.3
    for i, (rho, action) in enumerate([(0.9, "load-gate"), (0.82, "load-gate"), (0.79, "up"), (0.84, "up")]):
        c.observe(t + i, served(0.1))
        c.note_refusal("bucket")
        c.update(decode_load(t + i + 0.5), rho=rho)
        assert c.action == action, (rho, c.action)
    assert c.f == pytest.approx(0.06)  # from 0 after the gate: two steps up
    p = SlackFeedback(FeedbackConfig(period_s=1.0, min_requests=1, cool_s=0), window_s=10.0)
    for i in range(200):  # serving back to back: rho = 1, the gate stays shut however fast requests are
        p.observe_step(i * 0.1 + 0.1, 0.1)
        if i >= 100 and i % 10 == 0:
            p.observe_request(i * 0.1, served(0.01))
            p.verdict(decode_load(i * 0.1 + 0.1, [decoding(i * 0.1 + 0.1)]), unit_s=5.0)
    assert p.share == 0.0 and p.controller.action == "load-gate"


def test_stale_measurements_fall_back_to_the_idle_rule_not_to_training_flat_out():
    c = SlackController(FeedbackConfig(window_s=10.0, stale_s=30.0))
    c.f = 0.5
    t = feed(c, 0.0, 10, tpot=0.1)
    for i in range(25):  # no traffic: no evidence; the share holds for stale_s ...
        c.update(decode_load(t + i))
    assert c.f > 0 and c.action == "no-evidence"
    for i in range(25, 100):  # ... then falls to 0 (idle time only)
        c.update(decode_load(t + i))
    assert c.f == 0.0 and c.action == "stale" and c.slack is None


def test_in_flight_requests_count_by_their_latency_so_far():
    c = SlackController(FeedbackConfig(min_requests=2))
    c.f = 0.3
    feed(c, 0.0, 5, tpot=0.1)
    slow = RequestSlack(arrival=0.0, first_token_at=1.0, tokens_out=2, ttft_slo=3.0, tpot_slo=0.4, prefill_left=0)
    c.update(decode_load(6.0, [slow] * 10))  # 10 in flight at 2.5 s per token: the p90 misses before they finish
    assert c.action == "cut-miss"


def test_a_queue_neither_dilutes_the_tpot_percentile_nor_fills_the_bucket():
    c = SlackController(FeedbackConfig(min_requests=2, queue_cut=1.0))
    c.f = 0.3
    t = feed(c, 0.0, 5, tpot=0.39)  # TPOT at 97% of its target
    queued = [RequestSlack(arrival=t - 0.1, first_token_at=None, tokens_out=0, ttft_slo=3.0, tpot_slo=0.4,
                           prefill_left=50)] * 60  # 60 requests before their first token have no TPOT yet
    c.update(decode_load(t + 1.0, queued))
    assert c.action == "down"  # counted as TPOT 0 they would have made the p90 0 and the slack 1
    p = SlackFeedback(FeedbackConfig(min_requests=1))
    p.controller.f = 0.8
    for i in range(50):
        p.verdict(load(now=10.0 + 0.1 * i, running=1, waiting=2), unit_s=0.01)
    assert p.bucket == 0.0  # a queue earns training no time beside serving


def test_the_loop_settles_inside_the_dead_band_on_a_plant_and_never_misses():
    """TPOT = 0.1 s x (1 + 4 f) (a decode step stretched by the training beside it): the band [0.2, 0.3] of
    slack against 0.4 s is f in [0.45, 0.55]; AIMD gets there from 0 and stays, every request within target."""
    c = SlackController(FeedbackConfig())
    plant = lambda f: 0.1 * (1 + 4 * f)  # noqa: E731
    seen = []
    t = 0.0
    for i in range(300):
        tp = plant(c.f)
        seen.append(tp)
        c.observe(t, served(tp))
        c.note_refusal("bucket")
        c.update(decode_load(t + 0.5))
        t += 1
    assert 0.4 <= c.f <= 0.6
    assert max(seen) <= 0.4
    tail = [plant(f) for f in [c.f]]
    assert 0.2 <= 1 - tail[0] / 0.4 <= 0.35


def test_slo_feedback_policy_trains_beside_decodes_only_as_far_as_its_share():
    p = SlackFeedback(FeedbackConfig(period_s=1.0, min_requests=1, cool_s=0))
    for i in range(20):  # fast requests and a bucket that refuses: f grows
        p.observe_request(float(i), served(0.05))
        p.verdict(decode_load(i + 0.5, [decoding(i + 0.5)]), unit_s=5.0)
    assert p.share > 0.3
    assert p.verdict(decode_load(20.5, [decoding(20.5)]), unit_s=0.01).reason == "busy-share"
    assert p.verdict(load(now=21.0, running=1, waiting=1), 0.001).reason == "serving-first"


def test_an_evaluation_gets_its_floor_where_training_gets_nothing_and_training_cannot_spend_it():
    p = SlackFeedback(FeedbackConfig(period_s=1.0, min_requests=1, cool_s=0), eval_share=0.2)
    for i in range(10):  # requests near their TPOT target: the controller grants training nothing
        p.observe_request(float(i), served(0.39))
        assert p.verdict(decode_load(i + 0.5, [decoding(i + 0.5)]), unit_s=0.05).reason == "bucket"
    assert p.share == 0.0
    p.verdict(decode_load(10.0, [decoding(10.0)]), 0.05, "eval")
    v = p.verdict(decode_load(10.5, [decoding(10.5)]), 0.05, "eval")  # 0.5 s at 0.2: 0.1 s accrued
    assert v.run and v.reason == "busy-share" and p.share == 0.0  # the controller's share is untouched
    p.spent(0.05)
    assert p.verdict(decode_load(10.5, [decoding(10.5)]), 0.08, "eval").reason == "bucket"  # the floor is a rate
    assert p.verdict(decode_load(10.5, [decoding(10.5)]), 0.01, "train").reason == "bucket"  # not training's
    # the floor passes the same guards as training: the per-step cap (0.8 x 0.2 - 0.1) and serving first
    p.verdict(decode_load(20.0, [decoding(20.0)]), 0.01, "eval")
    assert p.verdict(decode_load(25.0, [decoding(25.0)]), 0.07, "eval").reason == "per-step-cap"
    assert p.verdict(decode_load(25.0, [decoding(25.0)]), 0.05, "eval").run
    assert p.verdict(load(now=25.0, running=1, waiting=1), 0.001, "eval").reason == "serving-first"
    off = SlackFeedback(eval_share=0.0)
    off.verdict(decode_load(10.0, [decoding(10.0)]), 0.01, "eval")
    assert off.verdict(decode_load(15.0, [decoding(15.0)]), 0.01, "eval").reason == "bucket"  # 0: no floor


def test_without_a_floor_evaluation_and_training_share_one_bucket_as_before():
    p = WorkConserving(busy_share=0.5, margin=0.0, window_s=10.0)  # rho 0: fills at 0.5 s per s
    p.verdict(load(now=10.0, running=1), 0.01, "train")
    assert p.verdict(load(now=11.0, running=1), 0.05, "eval").run  # an evaluation spends what training accrued
    p.spent(0.05)
    assert p.verdict(load(now=11.0, running=1), 0.05, "train").run and p.bucket == pytest.approx(0.45)


def test_a_fixed_share_of_zero_still_lets_the_evaluation_floor_through_and_reports_no_share():
    p = WorkConserving(busy_share=0.0, eval_share=0.5, window_s=10.0)
    assert p.verdict(load(now=10.0, running=1), 0.01, "train").reason == "busy-share-off"
    p.verdict(load(now=10.0, running=1), 0.01, "eval")
    assert p.verdict(load(now=11.0, running=1), 0.05, "eval").run and p.share == 0.0
    assert p.verdict(load(now=11.0, running=1), 0.01, "train").reason == "busy-share-off"


def test_a_controller_setting_out_of_range_is_a_one_line_error_naming_it():
    from helpers import tiny_config

    with pytest.raises(UserError, match="slack_low"):
        tiny_config(training={"feedback": {"slack_low": 0.4, "slack_high": 0.3}})
    with pytest.raises(UserError, match="f_max"):
        tiny_config(training={"feedback": {"f_max": 1.5}})
    with pytest.raises(UserError, match="eval_share"):
        tiny_config(training={"eval_share": 1.5})
    with pytest.raises(UserError, match="eval_share .* naive"):
        tiny_config(training={"eval_share": 0.3, "co_schedule": "naive"})
    with pytest.raises(UserError, match="busy_share .* work_conserving"):  # a fixed share the controller would ignore
        tiny_config(training={"busy_share": 0.3})
    assert isinstance(make_policy(tiny_config().training), SlackFeedback)  # the default
    assert make_policy(tiny_config().training).eval_share == 0.25  # the evaluation's floor is on by default
    naive = tiny_config(training={"co_schedule": "naive"}).training  # the default floor does not stand in
    assert isinstance(make_policy(naive), Naive) and naive.eval_share == 0.0  # naive's way, only one set (above)
    assert type(naive).model_validate(naive.model_dump()) == naive  # and it reads back as it was written


# ------------------------------------------------------------------ units of a micro-batch
def test_layerwise_gradients_equal_one_monolithic_backward():
    eng = tiny_engine(start=False)
    t = eng.trainer
    with torch.no_grad():
        for b in t.adapter.b:
            b.normal_(0, 0.1)  # a non-zero B, so every LoRA gradient is non-trivial
    ids, mask, labels = collate(t.stream.peek(2), t.pad_id, eng.device)
    params = list(t.adapter.parameters())
    with bind(TrainingBinding(t.adapter)):
        logits = eng.lm.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        ref = torch.autograd.grad(loss, params)
    p = LayerwisePass(eng.parts, ids, mask, labels, TrainingBinding(t.adapter), t.layer_params, head_chunk=5)
    units = 0
    while not p.done:
        p.run_unit()
        units += 1
    n = len(eng.parts.layers)
    assert units == n + -(-p.answer_tokens // 5) + n  # forward per layer, head chunks, backward per layer
    assert p.loss_sum == pytest.approx(loss.item(), rel=1e-5)
    for q, r in zip(params, ref):
        torch.testing.assert_close(p.grads[id(q)], r, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ the engine living by the rule
def test_training_holds_while_a_request_runs_and_resumes_after():
    eng = tiny_engine()
    try:
        job = eng.train(TrainBudget(steps=10_000, deadline_s=60))
        tokens, units = [], {}
        done = threading.Event()

        def on_event(ev):
            if isinstance(ev, TokenEvent):
                tokens.append(ev.index)
                if len(tokens) in (5, 40):
                    units[len(tokens)] = eng.telemetry.totals["background_units"]
            elif isinstance(ev, FinishEvent):
                done.set()

        time.sleep(0.3)
        assert eng.telemetry.totals["background_units"] > 0  # idle: training ran
        eng.submit(prompt(eng, "hello"), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), on_event)
        assert done.wait(30)
        assert units[5] == units[40]  # not one unit while the request decoded
        after = eng.telemetry.totals["background_units"]
        time.sleep(0.3)
        assert eng.telemetry.totals["background_units"] > after  # idle again: training resumed
        assert eng.telemetry.totals["deferrals"] > 0
    finally:
        eng.end_jobs()
        eng.stop()


def test_an_arrival_waits_one_unit_and_the_micro_batch_resumes_not_recomputes():
    eng = tiny_engine(start=False, training={"micro_batch_size": 1, "grad_accum_steps": 1})

    def slow_layer(module, args):  # each layer of a *training* pass takes 0.1 s, like a big model
        if torch.is_grad_enabled():
            time.sleep(0.1)

    for layer in eng.parts.layers:
        layer.register_forward_pre_hook(slow_layer)
    eng.start()
    n = len(eng.parts.layers)
    first_two = eng.trainer.stream.peek(2)  # the micro-batches the job will run, in order
    want_units = sum(2 * n + -(-sum(1 for lab in e.labels[1:] if lab != -100) // HEAD_CHUNK_TOKENS)
                     for e in first_two)
    try:
        job = eng.train(TrainBudget(steps=2, deadline_s=60))
        time.sleep(0.05)  # the first forward unit (0.1 s) is running now
        ttft = eng.generate(prompt(eng, "hello"), SamplingParams(max_tokens=2, temperature=0)).record.ttft_s
        assert ttft < 0.2, ttft  # at most one slow unit, not the whole micro-batch (>= 0.2 s of forward)
        rep = job.result(timeout=60)
        assert rep.microbatches == 2 and rep.steps == 2
        assert rep.units == want_units  # every unit ran once: the interrupted micro-batch was resumed, not redone
    finally:
        eng.stop()


def test_naive_mode_trains_whole_micro_batches_during_serving():
    eng = tiny_engine(training={"co_schedule": "naive"})
    try:
        job = eng.train(TrainBudget(steps=10_000, deadline_s=60))
        before = eng.telemetry.totals["train_microbatches"]
        eng.generate(prompt(eng, "hi"), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        assert eng.telemetry.totals["train_microbatches"] - before >= 20  # one after (nearly) every step
        assert eng.snapshot().window.training_beside_serving_frac > 0  # it shared time with the request
    finally:
        eng.end_jobs()
        eng.stop()


def test_busy_share_trains_between_decodes_within_its_budget():
    eng = tiny_engine(costs=FixedCosts(step_s=0.001, unit_s=0.001), engine={"warmup": False},
                      training={"co_schedule": "work_conserving", "busy_share": 1.0, "busy_margin": 0.0})
    try:
        job = eng.train(TrainBudget(steps=10_000, deadline_s=60))
        seen = {}

        def on_event(ev):
            if isinstance(ev, TokenEvent) and ev.index in (5, 60):
                seen[ev.index] = eng.telemetry.totals["background_units"]

        eng.submit(prompt(eng, "hi"), SamplingParams(max_tokens=80, temperature=0, ignore_eos=True), on_event)
        deadline = time.time() + 30
        while 60 not in seen and time.time() < deadline:
            time.sleep(0.01)
        assert seen[60] > seen[5]  # units ran between the decode steps of a running request
    finally:
        eng.end_jobs()
        eng.stop()
