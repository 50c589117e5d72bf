"""Base model loading: tiny (deterministic), hub (fails fast offline), 4-bit, bundled SmolLM2."""

import time

import pytest
import torch

from collm.edge_client.config import ModelConfig
from collm.common.data import chat_prompt_ids
from collm.common.errors import UserError
from collm.edge_client.model.loading import build_tiny_tokenizer, load_model


def test_tiny_model_is_deterministic_and_frozen(tiny_lm, tiny_cfg):
    again = load_model(tiny_cfg)
    for (n1, p1), (n2, p2) in zip(tiny_lm.model.named_parameters(), again.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
        assert not p1.requires_grad
    text = "Name three birds that cannot fly."
    assert build_tiny_tokenizer().encode(text) == tiny_lm.tokenizer.encode(text)
    assert tiny_lm.tokenizer.decode(tiny_lm.tokenizer.encode(text)) == text
    ids = chat_prompt_ids(tiny_lm.tokenizer, text)
    assert ids[0] == tiny_lm.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_hub_id_fails_fast_without_network(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    t0 = time.time()
    with pytest.raises(UserError) as e:
        load_model(ModelConfig(source="hub", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", hub_timeout_s=2))
    assert time.time() - t0 < 15
    assert "model.hub_id" in str(e.value) and "not reachable" in str(e.value)


def _lora_grads(model, ids):
    """Gradients of a fixed LoRA branch on q_proj/v_proj, computed through the (quantized) base."""
    torch.manual_seed(0)
    hooks, params = [], []
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            a = torch.nn.Parameter(torch.randn(4, lin.in_features) * 0.1)
            b = torch.nn.Parameter(torch.randn(lin.out_features, 4) * 0.1)
            params += [a, b]
            hooks.append(lin.register_forward_hook(lambda m, inp, out, a=a, b=b: out + inp[0] @ a.t() @ b.t()))
    model(ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_quantized_base_forward_on_cpu(quant):
    lm = load_model(ModelConfig(source="tiny", quantization=quant, device="cpu"))
    ids = torch.tensor([chat_prompt_ids(lm.tokenizer, "hello there")])
    with torch.inference_mode():
        logits = lm.model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(lm.tokenizer))
    assert torch.isfinite(logits).all()


def test_4bit_lora_gradients_stay_correct_after_inference():
    """bitsandbytes repacks 4-bit weights on a CPU inference forward (AVX512-BF16 CPUs), after which
    LoRA gradients are silently wrong. The loader must switch that off: gradients after serving must
    equal gradients on a model that never served."""
    import bitsandbytes as bnb

    cfg = ModelConfig(source="tiny", quantization="nf4", device="cpu")
    fresh, served = load_model(cfg), load_model(cfg)
    layers = [m for m in served.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        served.model(ids)  # the serving forward that would repack
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    for g_ref, g in zip(_lora_grads(fresh.model, ids), _lora_grads(served.model, ids)):
        assert torch.nn.functional.cosine_similarity(g_ref.flatten(), g.flatten(), dim=0) > 0.999


def test_a_quantized_base_is_placed_on_a_device_transformers_can_name(monkeypatch):
    """`device: cuda` resolves to a bare "cuda" (index None); transformers cannot place a model on None."""
    from collm.edge_client.model.loading import quantized_device_map

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # what a one-GPU machine answers
    assert quantized_device_map(torch.device("cpu")) == {"": "cpu"}
    assert quantized_device_map(torch.device("cuda")) == {"": 0}
    assert quantized_device_map(torch.device("cuda:1")) == {"": 1}


@pytest.mark.slow
def test_bundled_smollm2_answers_offline(smollm2_lm):
    lm = smollm2_lm
    assert lm.name == "smollm2-135m-instruct"
    ids = torch.tensor([chat_prompt_ids(lm.tokenizer, "What is the capital of France?")])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
