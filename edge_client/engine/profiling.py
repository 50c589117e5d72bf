"""`collm-edge --config X --profile out.json`: this replica's cost model, measured and written down.

A profile is what `collm-sim` needs to stand for this device: the serving step's cost over the
engine's own features (decoding sequences, prefill tokens, KV tokens attended; fitted with the
engine's own `LinearCostModel`), the loop's overhead per step around the forward, the time of one
training and one evaluation micro-batch and how many resumable units each has, and the engine's
limits (slots, step token budget, context). Every shape is timed `reps` times through the real
code path (the runner's forward and sampling, the real `LayerwisePass`) and the median counts: a
simulator wants the typical step, not the fastest (warm-up takes the fastest, to be robust to a
neighbour warming up at the same time).

The raw samples go into the file too, with the fit's error on them, so a profile can be checked
and refitted later. `speed` (1.0 as measured) divides every time: a profile scaled to 4.0 stands
for a device four times as fast (`collm.sim.profile`).
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time

import torch

from collm.common.data import chat_prompt_ids
from collm.common.step_cost import step_features
from collm.edge_client.engine.cost_model import LinearCostModel
from collm.edge_client.engine.requests import FinishEvent
from collm.edge_client.engine.warmup import fastest
from collm.edge_client.model.runner import Segment
from collm.edge_client.model.sampling import SamplingParams, make_generator, sample_next
from collm.edge_client.training.evaluation import EvalJob
from collm.edge_client.training.layerwise import timed_units

SCHEMA = "collm-profile/1"
TEMPLATE_SAMPLE = "Summarize the history of the printing press in three sentences."


def chat_template_tokens(tokenizer) -> int:
    """Tokens the chat template adds around one user message (SmolLM2's: 30, its default system
    prompt and role markers). A trace counts only the message; the edge prefills these too, so the
    simulator adds them to every request (0 for a model without a chat template)."""
    try:
        with_template = chat_prompt_ids(tokenizer, TEMPLATE_SAMPLE)
    except Exception:  # noqa: BLE001 - no chat template: the edge serves completions only
        return 0
    return max(0, len(with_template) - len(tokenizer.encode(TEMPLATE_SAMPLE, add_special_tokens=False)))


def step_grid(max_running: int, budget: int, max_context: int) -> list[tuple[int, int, int]]:
    """(decoding sequences, prefill tokens, context per decoding sequence) shapes to time: decode
    batches 1..max_running at short and long contexts, prefill chunks up to the budget, and mixes."""
    batches = sorted({b for b in (1, 2, 4, 8, 16, max_running) if b <= max_running})
    ctxs = sorted({min(c, max_context - 2) for c in (32, 128, max_context // 2)})
    prefills = sorted({min(p, budget, max_context - 2) for p in (16, 64, budget // 2, budget)})
    shapes = [(b, 0, c) for b in batches for c in ctxs] + [(0, p, 0) for p in prefills]
    shapes += [(b, min(64, budget - b), 64) for b in batches[:3] if budget - b > 0]
    return shapes


def _time_step(engine, decode: int, prefill: int, ctx: int, reps: int) -> tuple[float, int]:
    """Median seconds of one serving step of that shape (forward + sampling, as `_serve_step`
    times it) and the KV tokens it attends."""
    runner, pool = engine.runner, engine.pool
    w = engine.shadow.pin()
    need = decode + (1 if prefill else 0)
    slots = [pool.allocate() for _ in range(need)]
    try:
        g = torch.Generator().manual_seed(decode * 1000 + prefill)
        segs = [Segment(s, ctx, [5], w, True) for s in slots[:decode]]
        if prefill:
            ids = torch.randint(3, runner.vocab_size, (prefill,), generator=g).tolist()
            segs.append(Segment(slots[decode], 0, ids, w, True))
        params = [SamplingParams(max_tokens=1, temperature=0.7) for _ in segs]
        gens = [make_generator(p, engine.device) for p in params]

        def step():
            logits = runner.forward(segs, pool)
            sample_next(logits, params, gens)

        attended = sum(s.start + len(s.tokens) for s in segs)
        return fastest(step, reps, pick=statistics.median), attended
    finally:
        for s in slots:
            pool.release(s)
        engine.shadow.release(w)


def _loop_overhead(engine, batch: int, step_s, tokens: int = 24) -> dict:
    """Seconds per step the engine loop spends beyond the forward it times (planning, admission,
    streaming): `batch` real requests decoded through the running engine, wall time per step
    against the step cost model's prediction of the same steps."""
    done = []
    prompt = list(range(10, 42))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ev = threading.Event()

    def on_event(e):
        if isinstance(e, FinishEvent):
            done.append(e)
            if len(done) == batch:
                ev.set()

    for _ in range(batch):
        engine.submit(prompt, params, on_event)
    if not ev.wait(300):
        raise TimeoutError("the loop-overhead requests did not finish in 300 s")
    wall = time.perf_counter() - t0
    steps = tokens  # one prefill step (all prompts fit the budget) + tokens - 1 decode steps
    ctx = len(prompt) + tokens // 2
    predicted = step_s(0, batch * len(prompt), batch * len(prompt)) + sum(
        step_s(batch, 0, batch * (len(prompt) + i)) for i in range(1, tokens))
    return {"batch": batch, "steps": steps, "context": ctx, "wall_s": wall, "predicted_s": predicted,
            "per_step_s": max(0.0, (wall - predicted) / steps)}


def _pass_times(make_pass, reps: int) -> dict:
    """A whole micro-batch pass: median seconds, its units and input tokens."""
    totals, n_units, longest, tokens = [], 0, 0.0, 0
    for i in range(reps + 1):
        p = make_pass()
        units = timed_units(p)
        if i == 0:
            continue  # untimed warm pass
        totals.append(sum(s for _, s in units))
        n_units, tokens = len(units), p.tokens
        longest = max(longest, max(s for _, s in units))
    return {"tokens": tokens, "seconds": statistics.median(totals), "units": n_units, "longest_unit_s": longest}


def measure_profile(engine, reps: int = 5, progress=print) -> dict:
    """Measure `engine` (constructed, not started) and return the profile as plain data."""
    cfg = engine.cfg
    e = cfg.engine
    samples = []
    grid = step_grid(engine.pool.slots, e.step_token_budget, engine.max_context)
    for i, (d, p, c) in enumerate(grid, 1):
        seconds, attended = _time_step(engine, d, p, c, reps)
        samples.append([d, p, attended, seconds])
        progress(f"  step {i}/{len(grid)}: {d} decoding (context {c}), {p} prefill tokens: {1000 * seconds:.1f} ms")
    fit = LinearCostModel(3, list(engine.costs.step.prior), window=len(samples) + 1, min_samples=4,
                          max_age_s=float("inf"))
    for d, p, kv, s in samples:
        fit.observe(step_features(d, p, kv), s)
    fit.predict(step_features(0, 0, 0))  # refits on the samples
    coef = [float(c) for c in fit.coef]

    def step_s(d: int, p: int, kv: int) -> float:
        return fit.predict(step_features(d, p, kv))

    errors = [abs(step_s(d, p, kv) - s) / s for d, p, kv, s in samples]
    train = evaluation = None
    t = cfg.training
    if engine.trainer is not None:
        tr = engine.trainer
        train = _pass_times(lambda: tr.new_pass(tr.stream.peek(t.micro_batch_size)), max(2, reps // 2))
        train.update(micro_batch_size=t.micro_batch_size, max_seq_len=t.max_seq_len,
                     examples=len(tr.stream.examples))
        progress(f"  training micro-batch: {train['tokens']} tokens in {train['seconds']:.3f} s, "
                 f"{train['units']} units")
    if engine.holdout:
        w = engine.shadow.current
        def eval_pass():  # the first batch of a real evaluation (its examples grouped by length)
            return EvalJob(engine.parts, w, engine.holdout, t.eval_batch_size, engine.tokenizer.pad_token_id,
                           engine.device).new_pass()

        evaluation = _pass_times(eval_pass, max(2, reps // 2))
        evaluation.update(batch_size=t.eval_batch_size, records=len(engine.holdout))
        progress(f"  evaluation micro-batch: {evaluation['tokens']} tokens in {evaluation['seconds']:.3f} s")
    engine.start()
    try:
        overhead = [_loop_overhead(engine, b, step_s) for b in sorted({1, min(4, engine.pool.slots)})]
    finally:
        engine.stop()
    progress("  loop overhead per step: " + ", ".join(f"batch {o['batch']} {1000 * o['per_step_s']:.2f} ms"
                                                     for o in overhead))
    runner = engine.runner
    return {
        "schema": SCHEMA,
        "speed": 1.0,
        "device": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "accelerator": str(engine.device), "torch": torch.__version__,
                   "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "model": {"source": cfg.model.source, "name": engine.lm.name, "dtype": cfg.model.dtype,
                  "n_layers": runner.n_layers, "lora_r": cfg.lora.r,
                  "chat_template_tokens": chat_template_tokens(engine.tokenizer)},
        "engine": {"max_running": engine.pool.slots, "step_token_budget": e.step_token_budget,
                   "max_context": engine.max_context, "max_queue": e.max_queue},
        "slo": {"ttft_s": cfg.slo.targets.ttft_s, "tpot_s": cfg.slo.targets.tpot_s, "safety": cfg.slo.safety},
        "step": {"features": ["1", "decode_seqs", "prefill_tokens", "attended_kv_tokens/1000"], "coef": coef,
                 "mape": statistics.mean(errors), "overhead_s": statistics.median(o["per_step_s"] for o in overhead),
                 "samples": samples, "overhead_runs": overhead},
        "train_microbatch": train,
        "eval_microbatch": evaluation,
    }
