"""Section 4 of bench_engine.py: peak RSS of one serving+training process vs two processes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch


from benchkit import engine_cfg, table, say, proc_status, wait_quiet, dolly_prompts, ROOT


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
    from collm.edge_client.training.jobs import TrainBudget

    quick = args.quick
    st0 = proc_status()
    t0 = time.perf_counter()
    extra = {"engine": {"max_running": 1, "kv_cache_mb": 2}} if role == "train-only" else None
    cfg = engine_cfg("smollm2", args.device, "float32", extra)
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
        """Run a training job's units back to back in this thread; the micro-batches it completed."""
        n = 0
        while not tj.done():
            n += bool(tj.run_unit())
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
            # the co-execution rule never found idle time for it (see the report): run the same training work on
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
        "train_deferrals": rep.deferrals if rep else 0,
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
            cmd = [sys.executable, str(Path(__file__).with_name("bench_engine.py")), "--mem-role", role, "--device", args.device]
            if args.model_path:
                cmd += ["--model-path", args.model_path]
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
