"""The open-loop load generator against a real edge: client-side TTFT/TPOT and the SLO verdict."""

from helpers import LiveEdge, tiny_config

from collm.lab.loadgen import Planned, poisson_schedule, replay, summarize


def test_open_loop_replay_measures_latencies_and_goodput(tmp_path):
    e = LiveEdge(tiny_config(state_dir=str(tmp_path)))
    try:
        def body(i):
            return {"messages": [{"role": "user", "content": f"Q{i}"}], "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}

        # targets no shared machine misses (the verdict itself is checked against the measured latencies)
        plan = poisson_schedule(10.0, 2.0, body, seed=1, ttft_slo_s=30.0, tpot_slo_s=5.0)
        plan.append(Planned(0.5, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                  "temperature": 0}, ttft_slo_s=1e-6, tag="impossible"))
        plan.append(Planned(0.6, {"prompt": "x", "max_tokens": 10**6}, path="/v1/completions", tag="rejected"))
        out = replay(plan, e.url)
        normal = [o for o in out if not o.tag]
        assert normal and all(o.completed and o.output_tokens == 8 and o.slo_met for o in normal)
        assert all(0 < o.ttft_s <= o.e2e_s and o.tpot_s > 0 for o in normal)
        assert all(o.adapter_version == 0 for o in normal)
        imp = next(o for o in out if o.tag == "impossible")
        rej = next(o for o in out if o.tag == "rejected")
        assert imp.completed and not imp.slo_met
        assert rej.status == 400 and not rej.completed
        s = summarize(out, 2.0)
        assert s["requests"] == len(plan) and s["failed"] == 1 and s["slo_met"] == len(normal)
        assert abs(s["goodput_rps"] - len(normal) / 2.0) < 1e-9
        sent = sorted(o.sent_at for o in normal)
        assert abs(sent[0] - plan[0].at_s) < 0.2  # sent on schedule (open loop)
    finally:
        e.close()


def test_slo_miss_names_the_first_target_missed_and_agrees_with_meets_slo():
    from collm.common.slo import meets_slo, slo_miss

    cases = {(True, 0.5, 0.05): None, (True, 0.5, 0.2): "tpot", (True, 2.0, 0.2): "ttft",
             (True, 2.0, 0.05): "ttft", (False, 0.5, 0.05): "failed", (True, None, None): "failed",
             (True, 1.0, 0.1): None, (True, 0.5, None): None}
    for (done, ttft, tpot), want in cases.items():
        assert slo_miss(done, ttft, tpot, 1.0, 0.1) == want, (done, ttft, tpot)
        assert meets_slo(done, ttft, tpot, 1.0, 0.1) == (want is None)


def test_every_stream_reader_takes_the_first_token_from_one_rule():
    """common.sse: a chunk with text (completion or chat) or a finish reason is the first token; an empty
    chunk, a usage-only chunk, [DONE] and garbage are not."""
    from collm.common import sse

    def obj(line):
        return sse.data_of(line)

    assert sse.is_first_token(obj('data: {"choices": [{"text": "Hi"}]}'))
    assert sse.is_first_token(obj('data: {"choices": [{"delta": {"content": "Hi"}}]}'))
    assert sse.is_first_token(obj('data: {"choices": [{"text": "", "finish_reason": "stop"}]}'))
    assert not sse.is_first_token(obj('data: {"choices": [{"delta": {"role": "assistant"}}]}'))
    assert not sse.is_first_token(obj('data: {"choices": [], "usage": {"completion_tokens": 3}}'))
    assert sse.completion_tokens(obj('data: {"choices": [], "usage": {"completion_tokens": 3}}')) == 3
    for junk in ("data: [DONE]", ": keep-alive", "data: not json", "data: [1, 2]", 'data: {"choices": "x"}'):
        o = obj(junk)
        assert o is None or not sse.is_first_token(o)
