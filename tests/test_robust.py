"""Robust aggregation checks: bad updates are left out, the rest is plain FedAvg."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from collm.server.robust import Update, majority_signature, screen_updates, update_norm

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def adapter(rng, scale=0.01, base=None):
    d = {A: rng.standard_normal((4, 16)).astype(np.float32) * scale,
         B: rng.standard_normal((16, 4)).astype(np.float32) * scale}
    return d if base is None else {k: base[k] + v for k, v in d.items()}


def fedavg(arrays_list, weights):
    """FedAvg computed independently of flwr: Σ (n_i / Σn) · x_i per key."""
    total = float(sum(weights))
    return {k: sum(w / total * a[k].astype(np.float64) for a, w in zip(arrays_list, weights))
            for k in arrays_list[0]}


def test_nan_and_huge_updates_are_left_out_and_aggregate_is_fedavg_of_the_rest():
    rng = np.random.default_rng(0)
    glob = adapter(rng, scale=0.1)
    good = [adapter(rng, base=glob) for _ in range(3)]
    nan = adapter(rng, base=glob)
    nan[B][2, 1] = np.nan
    huge = {k: glob[k] + 100 * (v - glob[k]) for k, v in adapter(rng, base=glob).items()}
    updates = [Update("e0", 10, good[0]), Update("nan", 20, nan), Update("e1", 30, good[1]),
               Update("huge", 40, huge), Update("e2", 50, good[2])]

    s = screen_updates(updates, glob, norm_k=5.0)

    assert s.kept == [0, 2, 4]
    assert s.dropped[1] == f"non-finite values in {B}"
    assert s.dropped[3].startswith("update norm") and "5 × median" in s.dropped[3]

    # flwr's own FedAvg over the kept replies equals an independent numpy FedAvg
    records = [RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in updates[i].arrays.items()}),
                           "metrics": MetricRecord({"num-examples": updates[i].num_examples})})
               for i in s.kept]
    got = aggregate_arrayrecords(records, "num-examples")
    want = fedavg(good, [10, 30, 50])
    for k in want:
        np.testing.assert_allclose(got[k].numpy(), want[k], rtol=1e-5, atol=1e-7)


def test_zero_examples_and_wrong_shape_are_left_out():
    rng = np.random.default_rng(1)
    glob = adapter(rng)
    wrong = adapter(rng, base=glob)
    wrong[A] = np.zeros((8, 16), np.float32)
    extra = {**adapter(rng, base=glob), "base_model.model.x.lora_A.weight": np.zeros((1, 1), np.float32)}
    updates = [Update("ok", 5, adapter(rng, base=glob)), Update("none", 0, adapter(rng, base=glob)),
               Update("shape", 5, wrong), Update("keys", 5, extra)]
    s = screen_updates(updates, glob, norm_k=5.0)
    assert s.kept == [0]
    assert s.dropped[1] == "trained on 0 examples"
    assert "shape (8, 16), expected (4, 16)" in s.dropped[2]
    assert "1 unexpected key(s)" in s.dropped[3]


def test_empty_global_uses_majority_shapes_and_zero_reference():
    rng = np.random.default_rng(2)
    base = adapter(rng, scale=0.1)   # the seeded initial adapter every edge starts from
    same = [adapter(rng, base=base) for _ in range(3)]
    odd = {A: np.zeros((2, 16), np.float32), B: np.zeros((16, 2), np.float32)}
    updates = [Update(f"e{i}", 10, a) for i, a in enumerate(same)] + [Update("odd", 10, odd)]
    s = screen_updates(updates, {}, norm_k=5.0)
    assert majority_signature(updates) == frozenset({(A, (4, 16)), (B, (16, 4))})
    assert s.kept == [0, 1, 2] and "majority of updates (3/4" in s.reference
    assert "keys/shapes differ" in s.dropped[3]
    assert s.norms[0] == pytest.approx(update_norm(same[0], {}))   # global counts as zeros
    assert s.norms[0] == pytest.approx(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2))
                                                   for v in same[0].values())))


def test_norm_check_needs_three_updates():
    rng = np.random.default_rng(3)
    glob = adapter(rng)
    a = adapter(rng, base=glob)
    b = {k: glob[k] + 100 * (v - glob[k]) for k, v in adapter(rng, base=glob).items()}
    s = screen_updates([Update("a", 1, a), Update("b", 1, b)], glob, norm_k=5.0)
    assert s.kept == [0, 1] and s.median_norm is None


def test_with_two_edges_the_last_rounds_norms_catch_a_100x_update():
    rng = np.random.default_rng(4)
    glob = adapter(rng)
    honest = [update_norm(adapter(rng, base=glob), glob) for _ in range(2)]  # what the last round kept
    a = adapter(rng, base=glob)
    b = {k: glob[k] + 100 * (v - glob[k]) for k, v in adapter(rng, base=glob).items()}
    s = screen_updates([Update("a", 1, a), Update("b", 1, b)], glob, norm_k=5.0, history=honest)
    assert s.kept == [0] and "median" in s.dropped[1]
    # a copy of the honest update scaled within k passes: the screen bounds an update, it cannot prove it honest
    c = {k: glob[k] + 3 * (v - glob[k]) for k, v in a.items()}
    s = screen_updates([Update("a", 1, a), Update("c", 1, c)], glob, norm_k=5.0, history=honest)
    assert s.kept == [0, 1]


def test_no_updates():
    s = screen_updates([], {}, norm_k=5.0)
    assert s.kept == [] and s.dropped == {}
