"""The engine on a CUDA device: what only a GPU can check (skipped without one; benchmarks/gpu_check.sh runs
these, and the CPU tests with COLLM_TEST_DEVICE=cuda, on a lent GPU).

The same tiny model and adapter greedily decode the same tokens on the GPU as on the CPU; training on the GPU
beside serving publishes a version the GPU then serves; a 4-bit (nf4) base on the GPU gives LoRA the gradients
of its de-quantized weights (QLoRA's premise, the path a GPU edge with `quantization: nf4` trains on)."""

import pytest
import torch
from helpers import prompt, random_adapter_state, tiny_engine

from collm.edge_client.config import ModelConfig
from collm.edge_client.model.loading import load_model
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.trainer import TrainBudget

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Name three birds.", "Why is the sky blue?"]


def _greedy_tokens(device: str) -> list[list[int]]:
    eng = tiny_engine(model={"device": device})
    try:
        eng.shadow.publish(random_adapter_state(eng, 3), 1)
        assert eng.device.type == device
        return [eng.generate(prompt(eng, p), GREEDY).token_ids for p in PROMPTS]
    finally:
        eng.stop()


def test_greedy_tokens_on_the_gpu_equal_the_cpus():
    cpu, gpu = _greedy_tokens("cpu"), _greedy_tokens("cuda")
    # float32 on both (TF32 off by default); summation order differs, so a near-tie may flip a token, and the
    # rest of that sequence then follows it: allowed in the last few tokens only, never in the first four
    assert all(c[:4] == g[:4] for c, g in zip(cpu, gpu)), (cpu, gpu)
    same = sum(a == b for c, g in zip(cpu, gpu) for a, b in zip(c, g))
    assert same >= 0.9 * sum(len(c) for c in cpu), (cpu, gpu)


def test_training_on_the_gpu_beside_serving_publishes_a_version_it_serves():
    eng = tiny_engine(model={"device": "cuda"})
    try:
        job = eng.train(TrainBudget(steps=3))
        outs = [eng.generate(prompt(eng, p), GREEDY) for p in PROMPTS]
        rep = job.result(timeout=120)
        assert rep.steps == 3 and rep.tokens > 0 and rep.first_loss is not None
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
        state = eng.trainer.adapter.state_dict_peft()
        assert all(t.device.type == "cuda" and torch.isfinite(t).all() for t in state.values())
        eng.shadow.publish(state, 7)
        assert eng.generate(prompt(eng, PROMPTS[0]), GREEDY).record.adapter_version == 7
    finally:
        eng.stop()


def _lora_grads(model, ids):
    """Gradients of a fixed LoRA branch on q_proj/v_proj, computed through the (quantized) base."""
    g = torch.Generator().manual_seed(0)
    hooks, params = [], []
    for layer in model.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            a = torch.nn.Parameter((torch.randn(4, lin.in_features, generator=g) * 0.1).to(ids.device))
            b = torch.nn.Parameter((torch.randn(lin.out_features, 4, generator=g) * 0.1).to(ids.device))
            params += [a, b]
            hooks.append(lin.register_forward_hook(lambda m, inp, out, a=a, b=b: out + inp[0] @ a.t() @ b.t()))
    model(ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    return [p.grad.float().cpu() for p in params]


def test_nf4_base_on_the_gpu_gives_lora_the_gradients_of_its_dequantized_weights():
    import bitsandbytes as bnb

    q = load_model(ModelConfig(source="tiny", quantization="nf4", device="cuda"))
    layers = [m for m in q.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.device.type == "cuda" for m in layers)
    ref = load_model(ModelConfig(source="tiny", device="cuda"))  # same weights, then de-quantized like nf4's
    named = dict(ref.model.named_modules())
    with torch.no_grad():
        for name, m in q.model.named_modules():
            if isinstance(m, bnb.nn.Linear4bit):
                deq = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
                named[name].weight.copy_(deq.to(named[name].weight.dtype))
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(1)).to("cuda")
    with torch.inference_mode():
        q.model(ids)  # a serving forward first, as on an edge
    for g_ref, g in zip(_lora_grads(ref.model, ids), _lora_grads(q.model, ids)):
        assert torch.nn.functional.cosine_similarity(g_ref.flatten(), g.flatten(), dim=0) > 0.99
