"""Are a replica's decode steps slower once it serves a federated version, and why? One engine, phases.

    python benchmarks/version_steps.py CHECKPOINT      # a collm checkpoint's adapter_model.safetensors

In the steady unseen run, collm's decode steps of 2-4 rows were 1.04-1.11x slower after the edge's first
federated version than before it, at the same load point and beside a training neighbour both times
(`benchmarks/step_context.py --around 40`); the isolated serving replica there showed none (0.96-1.05x), in
the burst run it did too (1.03-1.11x). `benchmarks/adapter_values.py` found the adapter's
values cost nothing on a bare ModelRunner. This runs the real Engine (SmolLM2, fp32, one thread on one core)
under a closed loop of exactly N requests (N = 2, 3 and 8 in turn; the engine's timeline gives each decode
step's time) and between measured phases does what a collm edge does in its rounds, one action at a time
(`--plan`): publish a version from another thread as the federation does, the checkpoint ("trained") or
the initial state again ("zero", B = 0), so a cost that follows the values comes and goes with them and a
cost of having published at all stays; or run a training job from the served state, carried after it as
in a round. Medians per phase and row count, and their ratio to the first phase.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import dolly_prompts, engine_cfg, say  # noqa: E402

ROWS = (2, 3, 8)


def closed_loop(eng, prompts, n: int, seconds: float) -> None:
    """Keep exactly `n` requests in the engine for `seconds` (each 24 tokens, EOS ignored)."""
    from collm.edge_client.engine import FinishEvent
    from collm.edge_client.model.sampling import SamplingParams

    end = time.monotonic() + seconds
    done = threading.Semaphore(0)
    k = [0]

    def launch() -> None:
        k[0] += 1
        eng.submit(prompts[k[0] % len(prompts)], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                   lambda ev: done.release() if isinstance(ev, FinishEvent) else None)

    for _ in range(n):
        launch()
    live = n
    while live:
        done.acquire()
        live -= 1
        if time.monotonic() < end:
            launch()
            live += 1


PLAN = "serve,publish:trained,serve,publish:zero,serve,publish:trained,serve,train,serve,publish:zero,serve"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="a trained adapter: a collm checkpoint's adapter_model.safetensors")
    ap.add_argument("--plan", default=PLAN, help="comma-separated actions: serve (a measured phase), publish:trained, "
                    "publish:zero (from another thread, as the edge's federation does), train (a job of --train-tokens "
                    "from the served state, carried after it as in a round, waited for with nothing served), train:once "
                    f"(the same job, not carried), trim (glibc's malloc_trim: the allocator gives back its free pages), gc (Python's "
                    f"full collection); default {PLAN}")
    ap.add_argument("--seconds", type=float, default=6.0, help="per row count and measured phase (default 6)")
    ap.add_argument("--train-tokens", type=int, default=3000, help="tokens of each train action (default 3000)")
    ap.add_argument("--core", type=int, default=0, help="the core the engine is pinned to (default 0)")
    a = ap.parse_args(argv)
    plan = [x.strip() for x in a.plan.split(",") if x.strip()]
    bad = [x for x in plan if x not in ("serve", "train", "train:once", "publish:trained", "publish:zero", "trim", "gc")]
    if bad:
        print(f"version_steps: --plan: unknown action(s) {bad}; use serve, train, train:once, publish:trained, publish:zero, trim, gc",
              file=sys.stderr)
        return 2
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        trained = {k: v.float() for k, v in load_file(str(a.checkpoint)).items()}
    except (OSError, ValueError, SafetensorError) as e:
        print(f"version_steps: checkpoint: cannot read {a.checkpoint} ({e})", file=sys.stderr)
        return 2
    from collm.edge_client.engine import Engine
    from collm.edge_client.engine.timeline import read_timeline
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget

    tmp = tempfile.TemporaryDirectory(prefix="version-steps-")  # removed on every way out, an error's included
    tl = Path(tmp.name) / "timeline.jsonl"
    cfg = engine_cfg("smollm2", "cpu", "float32", {"model": {"cpu_affinity": [a.core], "threads": 1},
                                                   "engine": {"timeline": str(tl)}})
    lm = load_model(cfg.model)
    eng = Engine(lm, cfg, load_edge_data(cfg.data)).start()
    missing = set(eng.initial_state) - set(trained)
    if missing:
        print(f"version_steps: checkpoint: {len(missing)} LoRA tensors of the preset's adapter missing", file=sys.stderr)
        eng.stop(5)
        return 2
    prompts = [p for p in dolly_prompts(eng.tokenizer, 200, 96, seed=1) if len(p) >= 40]
    say(f"[version-steps] {len(prompts)} prompts of 40-96 tokens; plan {','.join(plan)}; {ROWS} rows x {a.seconds:g} s")
    states = {"trained": trained, "zero": eng.initial_state}
    phases: list[tuple[str, dict]] = []  # (label, rows -> (start, end) wall time)
    history: list[str] = []
    version, served = 0, "zero"
    try:
        for act in plan:
            if act.startswith("publish:"):
                served = act.split(":")[1]
                version += 1
                pub = threading.Thread(target=eng.shadow.publish, args=(states[served], version),
                                       kwargs={"source": served})
                pub.start()  # the edge publishes from its federation thread, not the engine's
                pub.join()
                history.append(f"v{version}={served}")
            elif act == "trim":
                import ctypes
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                history.append(act)
            elif act == "gc":
                import gc
                gc.collect()
                history.append(act)
            elif act.startswith("train"):
                t0 = time.time()
                rep = eng.train(TrainBudget(tokens=a.train_tokens), global_state=states[served],
                                carry=act == "train").result()
                history.append(act)
                say(f"[version-steps] trained {rep.tokens} tokens in {time.time() - t0:.1f} s")
            else:
                spans = {}
                for n in ROWS:
                    t0 = time.time()
                    closed_loop(eng, prompts, n, a.seconds)
                    spans[n] = (t0, time.time())
                phases.append((" ".join(history[-2:]) or "v0=zero (initial)", spans))
                threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else "?"
                say(f"[version-steps] measured after: {phases[-1][0]} ({threads} threads in this process)")
    finally:
        eng.stop(10)
    steps = [e for e in read_timeline(tl) if e.get("ev") == "step" and not e.get("pf") and e.get("dec")]
    tmp.cleanup()
    base: dict[int, float] = {}
    print("served after                " + "  ".join(f"{n} rows ms (x first, n)".rjust(26) for n in ROWS))
    for label, spans in phases:
        cells = []
        for n in ROWS:
            lo, hi = spans[n]
            v = [1000 * e["s"] for e in steps if e["dec"] == n and lo <= e["t"] <= hi]
            if len(v) < 5:
                cells.append("-".rjust(26))
                continue
            m = statistics.median(v)
            base.setdefault(n, m)
            cells.append(f"{m:7.1f} ({m / base[n]:.3f}, {len(v):3d})".rjust(26))
        print(f"{label:27s} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
