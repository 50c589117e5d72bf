"""A/B of the fused q/k/v and gate/up projections in ModelRunner (this commit only; reverted next).

    python benchmarks/ab_fused_projections.py 16

Same process, same weights, interleaved rounds: the runner with its fused plans vs the same runner
with every LayerPlan set to None (one call per projection), with and without LoRA, SmolLM2 fp32.
Prints median and min ms per decode step / prefill and the fused/unfused ratios.
"""
import sys, time, statistics, torch
sys.path.insert(0, "benchmarks")
from benchkit import load_lm, shared_copy, random_adapter_state
from collm.common.config import LORA_TARGETS_LLAMA
from collm.edge_client.model.lora import inject_lora
from collm.edge_client.model.runner import ModelRunner, Segment, LayerPlan
torch.manual_seed(0)
lm = load_lm("smollm2", "cpu", "float32")
base = lm.model
ours = shared_copy(base)
layers = inject_lora(ours, LORA_TARGETS_LLAMA, 8, 16.0)
w = layers.serving_weights(random_adapter_state(layers, seed=1, b_scale=0.02), 1, torch.device("cpu"), torch.float32)
def unfused(r):
    r.plans = [LayerPlan(None, None)] * len(r.plans); return r
V = {"base-fused": (ModelRunner(base), None), "base-unfused": (unfused(ModelRunner(base)), None),
     "lora-fused": (ModelRunner(ours), w), "lora-unfused": (unfused(ModelRunner(ours)), w)}
P, K, R = 128, 16, int(sys.argv[1])
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 40000, (P,), generator=g).tolist() for _ in range(8)]
pool = V["base-fused"][0].new_pool(8, P + K + 8)
t = {}
for rnd in range(R):
    for B in (1, 8):
        names = list(V); names = names[rnd % 4:] + names[:rnd % 4]
        for n in names:
            r, ad = V[n]
            t0 = time.perf_counter(); out = r.forward([Segment(i, 0, prompts[i], ad, True) for i in range(B)], pool)
            t.setdefault((n, B, "prefill"), []).append(time.perf_counter() - t0)
            toks = out.argmax(-1).tolist()
            for k in range(K):
                t0 = time.perf_counter()
                toks = r.forward([Segment(i, P + k, [toks[i]], ad, True) for i in range(B)], pool).argmax(-1).tolist()
                t.setdefault((n, B, "decode"), []).append(time.perf_counter() - t0)
import os
agg = min if os.environ.get("AGG") == "min" else statistics.median
med = {k: 1000 * agg(v) for k, v in t.items()}
for agg_name, agg in (("median", statistics.median), ("min", min)):
  med = {k: 1000 * agg(v) for k, v in t.items()}
  print(agg_name)
  for ph in ("decode", "prefill"):
    for B in (1, 8):
        m = {n: med[(n, B, ph)] for n in V}
        print(f"{ph} b{B}: " + ", ".join(f"{n} {m[n]:.1f}" for n in V) +
              f" | lora fused/unfused {m['lora-fused']/m['lora-unfused']:.3f}, base fused/unfused {m['base-fused']/m['base-unfused']:.3f}, lora/base fused {m['lora-fused']/m['base-fused']:.3f} unfused {m['lora-unfused']/m['base-unfused']:.3f}")
