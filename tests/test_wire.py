"""The adapter's wire form (common/wire.py): exact, few Flower objects, and strict about malformed input."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from collm.common import wire


def smollm2_like_adapter(layers=30, r=8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for layer in range(layers):
        for name, (i, o) in {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                             "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}.items():
            base = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            out[f"{base}.lora_A.weight"] = rng.standard_normal((r, i)).astype(np.float32)
            out[f"{base}.lora_B.weight"] = rng.standard_normal((o, r)).astype(np.float32)
    return out


def test_pack_round_trips_every_tensor_exactly_in_order():
    state = smollm2_like_adapter(layers=3)
    back = wire.unpack(wire.pack(state))
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == np.float32 and back[k].shape == v.shape and np.array_equal(back[k], v)
    keyed = wire.unpack_record(wire.pack(state))
    assert set(keyed.keys()) == set(state) and np.array_equal(keyed[next(iter(state))].numpy(), next(iter(state.values())))


def test_a_packed_adapter_is_a_few_flower_objects_not_one_per_tensor():
    state = smollm2_like_adapter()
    keyed = len(get_all_nested_objects(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in state.items()})})))
    packed = len(get_all_nested_objects(RecordDict({"arrays": wire.pack(state)})))
    assert keyed > 800 and packed <= 10, (keyed, packed)  # each object is its own call SuperNode <-> SuperLink


def test_keyed_and_empty_records_pass_through():
    state = smollm2_like_adapter(layers=1)
    keyed = ArrayRecord({k: Array(v) for k, v in state.items()})
    assert all(np.array_equal(wire.unpack(keyed)[k], v) for k, v in state.items())
    assert wire.unpack_record(keyed) is keyed
    assert len(wire.pack({})) == 0 and wire.unpack(ArrayRecord()) == {}


@pytest.mark.parametrize("manifest, values, message", [
    (b"not json", np.zeros(4, np.float32), "unreadable manifest"),
    (json.dumps([["a", [2, 2]]]).encode(), np.zeros(5, np.float32), "describes 4 values, the array holds 5"),
    (json.dumps([["a", "x"]]).encode(), np.zeros(4, np.float32), "unreadable manifest"),
])
def test_a_malformed_packed_record_is_a_clear_error(manifest, values, message):
    rec = ArrayRecord({wire.PACKED: Array(values), wire.MANIFEST: Array(np.frombuffer(manifest, np.uint8).copy())})
    with pytest.raises(ValueError, match=message):
        wire.unpack(rec)
