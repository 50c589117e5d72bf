"""The engine on the bundled SmolLM2-135M-Instruct (slow: real model, real Dolly data)."""

import pytest

from collm.common.config import validate_config
from collm.edge_client.config import EdgeConfig
from collm.common.data import chat_prompt_ids
from collm.edge_client.training.data import load_edge_data
from collm.edge_client.engine import Engine
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.trainer import TrainBudget

pytestmark = pytest.mark.slow


def smollm2_config(eval_records: int, **extra) -> EdgeConfig:
    """SmolLM2 on one Dolly category, small enough to train and evaluate in a test."""
    return validate_config(EdgeConfig, {
        "model": {"source": "bundled", "device": "cpu"},
        "engine": {"max_running": 4, "kv_cache_mb": 64},
        "data": {"categories": ["classification"]},
        "training": {"lr": 0.0005, "micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 128,
                     "max_eval_records": eval_records, "eval_batch_size": 4},
        **extra,
    }, "test")


def test_training_lowers_holdout_loss_on_a_dolly_category(smollm2_lm):
    cfg = smollm2_config(eval_records=12)
    engine = Engine(smollm2_lm, cfg, load_edge_data(cfg.data)).start()
    try:
        before = engine.evaluate().result(timeout=600)
        report = engine.train(TrainBudget(steps=8)).result(timeout=1200)
        assert report.steps == 8
        engine.shadow.publish(engine.trainer.adapter.state_dict_peft(), 1, round=1)
        after = engine.evaluate().result(timeout=600)
        print(f"holdout loss {before.loss:.3f} -> {after.loss:.3f}, accuracy {before.accuracy:.3f} -> "
              f"{after.accuracy:.3f}, train {report.tokens} tokens in {report.seconds:.0f} s")
        assert after.loss < before.loss - 0.02
        # and it still answers sensibly with the new adapter
        ids = chat_prompt_ids(smollm2_lm.tokenizer, "What is the capital of France?")
        ev = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0))
        assert ev.record.adapter_version == 1 and "Paris" in ev.text
    finally:
        engine.stop()


def test_the_canary_gate_refuses_a_bad_global_and_serves_a_good_one(smollm2_lm, tmp_path):
    """A global trained at 100x the learning rate is evaluated before it is served, refused, and never
    answers a request (not even when a later TRAIN message carries it); a sound one is served."""
    from collm.edge_client.federation.client import FederatedEdge
    from collm.edge_client.federation.records import to_arrays
    from collm.edge_client.runtime import EdgeRuntime

    cfg = smollm2_config(eval_records=8, state_dir=str(tmp_path / "state"))
    rt = EdgeRuntime(cfg)
    rt.model_name = smollm2_lm.name
    rt.engine = engine = Engine(smollm2_lm, cfg, load_edge_data(cfg.data)).start()
    rt.ready.set()
    edge = FederatedEdge(rt)
    ids = chat_prompt_ids(smollm2_lm.tokenizer, "What is the capital of France?")
    params = SamplingParams(max_tokens=6, temperature=0)
    try:
        edge.measure_reference()  # as the edge does when it joins the federation: the reference, in idle time
        reference = edge._reference[1].result(timeout=600)
        one_evaluation = engine.telemetry.totals["eval_tokens"]
        assert one_evaluation > 0
        engine.train(TrainBudget(steps=2), global_state=engine.initial_state, lr=0.05).result(timeout=1200)
        bad = engine.trainer.adapter.state_dict_peft()
        report, refused = edge.evaluate_global(bad, 1)
        print(f"bad global: holdout loss {report.loss:.3f}; {refused}")
        assert refused and engine.shadow.current_version == 0 and engine.shadow.latest_version == 0
        assert engine.shadow.info_of(0).eval_loss == reference.loss  # the reference it was held against ...
        assert engine.telemetry.totals["eval_tokens"] == 2 * one_evaluation  # ... measured at start, not again
        assert edge.load_report().refused_version == 1
        edge.adopt_global(to_arrays(bad), 1)  # round 2's TRAIN message starts from it: trained from, not served
        assert engine.generate(ids, params).record.adapter_version == 0

        engine.train(TrainBudget(steps=2), global_state=engine.initial_state, lr=0.0005).result(timeout=1200)
        good = engine.trainer.adapter.state_dict_peft()
        report2, refused2 = edge.evaluate_global(good, 2)
        print(f"good global: holdout loss {report2.loss:.3f}")
        assert refused2 is None and engine.shadow.current_version == 2 and report2.loss < report.loss
        assert engine.shadow.info_of(2).eval_loss == report2.loss
        assert engine.generate(ids, params).record.adapter_version == 2

        # a global that first arrives in a TRAIN message (this edge missed its evaluation) is gated too
        edge.adopt_global(to_arrays(bad), 3)
        assert 3 in edge.refused and engine.shadow.current_version == 2
        assert engine.generate(ids, params).record.adapter_version == 2
    finally:
        engine.stop()
