"""Per-round checkpoints: PEFT-format adapter + metrics.json; incomplete rounds are ignored."""

import json

import numpy as np
import pytest

from collm.common.adapter_io import load_adapter
from collm.common.config import LoraConfig
from collm.common.errors import UserError
from collm.common.rounds import latest_complete_round, round_dir
from collm.server.checkpoints import check_lora_matches, load_all_metrics, load_round, write_round

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj"])


def state(seed):
    rng = np.random.default_rng(seed)
    return {A: rng.standard_normal((4, 16)).astype(np.float32), B: rng.standard_normal((16, 4)).astype(np.float32)}


def test_write_and_load_round(tmp_path):
    s = state(0)
    metrics = {"round": 1, "eval": {"edge0": {"eval-loss": 1.5, "bad": float("nan")}}}
    d = write_round(tmp_path, 1, s, metrics, LORA, "tiny-base", {"m_t": {A: np.ones((4, 16), np.float32)}})
    assert d == round_dir(tmp_path, 1) and d.name == "round-0001"

    # plain PEFT format, readable by collm's (and PEFT's) loader
    tensors, cfg = load_adapter(d)
    assert cfg["r"] == 4 and cfg["base_model_name_or_path"] == "tiny-base" and cfg["target_modules"] == ["q_proj"]
    np.testing.assert_array_equal(tensors[A].numpy(), s[A])
    assert json.loads((d / "metrics.json").read_text())["eval"]["edge0"]["bad"] is None  # strict JSON

    ck = load_round(tmp_path, 1)
    assert ck.round == 1 and ck.metrics["eval"]["edge0"]["eval-loss"] == 1.5
    np.testing.assert_array_equal(ck.arrays[B], s[B])
    np.testing.assert_array_equal(ck.server_state["m_t"][A], np.ones((4, 16)))


def test_latest_complete_round_ignores_incomplete_dirs(tmp_path):
    assert latest_complete_round(tmp_path / "missing") == 0
    write_round(tmp_path, 1, state(1), {"round": 1}, LORA, "b")
    write_round(tmp_path, 2, state(2), {"round": 2}, LORA, "b")
    write_round(tmp_path, 3, state(3), {"round": 3}, LORA, "b")
    (round_dir(tmp_path, 3) / "metrics.json").unlink()          # crashed before metrics.json
    (tmp_path / "round-0009").mkdir()                            # stray, empty
    (tmp_path / "notes").mkdir()
    assert latest_complete_round(tmp_path) == 2
    assert sorted(load_all_metrics(tmp_path)) == [1, 2]
    with pytest.raises(UserError, match="no complete checkpoint for round 3"):
        load_round(tmp_path, 3)


def test_empty_global_round(tmp_path):
    write_round(tmp_path, 1, {}, {"round": 1, "training_skipped": "no edge takes part"}, LORA, "b")
    ck = load_round(tmp_path, 1)
    assert ck.arrays == {} and ck.server_state == {}


def test_lora_mismatch_is_a_user_error(tmp_path):
    write_round(tmp_path, 1, state(0), {"round": 1}, LORA, "b")
    ck = load_round(tmp_path, 1)
    check_lora_matches(ck, LORA, "configs/server.yaml")
    with pytest.raises(UserError, match=r"^configs/server.yaml: lora.r is 8 but round 1 was trained with 4"):
        check_lora_matches(ck, LoraConfig(r=8, alpha=8, target_modules=["q_proj"]), "configs/server.yaml")
