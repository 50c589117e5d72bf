"""Section 3 of bench_engine.py: a SmolLM2 replica's capacity, then open-loop load served alone vs with training co-executed."""

from __future__ import annotations

import random
import statistics
import threading
import time

import torch

from collm.common.stats import percentile

from benchkit import engine_cfg, table, say, ratio, wilson, fmt, CpuMeter, wait_quiet, noisy_tag, note_during, dolly_prompts


# =============================================================================== 3. co-scheduling
def bench_cosched(args, dev: torch.device) -> dict:
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.engine import Engine, EngineError, FinishEvent
    from collm.edge_client.model.sampling import SamplingParams
    from collm.edge_client.engine.co_schedule import Naive
    from collm.edge_client.training.jobs import TrainBudget

    quick = args.quick
    mr = args.max_running
    # the preset's KV budget is 32 MB a running sequence (256 MB for 8): keep that share at a larger batch
    cfg = engine_cfg("smollm2", args.device, args.dtype,
                     {"engine": {"max_running": mr, "kv_cache_mb": 32 * mr}} if mr else None)
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
        top = cfg.engine.max_running
        levels = [min(4, top)] if quick else sorted({c for c in (1, 2, 4, 8, 16, 32) if c < top} | {top})
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

        # what the replica predicts for one training micro-batch and its units
        out["costs_after_sweep"] = eng.costs.snapshot()
        ref = cfg.training.micro_batch_size * cfg.training.max_seq_len // 2
        out["predicted_train_microbatch_s"] = eng.costs.microbatch_time("train", ref)
        out["predicted_units_s"] = {k: eng.costs.unit_time("train", k, ref) for k in ("forward", "backward")}
        say(f"[cosched] predicted train micro-batch ({ref} tokens) {out['predicted_train_microbatch_s']:.2f} s, "
            f"units: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in out["predicted_units_s"].items()))

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
                              "units": tot1["background_units"] - tot0["background_units"]}
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
            rule = eng.policy
            if mode == "naive":  # the engine's own baseline policy (training.co_schedule: naive)
                eng.policy = Naive()
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
                j = eng.core.job
                if j is not None and hasattr(j, "deadline_s"):
                    j.deadline_s = 0.0  # benchmark-only: there is no public cancel for a background job
                rep = job.result(timeout=600)
            eng.policy = rule
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
                "units": tot_c["background_units"] - tot_a["background_units"],
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


MODE_LABEL = {"alone": "serve alone", "slo": "serve+train (work-conserving)", "naive": "serve+naive train"}


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
          f"micro-batches in {res['train_alone']['units']} units); predicted micro-batch "
          f"{res['predicted_train_microbatch_s']:.2f} s")
    rows = []
    for r in res["runs"]:
        ci = r.get("slo_attainment_ci95")
        rows.append([f"{r['load_frac']:.0%}", MODE_LABEL[r["mode"]],
                     f"{r['rate_rps']:.2f}", r["arrivals"],
                     f"{fmt(r['slo_attainment'])}" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""),
                     f"{r['ttft_miss']}/{r['tpot_miss']}/{r['rejected']}",
                     f"{fmt(r['ttft_p50_s'])}/{fmt(r['ttft_p99_s'])}",
                     f"{fmt(r['tpot_p50_s'], '', 3)}/{fmt(r['tpot_p99_s'], '', 3)}",
                     fmt(r["train_tokens_per_s"], "", 0), r["units"], r["deferrals"]])
    print(table(["load", "mode", "req/s", "n", "SLO att. [95% CI]", "miss ttft/tpot/rej", "ttft p50/p99 s",
                 "tpot p50/p99 s", "train tok/s", "units", "deferrals"], rows))
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
