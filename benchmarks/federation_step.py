"""How far one round moves the served model: two edges averaged against one trainer, and server steps.

The bench's topology without its serving: the bundled SmolLM2-135M-Instruct, the Dolly records split by
category into the bench's two halves (`partition_by_category(load_records(), 2)`), lr 5e-4 (the presets'
until 2026-12-06; their 1e-3 is `@2`), each round's global judged by collm-bench's own
`lab.bench_quality.QualityJudge` (24 held-out records across every category). No carry between rounds, no
deadline: each edge trains exactly its tokens.
Variants (comma-separated `--variants`), each on fresh engines with the same seeds:

* avg                 collm's federation: both edges train `--tokens` from the global; flwr's weighted average
* sum                 the same, the deltas summed (server step = number of edges: sequential training, to first order)
* lr<eta>             the average's delta times eta (FedAvgM's server learning rate, no momentum)
* m<beta>             FedAvgM: server momentum beta, server learning rate 1
* asym:<t0>/<t1>      avg with edge 0 training t0 tokens and edge 1 t1 (an idle edge beside a busy one)
* single<x>           the isolated deployment's trainer: one engine holding both halves trains x * `--tokens`
                      (single2: twice, single1.4: what isolated's trainer fills of a 6000 budget in 30 s)
* <variant>@<s>       any of the above with the edges' (or the trainer's) learning rate times s (avg@2: 1e-3)
* <variant>@<s>x<d>   ... and the rate times d each round after the first, never below `--lr-min`
                      (`server/lr_schedule.py`, the server's balancer.lr_decay). The presets' schedule since
                      2026-12-06 is avg@4x0.8 (single1.4@4x0.8) with --lr-min 5e-4: 2e-3, 1.6e-3, ..., 5e-4

`--group-by-length 0` trains on random micro-batches instead of the edge default's length-grouped ones; the
table's last column is the training tokens per second of training compute (padding is computed, not counted).

    python benchmarks/federation_step.py --tokens 3000 --rounds 4 --variants avg,sum,single2,single1.4   # ~12 min
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_quality import fedavg as aggregate  # noqa: E402  (flwr's weighted average, as the strategy runs it)

LR = 5e-4  # the unit of `@<s>` (the presets: `@4x0.8 --lr-min 5e-4`); the tables in docs/ use it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3000, help="training tokens per edge and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default="avg,sum,single2,single1.4")
    ap.add_argument("--lr-min", type=float, default=0.0, help="the floor of an @<s>x<d> schedule")
    ap.add_argument("--group-by-length", type=int, default=None,
                    help="the edges' training.group_by_length (default: the edge's; 0: random micro-batches)")
    ap.add_argument("--out", default="runs/federation_step.json")
    args = ap.parse_args()
    if args.lr_min < 0:
        ap.error("--lr-min must be 0 or more")
    variants = []  # (name as given, the variant without its @<s>, its first round's learning rate, its decay)
    for name in [x.strip() for x in args.variants.split(",") if x.strip()]:
        if not re.fullmatch(r"(avg|sum|(lr|m|single)\d+(\.\d+)?|asym:\d+/\d+)(@\d+(\.\d+)?(x\d+(\.\d+)?)?)?", name):
            ap.error(f"--variants: unknown variant {name!r} (avg, sum, lr<eta>, m<beta>, asym:<t0>/<t1>, single<x>, "
                     f"each with an optional @<lr scale> and x<decay per round>)")
        v, _, schedule = name.partition("@")
        scale, _, decay = schedule.partition("x")
        if float(scale or 1) <= 0:
            ap.error(f"--variants: {name!r}: the lr scale after @ must be above 0")
        if not 0 < float(decay or 1) <= 1:
            ap.error(f"--variants: {name!r}: the decay after x must be in (0, 1]")
        if args.lr_min > LR * float(scale or 1):
            ap.error(f"--lr-min {args.lr_min:g} is above {name!r}'s first rate {LR * float(scale or 1):g}: the floor "
                     f"would raise it; lower --lr-min or the variant's @<s>")
        variants.append((name, v, LR * float(scale or 1), float(decay or 1)))

    from collm.common.data import categories, load_records, partition_by_category
    from collm.edge_client.engine import Engine
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget
    from collm.lab.bench_config import BenchConfig
    from collm.lab.bench_quality import QualityJudge
    from collm.lab.topology import edge_config
    from collm.server.lr_schedule import round_lr

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    halves = [categories(p) for p in partition_by_category(load_records(), 2)]

    grouping = {} if args.group_by_length is None else {"group_by_length": args.group_by_length}

    def cfg(name, cats, threads):
        return edge_config("bundled", name, out.parent / "federation_step", categories=cats,
                           overrides={"engine": {"warmup": False}, "model": {"threads": threads},
                                      "training": {"max_eval_records": 8, "carry_between_rounds": False, **grouping}})

    # collm-bench's own judge, on its held-out set (configs/bench.yaml: eval_records 24)
    judged = QualityJudge(BenchConfig.model_validate({"model": "bundled", "out": str(out.parent / "federation_step"),
                                                      "eval_records": 24})).loss

    results, rates = {}, {}
    for name, v, lr0, decay in variants:
        spent = trained = 0.0
        t0 = time.time()
        if v.startswith("single"):
            cfgs = [cfg("single", halves[0] + halves[1], 2)]
            tokens = [int(float(v[6:]) * args.tokens)]
        else:
            cfgs = [cfg(f"edge{i}", halves[i], 1) for i in range(2)]
            tokens = [int(t) for t in v[5:].split("/")] if v.startswith("asym:") else [args.tokens] * 2
        engines = [Engine(load_model(c.model), c, load_edge_data(c.data)).start() for c in cfgs]
        pool = ThreadPoolExecutor(len(engines))
        glob, momentum = engines[0].initial_state, None
        losses = [judged(glob)]
        try:
            for r in range(args.rounds):
                start, lr = glob, round_lr(lr0, decay, args.lr_min, r + 1)
                reps = list(pool.map(lambda et: et[0].train(TrainBudget(tokens=et[1]), global_state=start, lr=lr,
                                                            serve_local=False).result(), zip(engines, tokens)))
                mean = aggregate([rep.adapter_state for rep in reps], [max(rep.sequences, 1) for rep in reps])
                delta = {k: mean[k] - start[k] for k in mean}
                if v == "sum":
                    delta = {k: len(reps) * d for k, d in delta.items()}
                elif v.startswith("lr"):
                    delta = {k: float(v[2:]) * d for k, d in delta.items()}
                elif v.startswith("m"):
                    momentum = delta if momentum is None else {k: float(v[1:]) * momentum[k] + delta[k] for k in delta}
                    delta = momentum
                glob = {k: start[k] + delta[k] for k in delta}
                losses.append(judged(glob))
                computed = [round(rep.compute_seconds, 1) for rep in reps]
                spent += sum(rep.compute_seconds for rep in reps)
                trained += sum(rep.tokens for rep in reps)
                print(f"{name} round {r + 1}: held-out loss {losses[-1]:.4f}, tokens {[rep.tokens for rep in reps]}, "
                      f"training compute {computed} s, {time.time() - t0:.0f} s", flush=True)
        finally:
            pool.shutdown()
            for e in engines:
                e.stop()
        results[name] = losses
        rates[name] = trained / max(spent, 1e-9)
    print("\n| variant | " + " | ".join(f"round {r}" for r in range(args.rounds + 1)) + " | tokens / compute s |")
    print("|---" * (args.rounds + 3) + "|")
    for v, losses in results.items():
        print(f"| {v} | " + " | ".join(f"{x:.4f}" for x in losses) + f" | {rates[v]:.0f} |")
    out.write_text(json.dumps({"args": vars(args), "loss_by_round": results, "tokens_per_compute_s": rates}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    sys.exit(main())
