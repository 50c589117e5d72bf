"""The replica engine on the tiny model: unmerged LoRA, shadow adapter, batching, co-scheduling."""

import threading
import time

import pytest
import torch
from helpers import base_fingerprint, prompt, random_adapter_state, tiny_engine

from collm.edge_client.engine.cost_model import FixedCosts
from collm.edge_client.engine import FinishEvent, PromptTooLong, QueueFull, TokenEvent
from collm.edge_client.model.lora import ServingBinding, bind
from collm.edge_client.model.runner import Segment
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.trainer import TrainBudget

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Name three birds.", "Why is the sky blue?",
           "Write a haiku about rain.", "How do magnets work?", "List prime numbers below 20."]


def test_runner_matches_hf_forward_with_mixed_versions_and_chunked_prefill():
    eng = tiny_engine(start=False)
    w1 = eng.layers.serving_weights(random_adapter_state(eng, 1), 1, eng.device, eng.lm.dtype)
    w2 = eng.layers.serving_weights(random_adapter_state(eng, 2), 2, eng.device, eng.lm.dtype)
    seqs = [prompt(eng, p) for p in PROMPTS[:3]]
    ws = [w1, w2, w1]

    def reference(seq, w):
        with torch.inference_mode(), bind(ServingBinding([(0, len(seq), w)])):
            return eng.lm.model(torch.tensor([seq])).logits[0, -1]

    # request 0 prefills in two chunks; 1 and 2 in one step, with two versions in the batch
    half = len(seqs[0]) // 2
    step1 = [Segment(0, 0, seqs[0][:half], w1, False), Segment(2, 0, seqs[2], w1, True),
             Segment(1, 0, seqs[1], w2, True)]
    out = eng.runner.forward(step1, eng.pool)
    torch.testing.assert_close(out[0], reference(seqs[2], w1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], reference(seqs[1], w2), atol=1e-4, rtol=1e-4)
    out = eng.runner.forward([Segment(0, half, seqs[0][half:], w1, True)], eng.pool)
    torch.testing.assert_close(out[0], reference(seqs[0], w1), atol=1e-4, rtol=1e-4)
    for step in range(3):  # batched decode of all three, versions mixed
        segs = []
        for i in (0, 2, 1):
            seqs[i] = seqs[i] + [100 + step + i]
            segs.append(Segment(i, len(seqs[i]) - 1, [seqs[i][-1]], ws[i], True))
        out = eng.runner.forward(segs, eng.pool)
        for row, i in enumerate((0, 2, 1)):
            torch.testing.assert_close(out[row], reference(seqs[i], ws[i]), atol=1e-4, rtol=1e-4)
    for step in range(2):  # request j in row j and slot j, versions alternating row by row
        for i in (0, 1, 2):
            seqs[i] = seqs[i] + [200 + step + i]
        out = eng.runner.forward([Segment(i, len(seqs[i]) - 1, [seqs[i][-1]], ws[i], True) for i in (0, 1, 2)],
                                 eng.pool)
        for i in (0, 1, 2):
            torch.testing.assert_close(out[i], reference(seqs[i], ws[i]), atol=1e-4, rtol=1e-4)


def test_base_weights_unchanged_by_training_and_swaps():
    eng = tiny_engine()
    try:
        before = base_fingerprint(eng.lm.model)
        lora_names = [n for n, _ in eng.lm.model.named_parameters() if "lora" in n]
        assert not lora_names  # adapters live outside the base model
        rep = eng.train(TrainBudget(steps=4)).result(timeout=120)
        assert rep.steps == 4
        eng.shadow.publish(eng.trainer.adapter.state_dict_peft(), 1)
        eng.shadow.publish(random_adapter_state(eng, 7), 2)
        eng.generate(prompt(eng, "hello"), GREEDY)
        after = base_fingerprint(eng.lm.model)
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), k
    finally:
        eng.stop()


def test_pinned_version_is_bit_identical_while_training_runs():
    eng = tiny_engine()
    try:
        eng.shadow.publish(random_adapter_state(eng, 3), 1)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        ids = prompt(eng, PROMPTS[0])
        reference = eng.generate(ids, params)
        before = eng.telemetry.totals["train_microbatches"]
        job = eng.train(TrainBudget(steps=1000, deadline_s=60))
        during = []
        for _ in range(3):  # training runs in the idle time between the requests
            time.sleep(0.2)
            during.append(eng.generate(ids, params))
        trained = eng.telemetry.totals["train_microbatches"] - before
        assert trained > 0, "training should fill the idle time of an unloaded replica"
        for ev in during:
            assert ev.record.adapter_version == 1
            assert ev.text == reference.text
        changed = eng.trainer.adapter.state_dict_peft()
        assert any(v.abs().sum() > 0 for k, v in changed.items() if "lora_B" in k)  # it really trained
    finally:
        eng.stop()
        job.cancel()


def test_swap_under_concurrent_load_never_mixes_versions():
    eng = tiny_engine()
    try:
        states = {v: random_adapter_state(eng, 10 + v) for v in range(1, 6)}
        # reference output of every prompt under every version, one request at a time
        refs = {}
        for v, st in states.items():
            eng.shadow.publish(st, v)
            for p in PROMPTS:
                refs[(v, p)] = eng.generate(prompt(eng, p), GREEDY).text
        assert len({refs[(v, PROMPTS[0])] for v in states}) > 1  # versions are distinguishable

        results, errors = [], []

        def client(p):
            try:
                results.append((p, eng.generate(prompt(eng, p), GREEDY)))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        # re-publish the same weights as newer version numbers while clients stream
        threads = []
        for wave, v in enumerate([1, 2, 3, 4, 5, 1, 2, 3]):
            eng.shadow.publish(states[v], 100 + wave)
            for p in PROMPTS:
                t = threading.Thread(target=client, args=(p,))
                t.start()
                threads.append(t)
            time.sleep(0.01)
        for t in threads:
            t.join(60)
        assert not errors
        assert len(results) == 8 * len(PROMPTS)
        waves = {100 + i: v for i, v in enumerate([1, 2, 3, 4, 5, 1, 2, 3])}
        for p, ev in results:
            assert ev.reason == "length"
            assert ev.text == refs[(waves[ev.record.adapter_version], p)], (p, ev.record.adapter_version)
        # only the last `adapters.retain` (4) versions stay; older ones were freed once their requests ended
        assert eng.shadow.alive_versions() == eng.shadow.retained_versions() == [104, 105, 106, 107]
    finally:
        eng.stop()


def test_mixed_version_batch_matches_single_version_runs():
    eng = tiny_engine()
    try:
        s1, s2 = random_adapter_state(eng, 21), random_adapter_state(eng, 22)
        long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        eng.shadow.publish(s1, 1)
        alone1 = eng.generate(prompt(eng, PROMPTS[1]), long).text
        eng.shadow.publish(s2, 2)
        alone2 = eng.generate(prompt(eng, PROMPTS[2]), long).text
        eng.shadow.publish(s1, 3)
        first_token = threading.Event()
        box = []

        def on_event(ev):
            if isinstance(ev, TokenEvent):
                first_token.set()
            if isinstance(ev, FinishEvent):
                box.append(ev)

        eng.submit(prompt(eng, PROMPTS[1]), long, on_event)
        assert first_token.wait(10)
        eng.shadow.publish(s2, 4)  # the second request is admitted while the first still decodes
        second = eng.generate(prompt(eng, PROMPTS[2]), long)
        deadline = time.time() + 10
        while not box and time.time() < deadline:
            time.sleep(0.01)
        assert box[0].record.adapter_version == 3 and second.record.adapter_version == 4
        assert box[0].text == alone1 and second.text == alone2
        assert eng.telemetry.snapshot().batch_mean >= 1
    finally:
        eng.stop()


def test_chunked_prefill_keeps_decodes_running():
    eng = tiny_engine(engine={"step_token_budget": 32, "max_running": 4, "kv_cache_mb": 16})
    try:
        counts = {"a": 0}
        started = threading.Event()

        def on_a(ev):
            if isinstance(ev, TokenEvent):
                counts["a"] += 1
                started.set()

        eng.submit(prompt(eng, "short"), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), on_a)
        assert started.wait(10)
        long_prompt = prompt(eng, " ".join(["word"] * 400))[:320]
        at_submit = counts["a"]
        eng.generate(long_prompt, SamplingParams(max_tokens=1, temperature=0))
        # 320 prompt tokens at <= 31 per step (one token of the budget is A's decode): >= 10 steps,
        # and A decoded a token in each of them
        assert counts["a"] - at_submit >= 10
    finally:
        eng.stop()


@pytest.mark.parametrize("tail", [1, 2, 5])
def test_chunked_greedy_output_equals_unchunked_whatever_the_last_chunk(tail):
    """A prompt whose last prefill chunk is `tail` tokens long (1 looks like a decode step) must
    produce the same greedy tokens as the same prompt prefilled in one step."""
    budget = 16
    whole = tiny_engine(engine={"step_token_budget": 512, "kv_cache_mb": 16})
    chunked = tiny_engine(engine={"step_token_budget": budget, "kv_cache_mb": 16})
    try:
        ids = prompt(whole, " ".join(["word"] * 40))
        ids = ids[: (len(ids) // budget - 1) * budget + tail]  # n full chunks, then `tail` tokens
        expected = whole.generate(ids, GREEDY).token_ids
        got = chunked.generate(ids, GREEDY)
        assert got.token_ids == expected
        assert got.record.prompt_tokens == len(ids) and got.record.output_tokens == GREEDY.max_tokens
    finally:
        whole.stop()
        chunked.stop()


def test_sampling_seed_stop_strings_and_eos():
    eng = tiny_engine()
    try:
        ids = prompt(eng, PROMPTS[3])
        p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
        a, b = eng.generate(ids, p), eng.generate(ids, p)
        assert a.text == b.text
        c = eng.generate(ids, SamplingParams(max_tokens=20, temperature=1.0, seed=43, ignore_eos=True))
        assert c.text != a.text
        greedy = eng.generate(ids, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        tiny_p = eng.generate(ids, SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-6, seed=1,
                                                  ignore_eos=True))
        assert tiny_p.text == greedy.text  # top_p -> only the most likely token
        stop = greedy.text[5:8]
        cut = eng.generate(ids, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))
        assert cut.reason == "stop" and cut.text == greedy.text[: greedy.text.index(stop)]
        eng.eos_ids = {greedy.token_ids[0]}  # pretend the first greedy token is end-of-sequence
        ended = eng.generate(ids, SamplingParams(max_tokens=20, temperature=0.0))
        assert ended.reason == "stop" and ended.record.output_tokens == 1
    finally:
        eng.stop()


class _Unchecked(SamplingParams):
    """Sampling parameters that skip validation: a request that got past the API's checks."""

    def validate(self) -> None:
        pass


def test_one_bad_request_fails_alone_and_the_engine_keeps_serving():
    eng = tiny_engine()
    try:
        ids = prompt(eng, "hi")
        bad = eng.generate(ids, _Unchecked(max_tokens=4, temperature=0.7, seed=2**70), timeout=30)
        assert bad.reason == "error"  # torch.Generator refused the seed at admission
        good = eng.generate(ids, SamplingParams(max_tokens=4, temperature=0.7, seed=3), timeout=30)
        assert good.reason == "length" and good.record.output_tokens == 4
        assert eng.failure is None and eng.pool.free_slots == eng.pool.slots
    finally:
        eng.stop()


def test_a_dead_engine_loop_says_so_and_refuses_requests():
    eng = tiny_engine()
    died = []
    eng.on_failure.append(died.append)
    def broken_planner():  # a bug in the loop itself, not in one request
        raise RuntimeError("planner bug")

    eng.core.plan = broken_planner
    try:
        assert eng.generate(prompt(eng, "hi"), GREEDY, timeout=10).reason == "error"
        deadline = time.time() + 10
        while not died and time.time() < deadline:
            time.sleep(0.01)
        assert died and eng.failure == died[0]
        from collm.edge_client.engine import EngineFailed

        with pytest.raises(EngineFailed, match="restarted"):
            eng.submit(prompt(eng, "hi"), GREEDY, lambda e: None)
    finally:
        eng.stop()


def test_a_request_that_waited_past_its_ttft_is_refused_not_served_late():
    eng = tiny_engine(engine={"max_running": 1, "shed_late": True}, slo={"ttft_ms": 50, "tpot_ms": 1000})
    try:
        long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        events: dict[str, list] = {"a": [], "b": []}
        done = threading.Event()

        def collect(name):
            def on_event(ev):
                if isinstance(ev, FinishEvent):
                    events[name].append(ev)
                    if all(events.values()):
                        done.set()
            return on_event

        eng.submit(prompt(eng, "hold the slot"), long, collect("a"))
        time.sleep(0.05)
        eng.submit(prompt(eng, "wait behind it"), long, collect("b"))
        assert done.wait(30)
        assert events["a"][0].reason == "length"
        b = events["b"][0]
        assert b.reason == "expired" and b.record.output_tokens == 0 and not b.record.slo_met
        assert eng.telemetry.totals["expired"] == 1
    finally:
        eng.stop()


def test_a_waiting_request_behind_queued_prefill_is_refused_sooner():
    # predicted 0.2 s a step, budget 128, TTFT 500 ms: B (120 tokens) alone needs 1 step, so it is
    # refused once it has waited 0.3 s; C (20 tokens) behind B needs 2 steps, so after 0.1 s
    eng = tiny_engine(costs=FixedCosts(0.2, 0.01), engine={"max_running": 1, "shed_late": True,
                                                            "step_token_budget": 128},
                      slo={"ttft_ms": 500, "tpot_ms": 1000})
    got: dict[str, FinishEvent] = {}
    done = threading.Event()

    def on(name):
        def f(ev):
            if isinstance(ev, FinishEvent):
                got[name] = ev
                if {"b", "c"} <= set(got):
                    done.set()
        return f

    try:
        hold = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
        started = threading.Event()
        eng.submit(prompt(eng, "hold the slot"), hold, lambda ev: started.set() if isinstance(ev, TokenEvent) else None)
        assert started.wait(30)
        b_ids = (prompt(eng, "a long prompt " * 40))[:120]
        assert len(b_ids) == 120  # B fills one 128-token step; B and C together need two
        eng.submit(b_ids, SamplingParams(max_tokens=4), on("b"))
        eng.submit(prompt(eng, "short"), SamplingParams(max_tokens=4), on("c"))
        assert done.wait(30)
    finally:
        eng.stop()
    assert got["b"].reason == got["c"].reason == "expired"
    assert got["c"].record.e2e_s < got["b"].record.e2e_s - 0.1, (got["b"].record.e2e_s, got["c"].record.e2e_s)


def test_without_shedding_late_requests_are_served():
    eng = tiny_engine(engine={"max_running": 1, "shed_late": False}, slo={"ttft_ms": 30, "tpot_ms": 1000})
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        done, box = threading.Event(), []
        eng.submit(prompt(eng, "hold the slot"), long, lambda e: None)
        eng.submit(prompt(eng, "wait"), long, lambda e: (box.append(e), done.set()) if isinstance(e, FinishEvent) else 0)
        assert done.wait(30) and box[0].reason == "length" and box[0].record.ttft_s > 0.03  # waited past its target
    finally:
        eng.stop()


def test_limits_queue_and_context():
    eng = tiny_engine(engine={"max_running": 2, "max_queue": 3, "kv_cache_mb": 0.25})
    try:
        assert eng.max_context < 1024  # KV memory bounds the context
        with pytest.raises(PromptTooLong, match=str(eng.max_context)):
            eng.submit([5] * eng.max_context, SamplingParams(max_tokens=1), lambda e: None)
        done, events = threading.Event(), []

        def on_event(ev):
            if isinstance(ev, FinishEvent):
                events.append(ev)
                if len(events) == 5:
                    done.set()

        slow = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        reqs = [eng.submit(prompt(eng, "hi"), slow, on_event) for _ in range(5)]  # 2 run, 3 wait
        with pytest.raises(QueueFull):
            for _ in range(5):
                eng.submit(prompt(eng, "hi"), slow, on_event)
        eng.cancel(reqs[-1])
        assert done.wait(30)
        assert sorted(e.reason for e in events).count("length") == 4
        assert any(e.reason == "cancelled" for e in events)
        assert eng.pool.free_slots == 2  # every slot came back
    finally:
        eng.stop()


def test_adapter_roundtrips_through_peft(tmp_path):
    from peft import PeftModel

    from collm.common.adapter_io import load_adapter, save_adapter
    from collm.edge_client.model.loading import load_model

    eng = tiny_engine(start=False)
    state = random_adapter_state(eng, 5, scale=0.2)
    save_adapter(tmp_path / "ad", state, eng.cfg.lora, "collm-tiny")
    loaded, cfg = load_adapter(tmp_path / "ad")
    assert cfg["r"] == eng.cfg.lora.r and set(loaded) == set(state)
    w = eng.layers.serving_weights(loaded, 1, eng.device, eng.lm.dtype)
    ids = torch.tensor([prompt(eng, "check")])
    with torch.inference_mode(), bind(ServingBinding([(0, ids.numel(), w)])):
        ours = eng.lm.model(ids).logits
    fresh = load_model(eng.cfg.model).model
    peft_model = PeftModel.from_pretrained(fresh, str(tmp_path / "ad")).eval()
    with torch.inference_mode():
        theirs = peft_model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_scheduler_trains_when_idle():
    eng = tiny_engine()
    try:
        rep = eng.train(TrainBudget(steps=3)).result(timeout=120)
        assert rep.steps == 3 and rep.microbatches >= 6 and not rep.deadline_hit
        assert rep.first_loss is not None and rep.tokens > 0
        snap = eng.snapshot()
        assert snap.train_steps_total == 3 and snap.window.totals["train_tokens"] >= rep.tokens
        # all of it in idle time: none of it shared time with serving (what the router's stretch counts)
        assert snap.window.training_busy_frac > 0 and snap.window.training_beside_serving_frac == 0
    finally:
        eng.stop()


def test_end_jobs_cuts_running_and_queued_training_short():
    """At shutdown a round's training must reply with what it did, not run to its budget."""
    eng = tiny_engine()
    try:
        running = eng.train(TrainBudget(steps=10_000))
        queued = eng.train(TrainBudget(steps=10_000))
        time.sleep(1.0)
        t0 = time.monotonic()
        eng.end_jobs()
        first, second = running.result(timeout=10), queued.result(timeout=10)
        assert time.monotonic() - t0 < 5
        assert first.deadline_hit and first.microbatches > 0 and first.steps < 10_000
        assert second.deadline_hit and second.steps == 0
    finally:
        eng.stop()


def test_evaluation_of_versions():
    eng = tiny_engine()
    try:
        base = eng.evaluate().result(timeout=60)
        assert base.sequences == 16 and base.loss > 0 and 0 <= base.accuracy <= 1
        eng.train(TrainBudget(steps=20)).result(timeout=300)
        trained = eng.evaluate(state=eng.trainer.adapter.state_dict_peft()).result(timeout=60)
        assert trained.loss < base.loss  # the tiny model learns the data's token statistics
    finally:
        eng.stop()


def test_a_micro_batch_in_flight_at_the_deadline_may_finish_within_the_grace():
    """Cutting a half-done micro-batch at the deadline throws its units away; within
    `training.finish_grace` of the deadline it completes, and no new one starts after it."""
    eng = tiny_engine(start=False, training={"finish_grace": 0.25})
    job = eng.trainer.job(TrainBudget(steps=1000, deadline_s=10.0))
    job.start()
    job.started_at = 0.0  # a clock we control: deadline at 10 s, grace until 12.5 s
    assert not job.past_deadline(9.9)
    job.run_unit()  # the first layer of a micro-batch: it is in flight
    assert not job.at_pass_boundary()
    assert not job.past_deadline(10.5) and not job.past_deadline(12.4)
    assert job.past_deadline(12.5)  # past the grace: cut off
    while not job.at_pass_boundary():
        job.run_unit()
    assert job.report.microbatches == 1
    assert job.past_deadline(10.5)  # at a boundary after the deadline: no new micro-batch starts
    assert not job.past_deadline(9.0)


def _wait_for(cond, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_training_carries_on_between_rounds_and_the_next_round_rebases_it_onto_the_new_global():
    """After a federated round's job the replica keeps training in idle time (up to carry_budget_rounds x
    that round's budget); the next round's job starts from  global + (carried adapter - the update sent)  and
    counts the carried micro-batches as its own."""
    eng = tiny_engine()
    try:
        first = eng.train(TrainBudget(tokens=200), global_state=eng.initial_state, carry=True).result(timeout=120)
        sent = first.adapter_state
        assert first.tokens >= 200 and sent is not None
        _wait_for(lambda: eng.core.carry is not None and eng.core.carry.future.done())  # at its cap: it waits
        carried = eng.carried_tokens()
        assert carried >= 200
        trained = eng.trainer.adapter.state_dict_peft()
        assert any(not torch.equal(trained[k], sent[k]) for k in sent)  # the carry changed the adapter
        new_global = random_adapter_state(eng, seed=3, scale=0.1)
        second = eng.train(TrainBudget(tokens=1), global_state=new_global, carry=True).result(timeout=60)
        assert second.tokens == carried and second.extra["carried_tokens"] == carried
        assert second.steps >= 1 and second.loss is not None
        for k in sent:
            torch.testing.assert_close(second.adapter_state[k], new_global[k] + (trained[k] - sent[k]))
    finally:
        eng.stop()


def test_a_job_that_cannot_start_fails_alone_and_the_replica_serves_on():
    """A job whose start raised (a rebase of the carry that failed, e.g. an SVD of a diverged carry) took the
    engine loop down: every request failed and the edge had to restart. Now that job fails, and serving and the
    next job go on. A global that does not fit is refused before it is queued (loading it half would mix it)."""
    from collm.edge_client.engine import EngineError

    eng = tiny_engine()
    try:
        bad = dict(eng.initial_state)
        bad.pop(next(iter(bad)))
        with pytest.raises(EngineError, match="does not fit"):
            eng.train(TrainBudget(tokens=50), global_state=bad)
        eng.train(TrainBudget(tokens=50), global_state=eng.initial_state, carry=True).result(timeout=120)
        _wait_for(lambda: eng.carried_tokens() > 0)

        def rebase(global_state, now, base):
            raise RuntimeError("SVD did not converge")

        with pytest.raises(RuntimeError, match="did not converge"):
            eng.train(TrainBudget(tokens=50), global_state=eng.initial_state, rebase=rebase).result(timeout=60)
        assert eng.failure is None
        done = threading.Event()
        req = eng.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0),
                         lambda ev: done.set() if isinstance(ev, FinishEvent) else None)
        assert done.wait(60) and req.out_ids
        assert eng.train(TrainBudget(tokens=50), global_state=eng.initial_state).result(timeout=120).tokens >= 50
    finally:
        eng.stop()


def test_the_carry_yields_to_an_evaluation_and_resumes_after_it():
    eng = tiny_engine()
    try:
        # a round cut by its deadline: the carry after it may train up to the round's (large) budget
        eng.train(TrainBudget(tokens=100_000, deadline_s=1.0), global_state=eng.initial_state,
                  carry=True).result(timeout=60)
        _wait_for(lambda: eng.carried_tokens() > 0)
        before = eng.carried_tokens()
        ev = eng.evaluate().result(timeout=60)
        assert ev.sequences > 0 and ev.loss > 0
        assert not eng.core.carry.future.done()  # paused, not ended
        _wait_for(lambda: eng.carried_tokens() > before)  # it went on after the evaluation
    finally:
        eng.stop()


def test_without_carry_the_replica_stops_training_at_the_rounds_end():
    eng = tiny_engine(training={"carry_between_rounds": False})
    try:
        eng.train(TrainBudget(tokens=100), global_state=eng.initial_state, carry=True).result(timeout=120)
        tokens = eng.snapshot().window.totals["train_tokens"]
        time.sleep(1.0)
        assert eng.carried_tokens() == 0 and eng.snapshot().window.totals["train_tokens"] == tokens
    finally:
        eng.stop()


def test_ffa_lora_trains_only_b_and_its_carry_keeps_a_frozen_too():
    """FFA-LoRA (`freeze_a`): from a global whose B is non-zero (so A has a gradient), only B moves,
    in the round's job and in the carry after it; without it A moves as well."""
    eng = tiny_engine()
    try:
        start = random_adapter_state(eng, seed=4, scale=0.1)
        a_keys = [k for k in start if "lora_A" in k]
        free = eng.train(TrainBudget(tokens=150), global_state=start).result(timeout=120)
        assert any(not torch.equal(free.adapter_state[k], start[k]) for k in a_keys)
        frozen = eng.train(TrainBudget(tokens=150), global_state=start, carry=True, freeze_a=True).result(timeout=120)
        assert frozen.steps >= 1
        assert all(torch.equal(frozen.adapter_state[k], start[k]) for k in a_keys)
        assert any(not torch.equal(frozen.adapter_state[k], start[k]) for k in start if "lora_B" in k)
        _wait_for(lambda: eng.carried_tokens() > 0)
        _wait_for(lambda: eng.core.carry.report.steps >= 1)
        carried = eng.trainer.adapter.state_dict_peft()
        assert all(torch.equal(carried[k], start[k]) for k in a_keys)
    finally:
        eng.stop()


def test_dp_clipping_scales_the_update_to_the_norm_and_leaves_a_small_one_alone():
    from collm.edge_client.federation.records import clipped_update

    start = {"a": torch.zeros(3), "b": torch.ones(2)}
    local = {"a": torch.tensor([3.0, 0.0, 0.0]), "b": torch.tensor([1.0, 5.0])}  # update (3, 0, 0, 0, 4): norm 5
    out, norm = clipped_update(local, start, 1.0)
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(out["a"], torch.tensor([0.6, 0.0, 0.0]))
    torch.testing.assert_close(out["b"], torch.tensor([1.0, 1.8]))
    same, _ = clipped_update(local, start, 10.0)
    assert all(torch.equal(same[k], local[k]) for k in local)


def test_timeline_records_the_steps_units_and_publishes_that_happened(tmp_path):
    """engine.timeline: every serving step of a request, every unit of a training job and every publish
    is one event, in time order, inside the wall-clock span it happened in."""
    from collm.edge_client.engine.timeline import read_timeline

    path = tmp_path / "timeline.jsonl"
    t_start = time.time()
    eng = tiny_engine(engine={"timeline": str(path), "warmup": False}, adapters={"retain": 2})
    try:
        fin = eng.generate(prompt(eng, PROMPTS[0]), GREEDY)
        rep = eng.train(TrainBudget(steps=2)).result(timeout=120)
        eng.shadow.publish(random_adapter_state(eng, 3), 1)
        eng.shadow.rollback(0)  # the admin's undo is a publish too
    finally:
        eng.stop()
    t_end = time.time()
    events = read_timeline(path)
    steps = [e for e in events if e["ev"] == "step"]
    units = [e for e in events if e["ev"] == "unit"]
    publishes = [e for e in events if e["ev"] == "publish"]
    assert len(steps) == len(fin.token_ids)  # a prompt that fits one step, then one step per further token
    assert sum(e["pf"] for e in steps) == len(prompt(eng, PROMPTS[0]))
    assert len(units) == rep.units and {e["job"] for e in units} == {"train"}
    assert [(e["version"], e["source"]) for e in publishes] == [(0, "initial"), (1, "federated"), (0, "rollback")]
    assert all(t_start <= e["t"] and e["t"] + e["s"] <= t_end for e in steps + units)
    busy = sorted(steps + units, key=lambda e: e["t"])
    assert all(a["t"] + a["s"] <= b["t"] + 1e-3 for a, b in zip(busy, busy[1:]))  # one loop: never overlapping


def test_a_timeline_that_cannot_be_written_turns_itself_off_and_serving_goes_on(caplog):
    """engine.timeline on a full disk (/dev/full: every write fails with ENOSPC): one warning, the
    timeline stops recording, and requests, training and publishes carry on as without it."""
    eng = tiny_engine(engine={"timeline": "/dev/full", "warmup": False})
    try:
        with caplog.at_level("WARNING", logger="collm.timeline"):
            eng.timeline._flush_s = 0.0  # write at every event, so the first one already fails
            fin = eng.generate(prompt(eng, PROMPTS[1]), GREEDY)
            assert fin.reason == "length" and len(fin.token_ids) == GREEDY.max_tokens
            assert eng.train(TrainBudget(steps=1)).result(timeout=120).steps == 1
            eng.shadow.publish(random_adapter_state(eng, 5), 1)
            assert eng.shadow.current_version == 1 and eng.failure is None
            assert eng.timeline._file.closed
    finally:
        eng.stop()
    warnings = [r for r in caplog.records if r.name == "collm.timeline"]
    assert len(warnings) == 1 and "writing failed" in warnings[0].getMessage()


def test_a_timeline_path_that_cannot_be_opened_is_a_warning_and_the_edge_serves(tmp_path, caplog):
    """engine.timeline naming a directory (or an unwritable place): the edge starts without a timeline and
    says which setting to fix, instead of failing to start over a diagnostic."""
    with caplog.at_level("WARNING", logger="collm.timeline"):
        eng = tiny_engine(engine={"timeline": str(tmp_path), "warmup": False})
    try:
        assert eng.timeline is None
        fin = eng.generate(prompt(eng, PROMPTS[1]), GREEDY)
        assert fin.reason == "length" and len(fin.token_ids) == GREEDY.max_tokens
    finally:
        eng.stop()
    assert any("engine.timeline" in r.getMessage() and "writable" in r.getMessage() for r in caplog.records)
