"""What padding costs a training micro-batch and an evaluation, with and without grouping by length.

A micro-batch is padded to its longest sequence and every layer unit computes the padding; the job
counts only real tokens. On the bundled SmolLM2-135M-Instruct with one thread (as each bench replica
runs) and the bench's two halves of Dolly (`partition_by_category(load_records(), 2)`), this times, per
half, whole training passes (forward and backward units, `LocalTrainer.new_pass`) of micro-batches drawn
at random (`training.group_by_length` 0) and grouped by length (the default), alternating the two in
each repeat so a drift of the machine weighs on both alike, and the holdout evaluation of
`--eval-records` records in the records' own order and batched by length (`EvalJob`'s order). Ratios
are of real tokens per second (training) and seconds per evaluation, with 95% bootstrap intervals over
the paired repeats. Before timing, it counts (no model run) the padding share of 2000 random micro-batches
and of 2000 random evaluation batches of each half, against the grouped ones.

    python benchmarks/padding.py --repeats 12      # ~4 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _run(p) -> float:
    t = time.perf_counter()
    p.run_all()
    return time.perf_counter() - t


def _pad_share(batches) -> float:
    """The share of the computed tokens that is padding (each batch padded to its longest)."""
    computed = sum(len(b) * max(len(e.input_ids) for e in b) for b in batches)
    return 1 - sum(len(e.input_ids) for b in batches for e in b) / computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=12, help="training micro-batch pairs and evaluations per half")
    ap.add_argument("--eval-records", type=int, default=8, help="holdout records per evaluation (the bench's 8)")
    args = ap.parse_args()
    if args.repeats < 2 or args.eval_records < 1:
        ap.error("--repeats must be >= 2 and --eval-records >= 1")

    from collm.common.data import categories, load_records, partition_by_category
    from collm.common.stats import ratio_ci
    from collm.edge_client.engine import Engine
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.evaluation import by_length
    from collm.edge_client.training.layerwise import LayerwisePass
    from collm.edge_client.training.trainer import ExampleStream, collate
    from collm.lab.topology import edge_config

    out = Path("runs/padding")
    rows = []
    for i, cats in enumerate(categories(p) for p in partition_by_category(load_records(), 2)):
        cfg = edge_config("bundled", f"half{i}", out, categories=cats,
                          overrides={"engine": {"warmup": False}, "model": {"threads": 1},
                                     "training": {"max_eval_records": args.eval_records}})
        eng = Engine(load_model(cfg.model), cfg, load_edge_data(cfg.data))
        tr, k = eng.trainer, cfg.training.micro_batch_size
        streams = {g: ExampleStream(tr.stream.examples, seed=1, k=k, group=g) for g in (0, 50)}
        draws = {g: [streams[g].take(k) for _ in range(2000)] for g in (0, 50)}
        pick, pool = np.random.default_rng(i), tr.stream.examples  # the half's records, as holdout ones come
        evals = [[pool[j] for j in pick.choice(len(pool), cfg.training.eval_batch_size, replace=False)]
                 for _ in range(2000)]
        rows.append((f"half {i}: padding share of 2000 micro-batches of {k}, random / grouped", None,
                     f"{_pad_share(draws[0]):.1%} / {_pad_share(draws[50]):.1%}; of 2000 random batches of "
                     f"{cfg.training.eval_batch_size} records: {_pad_share(evals):.1%}"))
        tok = {0: [], 50: []}
        sec = {0: [], 50: []}
        width = {0: 0, 50: 0}
        _run(tr.new_pass(streams[0].peek(k)))  # a first pass allocates; not timed
        for r in range(args.repeats):
            for g in ((0, 50) if r % 2 == 0 else (50, 0)):
                p = tr.new_pass(streams[g].take(k))
                width[g] += p.width
                sec[g].append(_run(p))
                tok[g].append(p.tokens)
        pad = {g: width[g] / sum(tok[g]) for g in width}
        # the rate ratio: (real tokens / s grouped) / (real tokens / s random), paired by repeat
        num = np.array(tok[50]) * np.array(sec[0])
        den = np.array(tok[0]) * np.array(sec[50])
        rate = ratio_ci(num, den)
        rows.append((f"half {i}: training, real tokens/s grouped / random", rate,
                     f"computed / real tokens {pad[0]:.3f} random, {pad[50]:.3f} grouped; "
                     f"median pass {statistics.median(sec[0]):.2f} / {statistics.median(sec[50]):.2f} s"))

        hold = eng.holdout
        bs = cfg.training.eval_batch_size

        def eval_s(examples) -> tuple[float, int]:
            t, w = 0.0, 0
            for j in range(0, len(examples), bs):
                ids, mask, labels = collate(examples[j: j + bs], eng.tokenizer.pad_token_id, eng.device)
                p = LayerwisePass(eng.parts, ids, mask, labels, None)
                w += p.width
                t += _run(p)
            return t, w

        own, grouped = [], []
        for r in range(args.repeats):
            for which in ((own, hold), (grouped, by_length(hold, bs))) if r % 2 == 0 else \
                    ((grouped, by_length(hold, bs)), (own, hold)):
                which[0].append(eval_s(which[1]))
        real = sum(len(e.input_ids) for e in hold)
        ev = ratio_ci([s for s, _ in grouped], [s for s, _ in own])
        rows.append((f"half {i}: evaluation of {len(hold)} records, seconds by length / own order", ev,
                     f"computed / real tokens {own[0][1] / real:.3f} own order, {grouped[0][1] / real:.3f} by length"))
        eng.stop()

    print("\n| what | ratio [95% CI] | detail |\n|---|---|---|")
    for what, ratio, detail in rows:
        print(f"| {what} | " + (f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]" if ratio else "") + f" | {detail} |")


if __name__ == "__main__":
    sys.exit(main())
