"""Mixed-rank LoRA math (common/lora_rank.py): exact stacked sums, best rank-r truncation with its energy,
fitting up and down, filled directions, and the product-space distance, against dense numpy."""

from __future__ import annotations

import numpy as np
import pytest

from collm.common.lora_rank import align, combine, fit_rank, pairs, product_distance, rank_of

RNG = np.random.default_rng(0)


def adapter(r: int, d_out: int = 12, d_in: int = 10, modules: int = 2) -> dict[str, np.ndarray]:
    out = {}
    for m in range(modules):
        out[f"layers.{m}.q_proj.lora_A.weight"] = RNG.normal(size=(r, d_in)).astype(np.float32)
        out[f"layers.{m}.q_proj.lora_B.weight"] = RNG.normal(size=(d_out, r)).astype(np.float32)
    return out


def dense(state, alpha) -> dict[str, np.ndarray]:
    r = rank_of(state)
    return {a: alpha / r * state[b].astype(np.float64) @ state[a].astype(np.float64) for a, b in pairs(state).values()}


def test_a_weighted_sum_of_mixed_ranks_is_exact_when_the_rank_allows():
    x4, x8 = adapter(4), adapter(8)
    out, energy = combine([(x4, 0.3 * 16 / 4), (x8, 0.7 * 32 / 8)], 12, 16)
    assert rank_of(out) == 12 and energy == pytest.approx(1.0)
    want = {k: 0.3 * dense(x4, 16)[k] + 0.7 * dense(x8, 32)[k] for k in dense(x4, 16)}
    for k, v in dense(out, 16).items():
        np.testing.assert_allclose(v, want[k], atol=1e-5)


def test_truncation_is_the_best_rank_r_approximation_and_reports_its_energy():
    x4, x8 = adapter(4), adapter(8)
    out, energy = combine([(x4, 1.0), (x8, 1.0)], 3, 6)
    kept = total = 0.0
    for k, v in dense(out, 6).items():
        want = x4[k.replace("lora_A", "lora_B")].astype(np.float64) @ x4[k] + \
            x8[k.replace("lora_A", "lora_B")].astype(np.float64) @ x8[k]
        u, s, vt = np.linalg.svd(want)
        np.testing.assert_allclose(v, (u[:, :3] * s[:3]) @ vt[:3], atol=1e-4)
        kept, total = kept + np.sum(s[:3] ** 2), total + np.sum(s ** 2)
    assert energy == pytest.approx(kept / total, rel=1e-6) and energy < 1


def test_fitting_up_is_exact_and_fills_unused_directions_with_trainable_a_rows():
    x4, fill = adapter(4), adapter(8)
    up, energy = fit_rank(x4, 16, 8, 32, fill)
    assert energy == pytest.approx(1.0)
    for k, v in dense(up, 32).items():
        np.testing.assert_allclose(v, dense(x4, 16)[k], atol=1e-5)
    a, b = next(iter(pairs(up).values()))
    np.testing.assert_array_equal(up[a][4:], fill[a][4:])  # a gradient can move these again
    assert not up[b][:, 4:].any()  # and they change nothing until it does


def test_an_all_zero_b_keeps_the_fill_and_counts_as_fully_kept():
    x4 = adapter(4)
    zero_b = {k: (np.zeros_like(v) if "lora_B" in k else v) for k, v in x4.items()}
    out, energy = fit_rank(zero_b, 16, 4, 16, x4)
    assert energy == 1.0
    for k, v in out.items():
        np.testing.assert_array_equal(v, zero_b[k])


def test_product_distance_is_the_frobenius_norm_of_the_difference():
    x4, x8 = adapter(4), adapter(8)
    want = np.sqrt(sum(np.sum((dense(x4, 16)[k] - dense(x8, 8)[k]) ** 2) for k in dense(x4, 16)))
    assert product_distance(x4, 16, x8, 8) == pytest.approx(want, rel=1e-9)
    assert product_distance(x4, 16, {}, 16) == pytest.approx(np.sqrt(sum(np.sum(d ** 2) for d in dense(x4, 16).values())))
    assert product_distance(x4, 16, x4, 16) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("broken, message", [
    (lambda s: {k: v for k, v in s.items() if "lora_B" not in k or "layers.0" not in k}, "no lora_B partner"),
    (lambda s: {**s, "layers.0.q_proj.lora_B.weight": np.zeros((12, 3), np.float32)}, "are not a LoRA pair"),
    (lambda s: {**s, "layers.0.q_proj.bias": np.zeros(3, np.float32)}, "keys that are not LoRA pairs"),
])
def test_malformed_adapters_are_value_errors(broken, message):
    with pytest.raises(ValueError, match=message):
        rank_of(broken(adapter(4)))


def test_with_a_fill_a_rows_keep_the_seeded_norm_and_b_carries_the_magnitude():
    x8, fill = adapter(8), adapter(4)
    out, _ = fit_rank(x8, 16, 4, 8, fill)
    for a, b in pairs(out).values():
        c = np.median(np.linalg.norm(fill[a], axis=1))
        np.testing.assert_allclose(np.linalg.norm(out[a], axis=1), c, rtol=1e-5)  # a weak direction still trains


def test_align_keeps_the_products_and_turns_the_factors_toward_the_reference():
    x4 = adapter(4)
    turned, _ = fit_rank(x4, 16, 4, 16)  # same products, the SVD's basis
    back = align(turned, x4)
    for k, v in dense(back, 16).items():
        np.testing.assert_allclose(v, dense(x4, 16)[k], atol=1e-4)
    gap = lambda s: sum(np.linalg.norm(s[k] - x4[k]) for k in x4)  # noqa: E731
    assert gap(back) < 0.5 * gap(turned)
