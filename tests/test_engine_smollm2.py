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


def test_training_lowers_holdout_loss_on_a_dolly_category(smollm2_lm):
    cfg = validate_config(EdgeConfig, {
        "model": {"source": "bundled", "device": "cpu"},
        "engine": {"max_running": 4, "kv_cache_mb": 64},
        "data": {"categories": ["classification"]},
        "training": {"lr": 0.0005, "micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 128,
                     "max_eval_records": 12, "eval_batch_size": 4},
    }, "test")
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
