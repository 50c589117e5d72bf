"""The serving runner's fused projections (q|k|v, gate|up in one matmul, LoRA in two more): the
same logits as the per-module LoRA path for one version, several versions and base rows in a
batch, short and long steps; still one copy of the base; a quantized base falls back."""

import pytest
import torch
from helpers import prompt, random_adapter_state, tiny_engine

from collm.edge_client.model.fused import FusedLinear
from collm.edge_client.model.lora import BASE, ServingBinding, bind
from collm.edge_client.model.runner import ModelRunner, Segment

TEXTS = ["What is the capital of France?", "Name three birds and say where they live.",
         "Why is the sky blue? Explain it to a child.", "Write a haiku about rain on a tin roof."]


def _reference(eng, seq, w):
    """Last-token logits through HF's own forward, each LoRALinear applying its delta by itself."""
    binding = None if w is BASE else ServingBinding([(0, len(seq), w)])
    with torch.inference_mode(), bind(binding):
        return eng.lm.model(torch.tensor([seq])).logits[0, -1]


def _versions(eng):
    w1 = eng.layers.serving_weights(random_adapter_state(eng, 1), 1, eng.device, eng.lm.dtype)
    w2 = eng.layers.serving_weights(random_adapter_state(eng, 2), 2, eng.device, eng.lm.dtype)
    return w1, w2


@pytest.mark.parametrize("prefill_rows", ["few", "many"])
def test_mixed_versions_and_base_rows_match_the_per_module_path(prefill_rows):
    """`few`: every step is decode-sized (the masked stacked path); `many`: the prefill step has more
    than LOOP_ROWS rows (one pass per version). Decodes after it always mix versions and base rows."""
    eng = tiny_engine(start=False)
    assert all(f.concatenated for f in eng.runner.qkv + eng.runner.gate_up)
    w1, w2 = _versions(eng)
    seqs = [prompt(eng, t) for t in TEXTS]
    if prefill_rows == "few":
        seqs = [s[:12] for s in seqs]
    ws = [w1, w2, BASE, w1]
    rows = sum(len(s) for s in seqs)
    assert (rows > ServingBinding.LOOP_ROWS) == (prefill_rows == "many")
    order = sorted(range(4), key=lambda i: ws[i].version)  # the engine orders rows by version
    out = eng.runner.forward([Segment(i, 0, seqs[i], ws[i], True) for i in order], eng.pool)
    for row, i in enumerate(order):
        torch.testing.assert_close(out[row], _reference(eng, seqs[i], ws[i]), atol=1e-4, rtol=1e-4)
    for step in range(3):
        for i in range(4):
            seqs[i] = seqs[i] + [50 + 7 * step + i]
        out = eng.runner.forward([Segment(i, len(seqs[i]) - 1, seqs[i][-1:], ws[i], True) for i in order], eng.pool)
        for row, i in enumerate(order):
            torch.testing.assert_close(out[row], _reference(eng, seqs[i], ws[i]), atol=1e-4, rtol=1e-4)
    # a version's output does not depend on what else is in the batch
    alone = eng.runner.forward([Segment(0, len(seqs[1]) - 1, seqs[1][-1:], w2, True)], eng.pool)
    mixed = eng.runner.forward([Segment(1, len(seqs[0]) - 1, seqs[0][-1:], w1, True),
                                Segment(0, len(seqs[1]) - 1, seqs[1][-1:], w2, True)], eng.pool)
    torch.testing.assert_close(mixed[1], alone[0], atol=1e-5, rtol=1e-5)


def test_fusion_keeps_one_copy_of_the_base_and_hf_outputs_unchanged():
    eng = tiny_engine(start=False)
    model = eng.lm.model
    ids = torch.tensor([prompt(eng, TEXTS[0])])
    with torch.inference_mode():
        before = model(ids).logits
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    second = ModelRunner(model)  # another runner on the same model reuses the fused tensors
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storages
    for li, layer in enumerate(model.model.layers):
        fused = eng.runner.qkv[li].weight
        assert second.qkv[li].weight is fused
        attn = layer.self_attn
        start = 0
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            w = proj.base.weight
            assert w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert torch.equal(w, fused[start:start + w.shape[0]])
            start += w.shape[0]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("why", ["quantized base", "fuse_projections off"])
def test_an_unfused_base_is_served_module_by_module(why):
    over = {"model": {"quantization": "nf4"}} if why == "quantized base" else {"engine": {"fuse_projections": False}}
    eng = tiny_engine(start=False, **over)
    assert not any(f.concatenated for f in eng.runner.qkv + eng.runner.gate_up)
    w1, w2 = _versions(eng)
    seqs = [prompt(eng, t) for t in TEXTS[:2]]
    out = eng.runner.forward([Segment(0, 0, seqs[0], w1, True), Segment(1, 0, seqs[1], w2, True)], eng.pool)
    for row, (s, w) in enumerate(zip(seqs, (w1, w2))):
        torch.testing.assert_close(out[row], _reference(eng, s, w), atol=1e-3, rtol=1e-3)


def test_a_version_builds_its_fused_lora_once():
    eng = tiny_engine(start=False)
    w1, _ = _versions(eng)
    f: FusedLinear = eng.runner.qkv[0]
    a, b = w1.fused(f)
    assert w1.fused(f)[0] is a
    r = eng.layers.r
    assert a.shape == (f.weight.shape[1], 3 * r) and b.shape == (3 * r, f.out_features)
    # block-diagonal: q's rows of B feed only q's columns
    q = f.members[0]
    assert torch.count_nonzero(b[:r, q.end:]) == 0 and torch.count_nonzero(b[r:, :q.end]) == 0
