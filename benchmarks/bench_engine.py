"""Benchmark of the CoLLM edge engine: unmerged-LoRA serving cost, hot swap, co-scheduling, memory.

    python benchmarks/bench_engine.py --quick                 # ~2-minute smoke run
    python benchmarks/bench_engine.py                         # full run (~10 minutes on 2 CPU cores)
    python benchmarks/bench_engine.py --sections 1,2 --dtype bfloat16 --device auto

Four sections, each printing a table with ratios against baselines measured in the same run
(every number is a median over interleaved repeats unless it says otherwise):

1. kernels: decode step (context ~128) and prefill (128-token prompt per sequence), batch 1 and 8,
   for HF base-only, PEFT unmerged, PEFT merged, our ModelRunner without LoRA layers, and our
   ModelRunner with LoRA layers and a non-zero adapter (the engine's serving path).
2. swap: a real Engine with N streaming clients while a thread publishes a new adapter version
   every few ms; inter-token gaps during vs outside publishes, publish cost, failed/mixed requests.
3. cosched: SmolLM2 replica capacity (closed loop), then open-loop Poisson load at 50% and 90% of it,
   serving alone vs with a large training job co-scheduled; training tokens/s under load vs alone.
4. memory: peak RSS of child processes: one process serving + training vs a serving process plus a
   training process, each with its own materialized float32 base; default malloc vs MALLOC_ARENA_MAX=2.

Results go to --out (JSON). See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import gc
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from benchkit import table  # noqa: E402

from collm.common.stats import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()
QUIET = False


def say(msg: str) -> None:
    if not QUIET:
        print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def med(values) -> float | None:
    return statistics.median(values) if values else None


def ratio(a, b) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def fmt(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) // 1024
    return out


def _cpu_jiffies() -> tuple[int, int, int]:
    """(all CPUs total, all CPUs idle, this process incl. waited-for children), in clock ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return sum(v), v[3] + v[4], own


class CpuMeter:
    """Fraction of the machine's CPU time used by OTHER processes between start() and stop()."""

    def start(self) -> CpuMeter:
        self._a = _cpu_jiffies()
        return self

    def stop(self) -> float:
        b = _cpu_jiffies()
        total = b[0] - self._a[0]
        busy = total - (b[1] - self._a[1]) - (b[2] - self._a[2])
        return max(0.0, busy / total) if total > 0 else 0.0


NOISE: list[dict] = []  # one entry per timed block: others' CPU share before (wait) and during


def wait_quiet(label: str, max_wait_s: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold of the CPUs; return their share."""
    t0 = time.perf_counter()
    while True:
        m = CpuMeter().start()
        time.sleep(0.5)
        busy = m.stop()
        waited = time.perf_counter() - t0
        if busy < threshold or waited >= max_wait_s:
            if waited > 1.0 or busy >= threshold:
                say(f"  (waited {waited:.0f} s for a quiet machine before {label}: others use {busy:.0%} of CPU)")
            NOISE.append({"label": label, "others_before": busy, "waited_s": waited})
            return busy


def noisy_tag(prefix: str) -> str:
    """' [NOISY: ...]' if other processes used >= 15% of the CPUs during any timed block starting with prefix."""
    xs = [n["others_during"] for n in NOISE if "others_during" in n and n["label"].startswith(prefix)]
    bad = [x for x in xs if x >= 0.15]
    return f" [NOISY: other processes used up to {max(bad):.0%} of the CPUs during {len(bad)}/{len(xs)} blocks]" \
        if bad else ""


def note_during(label: str, share: float) -> None:
    NOISE.append({"label": label, "others_during": share})
    if share >= 0.15:
        say(f"  (noisy: other processes used {share:.0%} of the CPUs during {label})")


def load_lm(which: str, device: str, dtype: str):
    from collm.edge_client.config import ModelConfig
    from collm.edge_client.model.loading import load_model

    return load_model(ModelConfig(source="tiny" if which == "tiny" else "bundled", device=device, dtype=dtype))


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """New module objects holding the SAME parameter and buffer tensors (no second base in memory)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def random_adapter_state(layers, seed: int, b_scale: float) -> dict[str, torch.Tensor]:
    """A PEFT-keyed LoRA state: A like PEFT's init, B random non-zero (so the adapter changes outputs)."""
    from collm.common.adapter_io import peft_key

    g = torch.Generator().manual_seed(seed)
    st = {}
    for m in layers.layers:
        bound = 1.0 / math.sqrt(m.in_features)
        st[peft_key(m.path, "A")] = (torch.rand(layers.r, m.in_features, generator=g) * 2 - 1) * bound
        st[peft_key(m.path, "B")] = torch.randn(m.out_features, layers.r, generator=g) * b_scale
    return st


def dolly_prompts(tokenizer, n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    from collm.common.data import chat_prompt_ids, load_records

    recs = load_records()
    random.Random(seed).shuffle(recs)
    out = []
    for r in recs:
        ids = chat_prompt_ids(tokenizer, r.prompt())
        if len(ids) <= max_len:
            out.append(ids)
        if len(out) >= n:
            break
    return out


# =============================================================================== 1. kernels
class _HFVariant:
    """Prefill then decode through an HF (or PEFT) model with a DynamicCache, last-token logits only."""

    def __init__(self, name: str, model, device):
        self.name, self.model, self.device = name, model, device
        self.cache = None
        self.tok = None

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        ids = torch.tensor(prompts, device=self.device)
        cfg = getattr(self.model, "config", None)
        self.cache = DynamicCache(config=cfg)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        self.tok = logits.argmax(-1, keepdim=True)
        return logits

    @torch.inference_mode()
    def decode(self) -> None:
        out = self.model(input_ids=self.tok, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)

    def reset(self) -> None:
        self.cache = self.tok = None


class _OursVariant:
    """Prefill then decode through our ModelRunner and slot KV pool (the engine's serving path)."""

    def __init__(self, name: str, runner, pool, adapter):
        self.name, self.runner, self.pool, self.adapter = name, runner, pool, adapter
        self.pos = 0
        self.toks: list[int] = []

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        from collm.edge_client.model.runner import Segment

        segs = [Segment(i, 0, p, self.adapter, True) for i, p in enumerate(prompts)]
        logits = self.runner.forward(segs, self.pool)
        self.toks = logits.argmax(-1).tolist()
        self.pos = len(prompts[0])
        return logits

    def decode(self) -> None:
        from collm.edge_client.model.runner import Segment

        segs = [Segment(i, self.pos, [t], self.adapter, True) for i, t in enumerate(self.toks)]
        self.toks = self.runner.forward(segs, self.pool).argmax(-1).tolist()
        self.pos += 1

    def reset(self) -> None:
        self.pos, self.toks = 0, []


def bench_kernels(which: str, args, dev: torch.device) -> dict:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    from collm.common.config import LORA_TARGETS_LLAMA
    from collm.edge_client.model.lora import inject_lora
    from collm.edge_client.model.runner import ModelRunner

    r, alpha = 8, 16.0  # as in configs/edge-*.yaml
    P = 128
    K = args.k_decode
    rounds = args.rounds
    say(f"[kernels/{which}] loading {which} ({args.dtype}, {dev})")
    lm = load_lm(which, args.device, args.dtype)
    base = lm.model
    vocab = base.config.vocab_size

    say(f"[kernels/{which}] building variants: PEFT unmerged / merged, our runner with and without LoRA")
    ours_model = shared_copy(base)
    layers = inject_lora(ours_model, LORA_TARGETS_LLAMA, r, alpha)
    b_scale = 0.5 if which == "tiny" else 0.02
    state = random_adapter_state(layers, seed=1, b_scale=b_scale)
    weights = layers.serving_weights(state, 1, dev, lm.dtype)

    peft_m = get_peft_model(shared_copy(base), PeftLoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                              target_modules=list(LORA_TARGETS_LLAMA)))
    res = set_peft_model_state_dict(peft_m, state)
    missing = [k for k in getattr(res, "missing_keys", []) if "lora_" in k]
    if missing:
        raise RuntimeError(f"PEFT adapter load missed {len(missing)} LoRA keys, e.g. {missing[0]}")
    peft_m.eval()
    merged = copy.deepcopy(peft_m).merge_and_unload().eval()  # its own weights: merging writes them
    pool = ModelRunner(base).new_pool(8, P + K + 8)
    variants = [
        _HFVariant("hf-base", base, dev),
        _HFVariant("peft-unmerged", peft_m, dev),
        _HFVariant("peft-merged", merged, dev),
        _OursVariant("ours-base", ModelRunner(base), pool, None),  # runner over the plain HF modules
        _OursVariant("ours-lora", ModelRunner(ours_model), pool, weights),
    ]
    g = torch.Generator().manual_seed(0)
    prompts8 = [torch.randint(3, vocab, (P,), generator=g).tolist() for _ in range(8)]

    # sanity: every path computes the same model (LoRA variants vs each other, base vs base)
    lg = {v.name: v.prefill(prompts8[:2]).float().cpu() for v in variants}
    for v in variants:
        v.reset()
    checks = {
        "ours-lora vs peft-unmerged": (lg["ours-lora"] - lg["peft-unmerged"]).abs().max().item(),
        "peft-merged vs peft-unmerged": (lg["peft-merged"] - lg["peft-unmerged"]).abs().max().item(),
        "ours-base vs hf-base": (lg["ours-base"] - lg["hf-base"]).abs().max().item(),
        "adapter effect (peft-unmerged vs hf-base)": (lg["peft-unmerged"] - lg["hf-base"]).abs().max().item(),
    }
    say(f"[kernels/{which}] max |logit diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()))

    # warm-up: short shapes, one decode step each
    for B in (1, 8):
        for v in variants:
            v.prefill([p[:16] for p in prompts8[:B]])
            v.decode()
            v.reset()
    times: dict[tuple[str, int, str], list[tuple[int, float]]] = {}  # -> [(round, seconds)]
    round_noise: dict[tuple[int, int], float] = {}
    for B in args.batches:
        for rnd in range(rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]  # rotate the order
            label = f"kernels/{which} batch {B} round {rnd + 1}/{rounds}"
            wait_quiet(label, args.wait_quiet)
            say(f"[{label}]: prefill {P} tok + {K} decode steps x {len(variants)} variants")
            meter = CpuMeter().start()
            for v in order:
                sync(dev)
                t = time.perf_counter()
                v.prefill(prompts8[:B])
                sync(dev)
                times.setdefault((v.name, B, "prefill"), []).append((rnd, time.perf_counter() - t))
                for _ in range(K):
                    t = time.perf_counter()
                    v.decode()
                    sync(dev)
                    times.setdefault((v.name, B, "decode"), []).append((rnd, time.perf_counter() - t))
                v.reset()
            round_noise[(B, rnd)] = meter.stop()
            note_during(label, round_noise[(B, rnd)])
    # use the rounds in which other processes stayed under 15% of the CPUs (all rounds if none did)
    used_rounds = {}
    for B in args.batches:
        quiet_r = [r_ for r_ in range(rounds) if round_noise[(B, r_)] < 0.15]
        used_rounds[B] = quiet_r or list(range(rounds))
    out = {"model": lm.name, "dtype": args.dtype, "device": str(dev), "prompt_tokens": P, "decode_steps": K,
           "rounds": rounds, "lora_r": r, "lora_targets": list(LORA_TARGETS_LLAMA), "logit_checks": checks,
           "round_noise": {f"b{B}": [round_noise[(B, r_)] for r_ in range(rounds)] for B in args.batches},
           "rounds_used": {f"b{B}": used_rounds[B] for B in args.batches}, "results": {}}
    for (name, B, phase), samples in times.items():
        ts = [x for r_, x in samples if r_ in used_rounds[B]]
        out["results"].setdefault(phase, {}).setdefault(str(B), {})[name] = {
            "median_ms": 1000 * med(ts), "min_ms": 1000 * min(ts), "p90_ms": 1000 * percentile(ts, 0.9), "n": len(ts),
            "median_all_rounds_ms": 1000 * med([x for _, x in samples])}
    # ratios
    rat = {}
    for phase in ("decode", "prefill"):
        for B in args.batches:
            m = {n: d["median_ms"] for n, d in out["results"][phase][str(B)].items()}
            rat[f"{phase}_b{B}"] = {
                "ours-lora / hf-base": ratio(m["ours-lora"], m["hf-base"]),
                "ours-lora / ours-base": ratio(m["ours-lora"], m["ours-base"]),
                "ours-base / hf-base": ratio(m["ours-base"], m["hf-base"]),
                "peft-unmerged / peft-merged": ratio(m["peft-unmerged"], m["peft-merged"]),
                "peft-unmerged / hf-base": ratio(m["peft-unmerged"], m["hf-base"]),
                "ours-lora / peft-unmerged": ratio(m["ours-lora"], m["peft-unmerged"]),
            }
    out["ratios"] = rat
    del variants, peft_m, merged, ours_model, base, lm
    gc.collect()
    return out


def print_kernels(res: dict, batches) -> None:
    names = ["hf-base", "peft-unmerged", "peft-merged", "ours-base", "ours-lora"]
    rows = []
    for phase in ("decode", "prefill"):
        for B in batches:
            d = res["results"][phase][str(B)]
            hf = d["hf-base"]["median_ms"]
            rows.append([f"{phase} b{B}"] + [f"{d[n]['median_ms']:.2f} ({d[n]['median_ms'] / hf:.2f}x)"
                                             for n in names])
    print(f"\n== 1. Serving kernels: {res['model']} ({res['dtype']}, {res['device']}), median ms per step for decode "
          f"at context {res['prompt_tokens']}..{res['prompt_tokens'] + res['decode_steps']}, ms per prefill of "
          f"{res['prompt_tokens']} tok/seq; (x) = / hf-base")
    print(table(["phase"] + names, rows))
    for B in batches:
        used, noise = res["rounds_used"][f"b{B}"], res["round_noise"][f"b{B}"]
        print(f"batch {B}: medians over rounds {[u + 1 for u in used]} of {len(noise)} (others' CPU share per round: "
              + ", ".join(f"{x:.0%}" for x in noise) + ("; no quiet round, all used" if all(x >= 0.15 for x in noise)
                                                         else "") + ")")
    rrows = []
    keys = list(next(iter(res["ratios"].values())).keys())
    for k, v in res["ratios"].items():
        rrows.append([k] + [fmt(v[c], "x") for c in keys])
    print(table(["ratio"] + keys, rrows))
    for B in batches:
        if B == 8:
            r = res["ratios"]["decode_b8"]
            for base in ("hf-base", "ours-base"):
                x = r[f"ours-lora / {base}"]
                verdict = "MET" if x is not None and x <= 1.10 else "NOT MET"
                noisy = all(n_ >= 0.15 for n_ in res["round_noise"]["b8"])
                print(f"target: batch-8 decode, ours-lora <= 1.10x {base}: {x:.3f}x -> {verdict}"
                      + (" [NOISY: no quiet round]" if noisy else ""))


# =============================================================================== 2. swap under load
class _TimedLayers:
    """Delegates to the engine's LoRALayers; records when each publish's copy starts and ends."""

    def __init__(self, inner):
        self._inner = inner
        self.last: tuple[float, float] | None = None

    def serving_weights(self, *a, **k):
        t = time.perf_counter()
        w = self._inner.serving_weights(*a, **k)
        self.last = (t, time.perf_counter())
        return w

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _engine_cfg(which: str, device: str, dtype: str, extra: dict | None = None):
    from collm.common.config import deep_merge, load_config, validate_config
    from collm.edge_client.config import EdgeConfig

    over = {"model": {"device": device, "dtype": dtype}}
    if extra:
        over = deep_merge(over, extra)
    if which == "tiny":
        base = {
            "name": "bench-tiny", "model": {"source": "tiny"},
            "engine": {"max_running": 8, "kv_cache_mb": 16, "step_token_budget": 128, "warmup": True},
            "slo": {"ttft_ms": 1000, "tpot_ms": 100},
            "data": {"categories": ["open_qa"], "max_records": 200},
            "training": {"micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 96, "max_eval_records": 16},
        }
        return validate_config(EdgeConfig, deep_merge(base, over), "bench-tiny")
    return load_config(EdgeConfig, ROOT / "configs" / "edge-smollm2.yaml", over)


def _mixed_version_steps(eng, states, dev, rounds: int) -> dict:
    """Batch-8 decode step of the engine's runner with 1, 2, 4 or 8 distinct adapter versions in the batch.

    Runs on the engine's pool before the engine starts (slots 0-7, context 64); segments are sorted
    by version as the engine's planner does, so each version is one contiguous row group.
    """
    from collm.edge_client.model.runner import Segment

    ws = [eng.layers.serving_weights(states[i % len(states)], 1000 + i, eng.device, eng.lm.dtype) for i in range(8)]
    g = torch.Generator().manual_seed(3)
    ctx = min(64, eng.max_context - 2)
    for i in range(8):
        ids = torch.randint(3, eng.runner.vocab_size, (ctx,), generator=g).tolist()
        eng.runner.forward([Segment(i, 0, ids, ws[0], False)], eng.pool)
    times: dict[int, list[float]] = {nv: [] for nv in (1, 2, 4, 8)}
    wait_quiet("swap mixed-version steps", 10)
    meter = CpuMeter().start()
    for rnd in range(rounds + 1):  # round 0: warm-up, not kept
        for nv in times:
            segs = sorted((Segment(i, ctx, [5], ws[i % nv], True) for i in range(8)), key=lambda x: x.adapter.version)
            sync(dev)
            t = time.perf_counter()
            eng.runner.forward(segs, eng.pool)
            sync(dev)
            if rnd:
                times[nv].append(time.perf_counter() - t)
    note_during("swap mixed-version steps", meter.stop())
    base = med(times[1])
    return {f"{nv} version{'s' if nv > 1 else ''}": {"median_ms": 1000 * med(ts), "vs_1": med(ts) / base}
            for nv, ts in times.items()}


def _greedy_margin(eng, w, prompt: list[int], out_ids: list[int]) -> float:
    """Largest (max logit - logit of the emitted token) over a request's output, teacher-forced under `w`.

    ~0 means every emitted token was a greedy choice of version `w` (a mismatch with the reference is
    then a near-tie flipped by batch-dependent rounding); a large value means some token was not.
    """
    from collm.edge_client.model.lora import ServingBinding, bind

    ids = torch.tensor([prompt + out_ids[:-1]], device=eng.device)
    with torch.inference_mode(), bind(ServingBinding([(0, ids.numel(), w)])):
        logits = eng.lm.model(ids).logits[0, len(prompt) - 1:].float()
    chosen = logits.gather(1, torch.tensor(out_ids, device=eng.device)[:, None])[:, 0]
    return (logits.max(-1).values - chosen).max().item()


def bench_swap(which: str, args, dev: torch.device) -> dict:
    from collm.common.data import chat_prompt_ids
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.engine import Engine, EngineError, FinishEvent, TokenEvent
    from collm.edge_client.model.sampling import SamplingParams

    quick = args.quick
    n_clients = 8
    if which == "tiny":
        max_tokens, phase_s, b_scale = 32, (3.0 if quick else 5.0), 0.5
        intervals = [0.01] if quick else [0.005, 0.05]
    else:
        max_tokens, phase_s, b_scale = 16, (10.0 if quick else 15.0), 0.2
        intervals = [0.1]
    reps = 1 if quick else 2
    cfg = _engine_cfg(which, args.device, args.dtype, {"engine": {"max_running": n_clients}})
    say(f"[swap/{which}] loading model and starting an engine (max_running {n_clients})")
    lm = load_model(cfg.model)
    eng = Engine(lm, cfg, None)
    n_states = 4
    states = [random_adapter_state(eng.layers, seed=100 + s, b_scale=b_scale) for s in range(n_states)]
    mixed = _mixed_version_steps(eng, states, dev, rounds=5 if quick else 15)
    say(f"[swap/{which}] batch-8 decode step with 1/2/4/8 adapter versions in the batch: "
        + ", ".join(f"{k} {v['median_ms']:.2f} ms ({v['vs_1']:.2f}x)" for k, v in mixed.items()))
    eng.start()
    timed = _TimedLayers(eng.shadow._layers)
    eng.shadow._layers = timed  # instrument the copy half of publish (benchmark-only, not an engine change)
    steps_log: list[tuple[float, float, int, int]] = []  # (start, end, distinct versions, segments)
    orig_forward = eng.runner.forward

    def timed_forward(segments, pool):  # instance attribute shadows the method: benchmark-only probe
        t = time.perf_counter()
        out = orig_forward(segments, pool)
        steps_log.append((t, time.perf_counter(), len({id(x.adapter) for x in segments}), len(segments)))
        return out

    eng.runner.forward = timed_forward
    try:
        texts = ["What is the capital of France?", "Name three birds.", "Why is the sky blue?",
                 "Write a haiku about rain.", "How do magnets work?", "List prime numbers below 20.",
                 "Explain photosynthesis briefly.", "What is a LoRA adapter?"]
        prompts = [chat_prompt_ids(eng.tokenizer, t) for t in texts]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        # standalone copy cost (idle engine), median of repeats
        copy_idle = []
        for i in range(20):
            t = time.perf_counter()
            eng.layers.serving_weights(states[i % n_states], -1, eng.device, eng.lm.dtype)
            copy_idle.append(time.perf_counter() - t)

        say(f"[swap/{which}] references: {n_states} versions x {len(prompts)} prompts, one request at a time")
        version = 0
        state_of: dict[int, int] = {}
        refs: dict[tuple[int, int], list[int]] = {}
        for s in range(n_states):
            version += 1
            eng.shadow.publish(states[s], version)
            state_of[version] = s
            for pi, ids in enumerate(prompts):
                refs[(s, pi)] = eng.generate(ids, params).token_ids
        distinct = len({tuple(refs[(s, 0)]) for s in range(n_states)})
        say(f"[swap/{which}] {distinct}/{n_states} versions give distinct outputs for prompt 0")

        def run_phase(interval: float | None):
            stop = threading.Event()
            results, errors = [], []
            lock = threading.Lock()
            windows: list[tuple[float, float, float, float]] = []  # publish start, copy start/end, end

            def client(ci: int):
                k = 0
                while not stop.is_set():
                    pi = (ci + k) % len(prompts)
                    k += 1
                    done = threading.Event()
                    ts: list[float] = []
                    box = []

                    def on_event(ev, ts=ts, box=box, done=done):
                        if isinstance(ev, TokenEvent):
                            ts.append(time.perf_counter())
                        elif isinstance(ev, FinishEvent):
                            box.append(ev)
                            done.set()
                    try:
                        eng.submit(prompts[pi], params, on_event)
                    except EngineError as e:
                        with lock:
                            errors.append(repr(e))
                        continue
                    if not done.wait(120):
                        with lock:
                            errors.append("timeout")
                        continue
                    with lock:
                        results.append((pi, box[0], ts))

            def publisher():
                nonlocal version
                while not stop.wait(interval):
                    version += 1
                    s = version % n_states
                    state_of[version] = s
                    t0 = time.perf_counter()
                    eng.shadow.publish(states[s], version, source="bench")
                    t1 = time.perf_counter()
                    c0, c1 = timed.last
                    windows.append((t0, c0, c1, t1))

            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n_clients)]
            if interval is not None:
                threads.append(threading.Thread(target=publisher, daemon=True))
            start = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(phase_s)
            stop.set()
            for t in threads:
                t.join(180)
            return results, errors, windows, time.perf_counter() - start

        phases = [None] + intervals
        agg: dict[str, dict] = {}
        for rep in range(reps):
            for iv in phases:
                label = "no-swap" if iv is None else f"swap every {iv * 1000:g} ms"
                say(f"[swap/{which}] phase '{label}' ({phase_s:g} s, {n_clients} streaming clients), "
                    f"repeat {rep + 1}/{reps}")
                wait_quiet(f"swap/{which} {label}", args.wait_quiet)
                meter = CpuMeter().start()
                n_steps0 = len(steps_log)
                results, errors, windows, dur = run_phase(iv)
                note_during(f"swap/{which} {label}", meter.stop())
                a = agg.setdefault(label, {"interval_s": iv, "gaps_all": [], "gaps_swap": [], "gaps_clear": [],
                                           "publish_s": [], "copy_s": [], "flip_s": [], "requests": 0,
                                           "failed": 0, "errors": [], "wrong_version": 0, "mismatch": 0,
                                           "tokens": 0, "seconds": 0.0, "versions_seen": set(), "steps": [],
                                           "mismatches": []})
                a["steps"] += steps_log[n_steps0:]
                starts = [w[0] for w in windows]
                ends_prefix_max = []
                m = -1.0
                for w in windows:
                    m = max(m, w[3])
                    ends_prefix_max.append(m)
                for pi, ev, ts in results:
                    a["requests"] += 1
                    a["tokens"] += len(ev.token_ids)
                    v = ev.record.adapter_version
                    a["versions_seen"].add(v)
                    if ev.reason != "length" or len(ts) != len(ev.token_ids):
                        a["failed"] += 1
                        continue
                    if ev.token_ids != refs[(state_of[v], pi)]:
                        others = [s for s in range(n_states) if s != state_of[v] and refs[(s, pi)] == ev.token_ids]
                        a["wrong_version" if others else "mismatch"] += 1
                        a["mismatches"].append((pi, state_of[v], ev.token_ids))
                    for i in range(1, len(ts)):
                        lo, hi = ts[i - 1], ts[i]
                        gap = hi - lo
                        a["gaps_all"].append(gap)
                        # does any publish window [w0, w1] overlap (lo, hi)?
                        j = bisect.bisect_left(starts, hi) - 1  # last window starting before hi
                        overl = j >= 0 and ends_prefix_max[j] > lo
                        (a["gaps_swap"] if overl else a["gaps_clear"]).append(gap)
                a["failed"] += len(errors)
                a["errors"] += errors[:5]
                a["seconds"] += dur
                for w0, c0, c1, w1 in windows:
                    a["publish_s"].append(w1 - w0)
                    a["copy_s"].append(c1 - c0)
                    a["flip_s"].append(w1 - c1)
        alive = eng.shadow.alive_versions()
        # every request that differs from its version's reference: was each token still a greedy choice
        # of its pinned version (near-tie flipped by batch-dependent rounding) or not (a real mix-up)?
        wts = [eng.layers.serving_weights(st, -1, eng.device, eng.lm.dtype) for st in states]
        tol = 1e-3 if lm.dtype == torch.float32 else 5e-2
        for label, a in agg.items():
            margins = [_greedy_margin(eng, wts[s_], prompts[pi], ids) for pi, s_, ids in a["mismatches"][:40]]
            a["mismatch_margins"] = margins
            a["mismatch_explained"] = sum(m_ <= tol for m_ in margins)
            a["mismatch_checked"] = len(margins)
            # the signature of the 1-token-final-prefill-chunk bug (see README): the first token repeated
            a["mismatch_first_token_repeated"] = sum(len(set(ids)) == 1 for _, _, ids in a["mismatches"])
        # control: a few matching requests must have margin ~0 under their version and > tol under another
        ctrl = [(_greedy_margin(eng, wts[0], prompts[pi], refs[(0, pi)]),
                 _greedy_margin(eng, wts[1], prompts[pi], refs[(0, pi)])) for pi in range(min(3, len(prompts)))]
    finally:
        eng.stop()
    base_gaps = agg["no-swap"]["gaps_all"]
    out = {"model": lm.name, "which": which, "clients": n_clients, "max_tokens": max_tokens, "phase_s": phase_s,
           "repeats": reps,
           "distinct_reference_versions": distinct, "copy_idle_ms_p50": 1000 * med(copy_idle),
           "alive_versions_at_end": alive, "mixed_version_decode_b8": mixed,
           "margin_control_same_vs_other_version": ctrl, "margin_tolerance": tol, "phases": {}}
    for label, a in agg.items():
        ms = lambda xs, q: None if not xs else 1000 * percentile(xs, q)  # noqa: E731
        out["phases"][label] = {
            "interval_ms": None if a["interval_s"] is None else 1000 * a["interval_s"],
            "requests": a["requests"], "tokens_per_s": a["tokens"] / a["seconds"],
            "failed": a["failed"], "errors": a["errors"], "wrong_version": a["wrong_version"],
            "mismatch_not_any_version": a["mismatch"], "versions_seen": len(a["versions_seen"]),
            "publishes": len(a["publish_s"]),
            "gap_p50_ms": ms(a["gaps_all"], 0.5), "gap_p99_ms": ms(a["gaps_all"], 0.99),
            "gap_during_swap_n": len(a["gaps_swap"]),
            "gap_during_swap_p50_ms": ms(a["gaps_swap"], 0.5), "gap_during_swap_p99_ms": ms(a["gaps_swap"], 0.99),
            "gap_outside_swap_p50_ms": ms(a["gaps_clear"], 0.5),
            "gap_outside_swap_p99_ms": ms(a["gaps_clear"], 0.99),
            "publish_p50_ms": ms(a["publish_s"], 0.5), "publish_p99_ms": ms(a["publish_s"], 0.99),
            "copy_p50_ms": ms(a["copy_s"], 0.5), "flip_p50_us": None if not a["flip_s"] else 1e6 * percentile(a["flip_s"], .5),
            "flip_p99_us": None if not a["flip_s"] else 1e6 * percentile(a["flip_s"], 0.99),
            "mismatch_checked": a["mismatch_checked"], "mismatch_greedy_consistent": a["mismatch_explained"],
            "mismatch_max_margin": max(a["mismatch_margins"], default=None),
            "mismatch_first_token_repeated": a["mismatch_first_token_repeated"],
            "steps": len(a["steps"]),
            "versions_per_step_mean": (sum(x[2] for x in a["steps"]) / len(a["steps"])) if a["steps"] else None,
            "step_ms_by_versions": {
                str(nv): {"n": len(ds), "p50_ms": 1000 * percentile(ds, 0.5)}
                for nv in sorted({x[2] for x in a["steps"] if x[3] == 8})
                for ds in [[x[1] - x[0] for x in a["steps"] if x[2] == nv and x[3] == 8]]},
        }
        if a["interval_s"] is not None:
            p = out["phases"][label]
            p["added_pause_p50_ms_vs_no_swap"] = (p["gap_during_swap_p50_ms"] - 1000 * percentile(base_gaps, 0.5)
                                                  if a["gaps_swap"] else None)
            p["added_pause_p99_ms_vs_no_swap"] = (p["gap_during_swap_p99_ms"] - 1000 * percentile(base_gaps, 0.99)
                                                  if a["gaps_swap"] else None)
            p["added_pause_p99_ms_vs_outside"] = (p["gap_during_swap_p99_ms"] - p["gap_outside_swap_p99_ms"]
                                                  if a["gaps_swap"] and a["gaps_clear"] else None)
    return out


def print_swap(res: dict) -> None:
    print(f"\n== 2. Swap under load: {res['model']}, {res['clients']} streaming clients x {res['max_tokens']} "
          f"tokens (greedy), {res['phase_s']:g} s per phase x {res['repeats']} interleaved repeats")
    rows = []
    for label, p in res["phases"].items():
        rows.append([label, p["requests"], fmt(p["tokens_per_s"], "", 0), p["publishes"],
                     f"{fmt(p['gap_p50_ms'])}/{fmt(p['gap_p99_ms'])}",
                     f"{fmt(p['gap_during_swap_p50_ms'])}/{fmt(p['gap_during_swap_p99_ms'])} (n={p['gap_during_swap_n']})",
                     f"{fmt(p['gap_outside_swap_p50_ms'])}/{fmt(p['gap_outside_swap_p99_ms'])}",
                     fmt(p.get("added_pause_p99_ms_vs_no_swap")), fmt(p.get("added_pause_p99_ms_vs_outside")),
                     f"{fmt(p['publish_p50_ms'])}/{fmt(p['publish_p99_ms'])}", fmt(p["copy_p50_ms"]),
                     f"{fmt(p['flip_p50_us'], '', 1)}/{fmt(p['flip_p99_us'], '', 1)}",
                     f"{p['failed']}/{p['wrong_version']}/{p['mismatch_not_any_version']}"])
    print(table(["phase", "reqs", "tok/s", "swaps", "gap p50/p99 ms", "gap in swap p50/p99",
                 "gap outside p50/p99", "+p99 vs no-swap", "+p99 vs outside", "publish p50/p99 ms",
                 "copy p50 ms", "flip p50/p99 us", "failed/mixed/mismatch"], rows))
    rows = []
    for label, p in res["phases"].items():
        by = p["step_ms_by_versions"]
        rows.append([label, p["steps"], fmt(p["versions_per_step_mean"]),
                     ", ".join(f"{k}v {fmt(d['p50_ms'])} ms (n={d['n']})" for k, d in by.items()),
                     f"{p['mismatch_not_any_version']}: {p['mismatch_greedy_consistent']}/{p['mismatch_checked']}",
                     fmt(p["mismatch_max_margin"], "", 5), p["mismatch_first_token_repeated"]])
    print(table(["phase", "steps", "versions/step", "8-row decode step p50 by versions in batch",
                 "mismatch: greedy-consistent/checked", "max margin", "first token repeated"], rows))
    mv = res["mixed_version_decode_b8"]
    print("mixed-version batch (runner alone, batch-8 decode): " + ", ".join(
        f"{k} {v['median_ms']:.2f} ms ({v['vs_1']:.2f}x)" for k, v in mv.items()))
    c = res["margin_control_same_vs_other_version"]
    print(f"copy alone on an idle engine: {res['copy_idle_ms_p50']:.2f} ms p50; versions alive at end: "
          f"{res['alive_versions_at_end']}; reference versions distinct: {res['distinct_reference_versions']}/4; "
          f"margin control (reference under its own / another version): "
          + ", ".join(f"{a:.1e}/{b:.2f}" for a, b in c) + f" (tolerance {res['margin_tolerance']:g})")
    for label, p in res["phases"].items():
        if p["interval_ms"] is None:
            continue
        x = p.get("added_pause_p99_ms_vs_no_swap")
        unexplained = p["mismatch_not_any_version"] - p["mismatch_greedy_consistent"]
        ok = x is not None and x <= 1.0 and p["failed"] == 0 and p["wrong_version"] == 0 and unexplained == 0
        print(f"target ({label}): p99 pause added <= 1 ms and 0 failed/mixed: +{fmt(x)} ms, "
              f"{p['failed']} failed, {p['wrong_version']} mixed, {unexplained} unexplained mismatches -> "
              f"{'MET' if ok else 'NOT MET'}" + noisy_tag(f"swap/{res['which']} "))


# =============================================================================== 3. co-scheduling
def bench_cosched(args, dev: torch.device) -> dict:
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.engine import Engine, EngineError, FinishEvent
    from collm.edge_client.model.sampling import SamplingParams
    from collm.edge_client.training.trainer import TrainBudget

    quick = args.quick
    cfg = _engine_cfg("smollm2", args.device, args.dtype)
    max_tokens = args.max_tokens
    load_s = args.load_seconds or (10.0 if quick else 45.0)
    train_alone_s = 8.0 if quick else 20.0
    fracs = [0.9] if quick else [0.5, 0.9]
    say(f"[cosched] loading SmolLM2 ({args.dtype}) and starting an engine with training data "
        f"(SLO ttft {cfg.slo.ttft_ms:g} ms, tpot {cfg.slo.tpot_ms:g} ms, safety {cfg.slo.safety})")
    lm = load_model(cfg.model)
    eng = Engine(lm, cfg, load_edge_data(cfg.data)).start()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = dolly_prompts(eng.tokenizer, 400, 256, seed=1)
    plens = [len(p) for p in prompts]
    say(f"[cosched] {len(prompts)} Dolly prompts, {statistics.mean(plens):.0f} tokens mean "
        f"(max {max(plens)}), max_tokens {max_tokens}")
    out = {"model": lm.name, "dtype": args.dtype, "slo": {"ttft_ms": cfg.slo.ttft_ms, "tpot_ms": cfg.slo.tpot_ms,
                                                          "safety": cfg.slo.safety},
           "max_tokens": max_tokens, "max_running": cfg.engine.max_running,
           "prompt_tokens_mean": statistics.mean(plens), "runs": []}
    try:
        # ---- capacity: closed-loop sweep over concurrency; capacity = the highest request rate whose
        # SLO attainment is >= 0.9 (each level counted after its first wave of requests)
        levels = [4] if quick else [1, 2, 4, cfg.engine.max_running]
        lock = threading.Lock()
        counter = iter(range(10**9))
        sweep = []
        for c in levels:
            n_warm, n_count = c, max(4, 2 * c)
            label = f"cosched capacity c={c}"
            wait_quiet(label, args.wait_quiet)
            say(f"[{label}] closed loop, {c} clients, until {n_warm} + {n_count} requests finished "
                f"(the first {n_warm} are not counted)")
            fin: list[tuple[float, object]] = []
            stop = threading.Event()

            def client(fin=fin, stop=stop, need=n_warm + n_count):
                while not stop.is_set():
                    with lock:
                        i = next(counter)
                    try:
                        ev = eng.generate(prompts[i % len(prompts)], params, timeout=600)
                    except EngineError:
                        time.sleep(0.05)
                        continue
                    with lock:
                        fin.append((time.perf_counter(), ev.record))
                        if len(fin) >= need:
                            stop.set()

            meter = CpuMeter().start()
            ths = [threading.Thread(target=client, daemon=True) for _ in range(c)]
            for t in ths:
                t.start()
            for t in ths:
                t.join(1800)
            note_during(label, meter.stop())
            fin.sort(key=lambda x: x[0])
            counted = [r for _, r in fin[n_warm: n_warm + n_count]]
            rate = n_count / (fin[n_warm + n_count - 1][0] - fin[n_warm - 1][0])
            lvl = {"concurrency": c, "rate_rps": rate, "requests": len(counted),
                   "slo_attainment": sum(r.slo_met for r in counted) / len(counted),
                   "ttft_p50_s": percentile([r.ttft_s for r in counted], 0.5),
                   "tpot_p50_s": percentile([r.tpot_s for r in counted if r.tpot_s], 0.5),
                   "tpot_p99_s": percentile([r.tpot_s for r in counted if r.tpot_s], 0.99)}
            sweep.append(lvl)
            say(f"[{label}] {rate:.3f} req/s, SLO attainment {lvl['slo_attainment']:.2f}, ttft p50 "
                f"{lvl['ttft_p50_s']:.2f} s, tpot p50 {fmt(lvl['tpot_p50_s'], '', 3)} s")
        ok = [lv for lv in sweep if lv["slo_attainment"] >= 0.9]
        best = max(ok, key=lambda lv: lv["rate_rps"]) if ok else min(sweep, key=lambda lv: lv["concurrency"])
        capacity = best["rate_rps"]
        out["capacity_sweep"] = sweep
        out["capacity_rps"] = capacity
        out["capacity_concurrency"] = best["concurrency"]
        out["capacity_slo_attainment"] = best["slo_attainment"]
        out["capacity_note"] = ("highest closed-loop rate with SLO attainment >= 0.9" if ok else
                                "NO concurrency level met the SLO for 90% of requests: used the lowest level")
        say(f"[cosched] capacity {capacity:.3f} req/s (concurrency {best['concurrency']}; {out['capacity_note']})")

        # the co-scheduler's view of an idle replica (engine internals, read while it is idle)
        out["idle_allowance_s"] = eng._slack(time.perf_counter())
        out["costs_after_sweep"] = eng.costs.snapshot()
        out["predicted_train_microbatch_s"] = {
            f"k{o.k}x{o.tokens}tok": eng.costs.microbatch_time("train", o.tokens)
            for o in eng.trainer.job(TrainBudget(steps=1)).options()}
        say(f"[cosched] idle replica: co-scheduler allowance {out['idle_allowance_s']:.2f} s; predicted train "
            f"micro-batch " + ", ".join(f"{k} {v:.2f} s" for k, v in out["predicted_train_microbatch_s"].items()))

        # ---- training alone (no requests)
        say(f"[cosched] training alone for {train_alone_s:g} s")
        wait_quiet("cosched train alone", args.wait_quiet)
        meter = CpuMeter().start()
        tot0 = dict(eng.telemetry.totals)
        rep = eng.train(TrainBudget(steps=10**6, deadline_s=train_alone_s)).result(timeout=train_alone_s + 300)
        tot1 = dict(eng.telemetry.totals)
        note_during("cosched train alone", meter.stop())
        out["train_alone"] = {"tokens": rep.tokens, "seconds": rep.seconds, "tokens_per_s": rep.tokens / rep.seconds,
                              "microbatches": rep.microbatches, "steps": rep.steps, "deferrals": rep.deferrals,
                              "preemptions": tot1["preemptions"] - tot0["preemptions"]}
        say(f"[cosched] training alone: {out['train_alone']['tokens_per_s']:.0f} tokens/s "
            f"({rep.microbatches} micro-batches)")

        # ---- open-loop Poisson load, serving alone vs with training co-scheduled
        def open_loop(rate: float, mode: str, seed: int) -> dict:
            with_training = mode != "alone"
            rng = random.Random(seed)
            arrivals, t = [], 0.0
            while True:
                t += rng.expovariate(rate)
                if t >= load_s:
                    break
                arrivals.append(t)
            n = len(arrivals)
            finished: dict[int, object] = {}
            rejected = 0
            all_done = threading.Event()
            flock = threading.Lock()
            job = None
            slo_cfg = eng.cfg
            if mode == "naive":  # the engine's own baseline switch (training.co_schedule), read every step
                eng.cfg = slo_cfg.model_copy(update={"training": slo_cfg.training.model_copy(
                    update={"co_schedule": "naive"})})
            if with_training:
                mb0 = eng.telemetry.totals["train_microbatches"]
                job = eng.train(TrainBudget(steps=10**6, deadline_s=load_s + 600))
                t_wait = time.perf_counter()  # let the job start and finish one micro-batch first
                while eng.telemetry.totals["train_microbatches"] == mb0 and time.perf_counter() - t_wait < 60:
                    time.sleep(0.05)
            tot_a = dict(eng.telemetry.totals)

            def make_cb(i):
                def cb(ev):
                    if isinstance(ev, FinishEvent):
                        with flock:
                            finished[i] = ev.record
                            if len(finished) + rejected_box[0] >= n:
                                all_done.set()
                return cb

            rejected_box = [0]
            start = time.perf_counter()
            for i, a in enumerate(arrivals):
                dt = start + a - time.perf_counter()
                if dt > 0:
                    time.sleep(dt)
                try:
                    eng.submit(prompts[i % len(prompts)], params, make_cb(i))
                except EngineError:
                    with flock:
                        rejected_box[0] += 1
            t_arrivals_end = time.perf_counter()
            tot_b = dict(eng.telemetry.totals)
            if n == 0 or len(finished) + rejected_box[0] >= n:
                all_done.set()
            all_done.wait(300)
            t_drained = time.perf_counter()
            tot_c = dict(eng.telemetry.totals)
            if job is not None:
                # end the job: its deadline is far; stop it by giving it a deadline now
                j = eng._job
                if j is not None and hasattr(j, "deadline_s"):
                    j.deadline_s = 0.0  # benchmark-only: there is no public cancel for a background job
                rep = job.result(timeout=600)
            eng.cfg = slo_cfg
            rejected = rejected_box[0]
            recs = [finished[i] for i in sorted(finished)]
            met = sum(r.slo_met for r in recs)
            win = t_arrivals_end - start
            res = {
                "rate_rps": rate, "mode": mode, "with_training": with_training, "arrivals": n, "rejected": rejected,
                "completed": sum(r.completed for r in recs), "slo_met": met,
                "slo_attainment": met / n if n else None, "slo_attainment_ci95": wilson(met, n),
                "ttft_p50_s": percentile([r.ttft_s for r in recs if r.ttft_s is not None], 0.5),
                "ttft_p99_s": percentile([r.ttft_s for r in recs if r.ttft_s is not None], 0.99),
                "tpot_p50_s": percentile([r.tpot_s for r in recs if r.tpot_s], 0.5),
                "tpot_p99_s": percentile([r.tpot_s for r in recs if r.tpot_s], 0.99),
                "ttft_miss": sum(1 for r in recs if r.ttft_s is None or r.ttft_s > r.ttft_slo_s),
                "tpot_miss": sum(1 for r in recs if (r.tpot_s or 0) > r.tpot_slo_s),
                "window_s": win, "drain_s": t_drained - t_arrivals_end,
                "train_tokens_in_window": tot_b["train_tokens"] - tot_a["train_tokens"],
                "train_tokens_per_s": (tot_b["train_tokens"] - tot_a["train_tokens"]) / win,
                "train_tokens_incl_drain_per_s": (tot_c["train_tokens"] - tot_a["train_tokens"])
                / (t_drained - start),
                "preemptions": tot_c["preemptions"] - tot_a["preemptions"],
                "preempted_s": tot_c["preempted_s"] - tot_a["preempted_s"],
                "deferrals": tot_c["deferrals"] - tot_a["deferrals"],
            }
            if with_training:
                res["job_microbatches"] = rep.microbatches
            return res

        for fi, frac in enumerate(fracs):
            rate = frac * capacity
            pair = {}
            for mode in ["alone", "slo"] + (["naive"] if args.cosched_naive else []):
                label = MODE_LABEL[mode]
                say(f"[cosched] {frac:.0%} load = {rate:.2f} req/s Poisson for {load_s:g} s, {label}")
                wait_quiet(f"cosched {frac:.0%} {label}", args.wait_quiet)
                meter = CpuMeter().start()
                r = open_loop(rate, mode, seed=1000 + fi)
                r["others_cpu_share"] = meter.stop()
                note_during(f"cosched {frac:.0%} {label}", r["others_cpu_share"])
                r["load_frac"] = frac
                pair[mode] = r
                out["runs"].append(r)
                say(f"[cosched]   SLO attainment {fmt(r['slo_attainment'])} ({r['slo_met']}/{r['arrivals']}), "
                    f"ttft p99 {fmt(r['ttft_p99_s'])} s, tpot p99 {fmt(r['tpot_p99_s'], '', 3)} s, "
                    f"train {r['train_tokens_per_s']:.0f} tok/s")
            a, b = pair["alone"], pair["slo"]
            if "naive" in pair:
                out.setdefault("naive_summary", []).append({
                    "load_frac": frac, "slo_attainment_naive": pair["naive"]["slo_attainment"],
                    "attainment_ratio": ratio(pair["naive"]["slo_attainment"], a["slo_attainment"]),
                    "train_tokens_per_s_under_load": pair["naive"]["train_tokens_per_s"]})
            out.setdefault("summary", []).append({
                "load_frac": frac, "rate_rps": rate,
                "slo_attainment_alone": a["slo_attainment"], "slo_attainment_cotrain": b["slo_attainment"],
                "attainment_ratio": ratio(b["slo_attainment"], a["slo_attainment"]),
                "train_tokens_per_s_under_load": b["train_tokens_per_s"],
                "train_under_load_vs_alone": ratio(b["train_tokens_per_s"], out["train_alone"]["tokens_per_s"]),
            })
        out["engine_costs"] = eng.costs.snapshot()
    finally:
        eng.stop()
    return out


MODE_LABEL = {"alone": "serve alone", "slo": "serve+train", "naive": "serve+naive train"}


def print_cosched(res: dict) -> None:
    s = res["slo"]
    print(f"\n== 3. Co-scheduling: {res['model']} ({res['dtype']}), SLO ttft {s['ttft_ms']:g} ms / tpot "
          f"{s['tpot_ms']:g} ms (configs/edge-smollm2.yaml, safety {s['safety']}), max_tokens {res['max_tokens']}, "
          f"prompts {res['prompt_tokens_mean']:.0f} tok mean")
    print(table(["closed loop: clients", "req/s", "SLO att.", "ttft p50 s", "tpot p50/p99 s"],
                [[lv["concurrency"], f"{lv['rate_rps']:.3f}", f"{lv['slo_attainment']:.2f}", fmt(lv["ttft_p50_s"]),
                  f"{fmt(lv['tpot_p50_s'], '', 3)}/{fmt(lv['tpot_p99_s'], '', 3)}"] for lv in res["capacity_sweep"]]))
    print(f"capacity: {res['capacity_rps']:.3f} req/s at {res['capacity_concurrency']} clients ({res['capacity_note']}); "
          f"training alone {res['train_alone']['tokens_per_s']:.0f} tok/s ({res['train_alone']['microbatches']} "
          f"micro-batches, {res['train_alone']['deferrals']} deferrals); idle co-scheduler allowance "
          f"{res['idle_allowance_s']:.2f} s vs predicted micro-batch "
          + ", ".join(f"{k} {v:.2f} s" for k, v in res["predicted_train_microbatch_s"].items()))
    rows = []
    for r in res["runs"]:
        ci = r.get("slo_attainment_ci95")
        rows.append([f"{r['load_frac']:.0%}", MODE_LABEL[r["mode"]],
                     f"{r['rate_rps']:.2f}", r["arrivals"],
                     f"{fmt(r['slo_attainment'])}" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""),
                     f"{r['ttft_miss']}/{r['tpot_miss']}/{r['rejected']}",
                     f"{fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])}",
                     f"{fmt(r['tpot_p50_s'], '', 3)}/{fmt(r['tpot_p99_s'], '', 3)}",
                     fmt(r["train_tokens_per_s"], "", 0), r["preemptions"], fmt(r["preempted_s"], "", 1),
                     r["deferrals"]])
    print(table(["load", "mode", "req/s", "n", "SLO att. [95% CI]", "miss ttft/tpot/rej", "ttft p50/p99 s",
                 "tpot p50/p99 s", "train tok/s", "preempt", "preempt s", "deferrals"], rows))
    for sm in res.get("summary", []):
        x = sm["attainment_ratio"]
        ok = x is not None and x >= 0.95
        print(f"target ({sm['load_frac']:.0%} load): attainment with training / alone = "
              f"{fmt(sm['slo_attainment_cotrain'])}/{fmt(sm['slo_attainment_alone'])} = {fmt(x, 'x', 3)} (>= 0.95x) -> "
              f"{'MET' if ok else 'NOT MET'}; training under load {fmt(sm['train_tokens_per_s_under_load'], '', 0)} "
              f"tok/s = {fmt(sm['train_under_load_vs_alone'], 'x', 2)} of training alone"
              + noisy_tag(f"cosched {sm['load_frac']:.0%}") + noisy_tag("cosched train alone"))
    for sm in res.get("naive_summary", []):
        print(f"baseline ({sm['load_frac']:.0%} load): naive co-scheduling (training.co_schedule=naive) attainment / "
              f"alone = {fmt(sm['attainment_ratio'], 'x', 3)}, training {fmt(sm['train_tokens_per_s_under_load'], '', 0)}"
              f" tok/s")


# =============================================================================== 4. memory
def materialize(model: torch.nn.Module) -> None:
    """Give every parameter and buffer its own anonymous memory (clone), one tensor at a time.

    load_model leaves fp32 safetensors weights memory-mapped (file pages, shared between processes
    through the page cache). A base that was converted (GGUF dequant, dtype cast, quantization) or
    copied is owned by the process instead; that is what this models.
    """
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one Parameter: cloned once, tie kept
            p.data = p.data.clone()
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = b.clone()
    gc.collect()


def mem_child(role: str, args) -> None:
    """One child process of section 4; prints one line `MEMRESULT {json}`."""
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.engine import Engine
    from collm.edge_client.model.sampling import SamplingParams
    from collm.edge_client.training.trainer import TrainBudget

    quick = args.quick
    st0 = proc_status()
    t0 = time.perf_counter()
    extra = {"engine": {"max_running": 1, "kv_cache_mb": 2}} if role == "train-only" else None
    cfg = _engine_cfg("smollm2", args.device, "float32", extra)
    lm = load_model(cfg.model)
    st_loaded = proc_status()
    materialize(lm.model)
    st_mat = proc_status()
    # reset the peak to the current RSS: what follows measures the serving/training phase, base included
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    st_reset = proc_status()
    data = load_edge_data(cfg.data) if role != "serve-only" else None
    eng = Engine(lm, cfg, data)
    n_req = 8 if quick else 24
    # quick: one micro-batch; full: one optimizer step (micro_batch_size x grad_accum_steps sequences)
    budget = TrainBudget(tokens=1, deadline_s=120) if quick else TrainBudget(steps=1, deadline_s=300)
    rep = None
    direct_mb = 0

    def run_direct(tj) -> int:
        n = 0
        while not tj.done():
            tj.run(tj.options()[0])
            n += 1
        return n

    if role == "train-only":
        # a training-only process: the same TrainJob code, run back to back (no serving, no co-scheduler;
        # the engine is only built for its LoRA layers and trainer, with a 2 MiB KV pool, never started)
        tj = eng.trainer.job(budget, None, 0.0, None)
        tj.start()
        direct_mb = run_direct(tj)
        rep = tj.finish()
        job = None
    else:
        eng.start()
        job = eng.train(budget) if role == "one-process" else None
    served = 0
    train_mb_while_serving = None
    if role != "train-only":
        params = SamplingParams(max_tokens=8 if quick else 24, temperature=0.0, ignore_eos=True)
        prompts = dolly_prompts(eng.tokenizer, n_req, 256, seed=2)
        evs = []
        ths = [threading.Thread(target=lambda p=p: evs.append(eng.generate(p, params, timeout=900)), daemon=True)
               for p in prompts]
        for t in ths:
            t.start()
        for t in ths:
            t.join(900)
        served = sum(e.record.completed for e in evs)
        train_mb_while_serving = eng.telemetry.totals["train_microbatches"]
    t_served = time.perf_counter()
    if job is not None:
        rep = job.result(timeout=900)
        if (rep.microbatches < 1) if quick else (rep.steps < 1):
            # the co-scheduler never found slack for it (see the report): run the same training work on
            # the idle engine's trainer in this process, so the peak still has serving and training state
            eng.stop()
            tj = eng.trainer.job(TrainBudget(tokens=1) if quick else TrainBudget(steps=1), None, 0.0, None)
            tj.start()
            direct_mb = run_direct(tj)
            tj.finish()
    t_trained = time.perf_counter()
    if role != "train-only" and not eng._stop:
        eng.stop()
    st_end = proc_status()
    res = {
        "role": role, "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"), "seconds": time.perf_counter() - t0,
        "start": st0, "after_load": st_loaded, "after_materialize": st_mat, "after_reset": st_reset, "end": st_end,
        "peak_rss_mb": st_end["VmHWM"],  # since the reset (after the base was materialized)
        "peak_rss_incl_load_mb": max(st_mat["VmHWM"], st_end["VmHWM"]),
        "kv_pool_mb": eng.pool.nbytes / 2**20, "served": served, "train_tokens": rep.tokens if rep else 0,
        "train_microbatches": rep.microbatches if rep and role == "one-process" else 0,  # via the co-scheduler
        "train_mb_while_serving": train_mb_while_serving,
        "train_deferrals": rep.deferrals if rep else 0, "train_preempted": (rep.extra.get("preempted", 0) if rep else 0),
        "train_wait_after_serving_s": t_trained - t_served, "train_direct_microbatches": direct_mb,
        "train_deadline_hit": bool(rep.deadline_hit) if rep else None,
        "costs": eng.costs.snapshot(),
    }
    if lm.device.type == "cuda":
        res["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("MEMRESULT " + json.dumps(res), flush=True)


def bench_memory(args) -> dict:
    envs = [("default", None)] if args.quick else [("default", None), ("MALLOC_ARENA_MAX=2", "2")]
    roles = ["one-process", "serve-only", "train-only"]
    out = {"runs": [], "summary": []}
    for env_label, arena in envs:
        for role in roles:
            env = dict(os.environ)
            env.pop("MALLOC_ARENA_MAX", None)
            if arena:
                env["MALLOC_ARENA_MAX"] = arena
            cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-role", role, "--device", args.device]
            if args.quick:
                cmd.append("--quick")
            wait_quiet(f"memory {role} {env_label}", min(args.wait_quiet, 10))
            say(f"[memory] child: {role} ({env_label}): {' '.join(cmd[1:])}")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT), timeout=3600)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("MEMRESULT ")]
            if p.returncode != 0 or not line:
                tail = (p.stderr or p.stdout)[-2000:]
                raise RuntimeError(f"memory child {role} failed (rc {p.returncode}):\n{tail}")
            r = json.loads(line[-1][len("MEMRESULT "):])
            r["env"] = env_label
            out["runs"].append(r)
            say(f"[memory]   peak RSS {r['peak_rss_mb']} MiB after load ({r['peak_rss_incl_load_mb']} MiB incl. "
                f"load transient), base materialized: RssAnon {r['after_materialize']['RssAnon']} MiB, "
                f"RssFile {r['after_materialize']['RssFile']} MiB, {r['seconds']:.0f} s")
        by = {r["role"]: r for r in out["runs"] if r["env"] == env_label}
        one = by["one-process"]["peak_rss_mb"]
        two = by["serve-only"]["peak_rss_mb"] + by["train-only"]["peak_rss_mb"]
        one_l = by["one-process"]["peak_rss_incl_load_mb"]
        two_l = by["serve-only"]["peak_rss_incl_load_mb"] + by["train-only"]["peak_rss_incl_load_mb"]
        out["summary"].append({"env": env_label, "one_process_mb": one, "two_processes_mb": two,
                               "ratio": one / two, "one_incl_load_mb": one_l, "two_incl_load_mb": two_l,
                               "ratio_incl_load": one_l / two_l})
    return out


def print_memory(res: dict) -> None:
    print("\n== 4. Memory: SmolLM2 float32, base materialized (owned, not mmapped) in every process; peak RSS "
          "(VmHWM) of child processes")
    rows = []
    for r in res["runs"]:
        rows.append([r["env"], r["role"], r["after_materialize"]["VmRSS"], r["after_materialize"]["RssFile"],
                     r["peak_rss_mb"], r["peak_rss_incl_load_mb"], f"{r['kv_pool_mb']:.0f}", r["served"],
                     f"{r['train_microbatches']}+{r['train_direct_microbatches']}", f"{r['seconds']:.0f}"])
    print(table(["malloc", "role", "RSS after load MiB", "of it file-backed", "peak RSS MiB",
                 "peak incl. load MiB", "KV pool MiB", "served",
                 "train mb (sched+direct)", "s"], rows))
    for s in res["summary"]:
        ok = s["ratio"] <= 0.6
        print(f"target ({s['env']}): one process / two processes = {s['one_process_mb']} / {s['two_processes_mb']} "
              f"MiB = {s['ratio']:.3f}x (<= 0.6x) -> {'MET' if ok else 'NOT MET'}; including the load transient "
              f"{s['one_incl_load_mb']} / {s['two_incl_load_mb']} = {s['ratio_incl_load']:.3f}x")
    if len(res["summary"]) == 2:
        d, a = res["summary"]
        print(f"MALLOC_ARENA_MAX=2 vs default: one process {a['one_process_mb']} vs {d['one_process_mb']} MiB "
              f"({a['one_process_mb'] / d['one_process_mb']:.3f}x), two processes {a['two_processes_mb']} vs "
              f"{d['two_processes_mb']} MiB ({a['two_processes_mb'] / d['two_processes_mb']:.3f}x)")


# =============================================================================== main
def machine_info() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    try:
        import transformers
        import peft

        info["transformers"], info["peft"] = transformers.__version__, peft.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    global QUIET
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer repeats, shorter phases")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sections", default="1,2,3,4", help="comma list of 1 kernels, 2 swap, 3 cosched, 4 memory")
    ap.add_argument("--models", default="tiny,smollm2", help="section 1 models")
    ap.add_argument("--batches", default="1,8", help="section 1 batch sizes (at most 8)")
    ap.add_argument("--swap-smollm2", action="store_true", help="section 2 also on SmolLM2 (slow)")
    ap.add_argument("--rounds", type=int, help="section 1 interleaved rounds (default 1 quick, 4 full)")
    ap.add_argument("--k-decode", type=int, help="section 1 decode steps per round (default 4 quick, 8 full)")
    ap.add_argument("--max-tokens", type=int, default=24, help="section 3 output length")
    ap.add_argument("--cosched-naive", action="store_true",
                    help="section 3 also with training.co_schedule=naive (train every step, no SLO control)")
    ap.add_argument("--load-seconds", type=float, help="section 3 open-loop duration (default 10 quick, 45 full)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (GIL hand-over; Python default 0.005)")
    ap.add_argument("--wait-quiet", type=float, help="before each timed block wait up to this many seconds until "
                    "other processes use < 15%% of the CPUs (default 0 quick, 20 full)")
    ap.add_argument("--out", default="runs/bench_engine.json")
    ap.add_argument("--mem-role", choices=["one-process", "serve-only", "train-only"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    quiet_libraries()
    if args.mem_role:
        QUIET = True
        mem_child(args.mem_role, args)
        return 0
    from collm.edge_client.model.loading import resolve_device

    dev = resolve_device(args.device)
    args.device = dev.type
    args.rounds = args.rounds or (1 if args.quick else 4)
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 20.0
    args.k_decode = args.k_decode or (4 if args.quick else 8)
    args.batches = [int(b) for b in args.batches.split(",")]
    sections = {int(s) for s in args.sections.split(",") if s.strip()}
    info = machine_info()
    say(f"bench_engine: {'quick' if args.quick else 'full'} run, sections {sorted(sections)}, device {dev}, "
        f"dtype {args.dtype}, {info.get('cpu', '?')} ({info['cpu_capability']}), {info['threads']} threads, "
        f"load average {info.get('loadavg_at_start')}")
    results = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "mem_role"}, "sections": {}}
    out_path = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        results["noise"] = NOISE
        results["elapsed_s"] = time.perf_counter() - T0
        results["loadavg_at_end"] = os.getloadavg()
        out_path.write_text(json.dumps(results, indent=1, default=str))

    printers = []
    if 1 in sections:
        results["sections"]["kernels"] = {}
        for m in [x.strip() for x in args.models.split(",") if x.strip()]:
            r = bench_kernels(m, args, dev)
            results["sections"]["kernels"][m] = r
            print_kernels(r, args.batches)
            printers.append((print_kernels, (r, args.batches)))
            save()
    if 2 in sections:
        results["sections"]["swap"] = {}
        for m in ["tiny"] + (["smollm2"] if args.swap_smollm2 else []):
            r = bench_swap(m, args, dev)
            results["sections"]["swap"][m] = r
            print_swap(r)
            printers.append((print_swap, (r,)))
            save()
    if 3 in sections:
        r = bench_cosched(args, dev)
        results["sections"]["cosched"] = r
        print_cosched(r)
        printers.append((print_cosched, (r,)))
        save()
    if 4 in sections:
        r = bench_memory(args)
        results["sections"]["memory"] = r
        print_memory(r)
        printers.append((print_memory, (r,)))
        save()
    if len(printers) > 1:
        print("\n\n######## SUMMARY (all sections) ########")
        for fn, a in printers:
            fn(*a)
    during = [n["others_during"] for n in NOISE if "others_during" in n]
    if during:
        noisy = sum(x >= 0.15 for x in during)
        print(f"\nnoise: other processes used {statistics.median(during):.0%} of the CPUs (median, max "
              f"{max(during):.0%}) during the {len(during)} timed blocks; {noisy} blocks were noisy (>= 15%)")
    save()
    say(f"done; results in {out_path} (load average now {os.getloadavg()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
