"""What each model name serves, by quality: base vs `collm-global` vs `collm-global:local`, per edge and round.

Three edges on the bundled SmolLM2-135M-Instruct, each with its own Dolly categories (the split of
`configs/lab/edge*.yaml`), in one process: each round every edge trains `--tokens` tokens from the
global adapter on its engine (the same `Engine.train` a federated round runs), the server's FedAvg
(flwr's aggregation, weighted by num-examples: the sequences each edge trained) makes the next global, and every
edge evaluates on its own holdout split

* the base (`smollm2-135m-instruct`: no LoRA),
* the round's global adapter (`collm-global`), and
* its own adapter at the round's end (`collm-global:local`: the global plus what this edge
  trained on its own data; what `:local` serves until the next global is swapped in).

No Flower and no HTTP here: this measures the adapters, not the transport (tests/test_federation_lab.py
runs the same rounds through a real SuperLink). About 6-8 minutes on 2 cores with the defaults.

    python benchmarks/adapter_quality.py --rounds 3 --tokens 1500
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def edge_cfg(i: int, eval_records: int, rank: int | None = None):
    import yaml

    from collm.common.config import load_config
    from collm.edge_client.config import EdgeConfig

    lab = yaml.safe_load((ROOT / "configs" / "lab" / f"edge{i}.yaml").read_text())
    over = {"name": lab["name"], "data": {"categories": lab["data"]["categories"]},
            "engine": {"warmup": False}, "training": {"max_eval_records": eval_records},
            "model": {"threads": 1}}
    if rank is not None:  # a mixed-rank fleet: alpha = 2 x rank keeps every edge's LoRA scale at 2
        over["lora"] = {"r": rank, "alpha": 2.0 * rank}
    return load_config(EdgeConfig, ROOT / "configs" / "edge-smollm2.yaml", over)


def fedavg(states: list[dict], examples: list[float]) -> dict:
    """The server's FedAvg: flwr's own aggregation, weighted by num-examples, over keyed records."""
    from flwr.app import MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from collm.common import wire
    from collm.edge_client.federation.records import to_state

    records = [RecordDict({"arrays": wire.keyed({k: v.numpy() for k, v in s.items()}),
                           "metrics": MetricRecord({"num-examples": n})}) for s, n in zip(states, examples)]
    return to_state(aggregate_arrayrecords(records, "num-examples"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", type=int, default=3, choices=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1500, help="training tokens per edge and round")
    ap.add_argument("--eval-records", type=int, default=16, help="holdout records per evaluation")
    ap.add_argument("--out", default="runs/adapter_quality.json")
    args = ap.parse_args()

    from collm.edge_client.engine import Engine
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget

    t_start = time.time()
    engines = []
    for i in range(1, args.edges + 1):
        cfg = edge_cfg(i, args.eval_records)
        engines.append(Engine(load_model(cfg.model), cfg, load_edge_data(cfg.data)).start())
        print(f"{cfg.name}: {cfg.data.categories}, {len(engines[-1].holdout)} holdout records", flush=True)
    names = [e.cfg.name for e in engines]
    pool = ThreadPoolExecutor(len(engines))

    def evaluate(eng, state) -> float:
        return eng.evaluate(state=state).result().loss

    rows = []
    try:
        base = list(pool.map(lambda e: evaluate(e, e.initial_state), engines))  # B = 0: the base model
        print("base: " + ", ".join(f"{n} {b:.4f}" for n, b in zip(names, base)), flush=True)
        glob = engines[0].initial_state
        for r in range(1, args.rounds + 1):
            reports = list(pool.map(lambda e: e.train(TrainBudget(tokens=args.tokens), global_state=glob).result(),
                                    engines))
            locals_ = [rep.adapter_state for rep in reports]
            glob = fedavg(locals_, [max(rep.sequences, 1) for rep in reports])
            g_loss = list(pool.map(lambda e: evaluate(e, glob), engines))
            l_loss = list(pool.map(lambda el: evaluate(el[0], el[1]), zip(engines, locals_)))
            for n, b, g, l, rep in zip(names, base, g_loss, l_loss, reports):
                rows.append({"round": r, "edge": n, "base": b, "global": g, "local": l, "tokens": rep.tokens})
            print(f"round {r} ({time.time() - t_start:.0f} s): " + "; ".join(
                f"{n} base {b:.4f} global {g:.4f} local {l:.4f}"
                for n, b, g, l in zip(names, base, g_loss, l_loss)), flush=True)
    finally:
        for e in engines:
            e.stop()

    print("\n| round | edge | base | collm-global | collm-global:local |\n|---|---|---|---|---|")
    for row in rows:
        best = min(row["base"], row["global"], row["local"])
        cells = [f"**{row[k]:.4f}**" if row[k] == best else f"{row[k]:.4f}" for k in ("base", "global", "local")]
        print(f"| {row['round']} | {row['edge']} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "wall_s": time.time() - t_start}, indent=1))
    print(f"\nwrote {out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
