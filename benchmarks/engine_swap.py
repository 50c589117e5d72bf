"""Section 2 of bench_engine.py: a real Engine with streaming clients while adapters are published."""

from __future__ import annotations

import bisect
import threading
import time

import torch

from collm.common.stats import percentile

from benchkit import engine_cfg, table, say, med, fmt, sync, CpuMeter, wait_quiet, noisy_tag, note_during, random_adapter_state


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
    cfg = engine_cfg(which, args.device, args.dtype, {"engine": {"max_running": n_clients}})
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
