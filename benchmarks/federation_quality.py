"""Served holdout loss per edge after N rounds for each federation option, same token budget.

Three edges on the bundled SmolLM2-135M-Instruct with the Dolly category groups of
`configs/lab/edge*.yaml` (non-IID), in one process, as `adapter_quality.py` runs them: each round
every edge trains `--tokens` tokens from the global on its engine (`Engine.train`, what a round
runs), the server aggregates, and every edge evaluates the new global (what it then serves) on its
own holdout split. The variants, each on fresh engines with the same seeds:

* fedavg   A and B averaged separately, weighted by sequences (flwr's aggregation);
* fedprox  the same with the proximal term (`proximal_mu` of configs/server.yaml);
* ffa      FFA-LoRA: A frozen at the shared seeded init (`Engine.train(freeze_a=True)`), only B
           trained and averaged, which is the exact average of the products B·A;
* dp-zZ    fedavg under central DP: each update clipped on the edge (`clipped_update`, the edge's
           function), equal weights, Gaussian noise z·C/n (`collm.server.privacy.noised`, the
           server's), epsilon from Flower's RDP accountant (`PrivacyLedger`). C: `--clip`, default
           the median update norm of fedavg's first round in this run (a convenience of the
           benchmark: a real deployment fixes C without looking at the updates).

Mixed ranks (issue #35; edges of ranks 4, 8 and 16, alpha = 2 x rank so every edge's LoRA scale is 2):

* product      homogeneous rank 8, `lora_aggregation: product` (the products averaged exactly, then the
               best rank-8 factors: common/lora_rank.py, what the server's ProductLora rule runs);
* mixed        ranks 4/8/16 under product aggregation at the server's rank 16; each edge trains and
               serves its own-rank fit of the global (the share of its energy kept is recorded);
* mixed-pad    ranks 4/8/16, the naive alternative: factors zero-padded to 16 and averaged, each edge
               takes the first r rows of A and columns of B (not exact: the HetLoRA-style baseline
               without its self-pruning);
* product-nf4  product at rank 8 with the middle edge's base in nf4 (bitsandbytes; it trains QLoRA and
               evaluates, as it serves, on its 4-bit base) among two float edges.

They also record, per edge and round, the training seconds and the bytes on the wire (the global it
is sent at the server's rank, the update it sends at its own).

No Flower transport and no HTTP (tests/test_federation_privacy.py runs the options through a real
SuperLink). About 5 minutes per variant on 2 cores with the defaults.

    python benchmarks/federation_quality.py --rounds 5 --tokens 1500
    python benchmarks/federation_quality.py --variants fedavg,product,mixed,mixed-pad
    python benchmarks/federation_quality.py --variants product,product-nf4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_quality import edge_cfg  # noqa: E402  (the same three edges)
from adapter_quality import fedavg as aggregate  # noqa: E402  (flwr's weighted average, as the strategy runs it)

ROOT = Path(__file__).resolve().parents[1]


def run_variant(name: str, args, clip: float | None, z: float) -> dict:
    import torch

    from collm.edge_client.engine import Engine
    from collm.edge_client.federation.records import clipped_update
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget
    from collm.server.config import ServerConfig
    from collm.common.config import load_config
    from collm.server.privacy import PrivacyLedger, Release, noised

    mu = load_config(ServerConfig, ROOT / "configs" / "server.yaml").proximal_mu if name == "fedprox" else 0.0
    freeze_a = name == "ffa"
    dp = name.startswith("dp")
    ledger = PrivacyLedger(1e-5)
    cfgs = [edge_cfg(i, args.eval_records) for i in range(1, 4)]
    engines = [Engine(load_model(c.model), c, load_edge_data(c.data)).start() for c in cfgs]
    names = [e.cfg.name for e in engines]
    pool = ThreadPoolExecutor(len(engines))
    rows, norms = [], []
    t0 = time.time()
    try:
        glob = engines[0].initial_state
        base = list(pool.map(lambda e: e.evaluate(state=e.initial_state).result().loss, engines))
        for r in range(1, args.rounds + 1):
            start = glob
            reports = list(pool.map(lambda e: e.train(TrainBudget(tokens=args.tokens), global_state=start,
                                                      proximal_mu=mu, freeze_a=freeze_a).result(), engines))
            updates = [rep.adapter_state for rep in reports]
            round_norms = [float(torch.sqrt(sum(((u[k] - start[k]) ** 2).sum() for k in u))) for u in updates]
            norms.append(round_norms)
            if dp:
                updates = [clipped_update(u, start, clip)[0] for u in updates]
                glob = aggregate(updates, [1.0] * len(updates))
                state, _ = noised({k: v.numpy() for k, v in glob.items()}, list(glob), z, clip, len(updates))
                glob = {k: torch.from_numpy(v) for k, v in state.items()}
                ledger.record(Release(z, len(updates)))
            else:
                glob = aggregate(updates, [max(rep.sequences, 1) for rep in reports])
            losses = list(pool.map(lambda e: e.evaluate(state=glob).result().loss, engines))
            spent = ledger.spent(population=len(engines)) if dp else None
            rows.append({"round": r, "loss": dict(zip(names, losses)), "update_norms": round_norms,
                         "epsilon": spent.epsilon if spent else None})
            print(f"  {name} round {r} ({time.time() - t0:.0f} s): " + ", ".join(
                f"{n} {v:.4f}" for n, v in zip(names, losses)) + f"; update norms {[round(x, 3) for x in round_norms]}"
                + (f"; epsilon {spent.epsilon:.1f}" if spent else ""), flush=True)
    finally:
        for e in engines:
            e.stop()
    return {"variant": name, "base": dict(zip(names, base)), "rounds": rows, "clip": clip if dp else None,
            "noise_multiplier": z if dp else None, "wall_s": time.time() - t0}


RANKED = {"product": (8, 8, 8), "mixed": (4, 8, 16), "mixed-pad": (4, 8, 16), "product-nf4": (8, 8, 8)}
QUANTIZED = {"product-nf4": {1: "nf4"}}  # variant -> {edge index: its base's precision} (the others float)


def _nbytes(state: dict) -> int:
    return int(sum(v.numel() * 4 for v in state.values()))  # float32 on the wire


def run_ranked(name: str, args) -> dict:
    """A round loop where each edge trains its own rank; the server aggregates as products (product, mixed)
    or as zero-padded factors (mixed-pad)."""
    import numpy as np
    import torch

    from collm.common.lora_rank import combine
    from collm.edge_client.engine import Engine
    from collm.edge_client.federation.records import fit_to_rank
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data
    from collm.edge_client.training.jobs import TrainBudget

    ranks = RANKED[name]
    server_r, server_alpha = max(ranks), 2.0 * max(ranks)
    cfgs = [edge_cfg(i, args.eval_records, rank) for i, rank in zip(range(1, 4), ranks)]
    for k, q in QUANTIZED.get(name, {}).items():  # its base in 4-bit: it trains QLoRA and serves on that base
        cfgs[k] = cfgs[k].model_copy(update={"model": cfgs[k].model.model_copy(update={"quantization": q})})
    engines = [Engine(load_model(c.model), c, load_edge_data(c.data)).start() for c in cfgs]
    names = [e.cfg.name for e in engines]
    pool = ThreadPoolExecutor(len(engines))

    def own(e, glob):
        """The global as edge `e` trains and serves it, and the share of its energy kept."""
        if glob is None:
            return e.initial_state, 1.0
        r = e.cfg.lora.r
        if name == "mixed-pad":
            return {k: (v[:r].clone() if "lora_A" in k else v[:, :r].clone()) for k, v in glob.items()}, None
        return fit_to_rank(glob, server_alpha, r, e.cfg.lora.alpha, e.initial_state)

    def padded(state):
        return {k: torch.nn.functional.pad(v, (0, 0, 0, server_r - v.shape[0]) if "lora_A" in k
                                           else (0, server_r - v.shape[1])) for k, v in state.items()}

    rows, glob, t0 = [], None, time.time()
    try:
        base = list(pool.map(lambda e: e.evaluate(state=e.initial_state).result().loss, engines))
        for r in range(1, args.rounds + 1):
            starts = [own(e, glob) for e in engines]
            reports = list(pool.map(lambda es: es[0].train(TrainBudget(tokens=args.tokens), global_state=es[1][0]).result(),
                                    zip(engines, starts)))
            weights = [max(rep.sequences, 1) for rep in reports]
            down = [0 if glob is None else _nbytes(glob) for _ in engines]
            up = [_nbytes(rep.adapter_state) for rep in reports]
            if name == "mixed-pad":
                glob, server_energy = aggregate([padded(rep.adapter_state) for rep in reports], weights), None
            else:
                total = float(sum(weights))
                terms = [({k: v.numpy() for k, v in rep.adapter_state.items()}, w / total * e.cfg.lora.scaling)
                         for rep, w, e in zip(reports, weights, engines)]
                state, server_energy = combine(terms, server_r, server_alpha)
                glob = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
            served = [own(e, glob) for e in engines]
            losses = list(pool.map(lambda es: es[0].evaluate(state=es[1][0]).result().loss, zip(engines, served)))
            rows.append({"round": r, "loss": dict(zip(names, losses)), "server_energy": server_energy,
                         "edge_energy": dict(zip(names, [s[1] for s in served])),
                         "train_s": dict(zip(names, [rep.seconds for rep in reports])),
                         "bytes_down": dict(zip(names, down)), "bytes_up": dict(zip(names, up))})
            print(f"  {name} round {r} ({time.time() - t0:.0f} s): " + ", ".join(
                f"{n} {v:.4f}" for n, v in zip(names, losses))
                + (f"; energy kept: server {server_energy:.3f}, edges "
                   + ", ".join(f"{s[1]:.3f}" for s in served) if server_energy is not None else ""), flush=True)
    finally:
        for e in engines:
            e.stop()
    return {"variant": name, "ranks": dict(zip(names, ranks)), "base": dict(zip(names, base)), "rounds": rows,
            "clip": None, "noise_multiplier": None, "wall_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1500, help="training tokens per edge and round")
    ap.add_argument("--eval-records", type=int, default=16, help="holdout records per evaluation")
    ap.add_argument("--variants", default="fedavg,fedprox,ffa,dp-z1.0",
                    help="comma-separated: fedavg, fedprox, ffa, dp-z<noise multiplier> (e.g. dp-z0.1), "
                    "product, mixed, mixed-pad")
    ap.add_argument("--clip", type=float, help="DP clipping norm (default: median of fedavg's round-1 update norms)")
    ap.add_argument("--out", default="runs/federation_quality.json")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("fedavg", "fedprox", "ffa", *RANKED) and not v.startswith("dp-z"):
            ap.error(f"--variants: unknown variant {v!r}")
    if any(v.startswith("dp") for v in variants) and args.clip is None and "fedavg" not in variants:
        ap.error("--clip is needed when fedavg (whose round-1 norms give the default) is not among --variants")
    # fedavg first: its norms give the default clipping norm
    variants.sort(key=lambda v: (v != "fedavg", v.startswith("dp")))

    t_start = time.time()
    results, clip = [], args.clip
    for v in variants:
        z = float(v[4:]) if v.startswith("dp-z") else 0.0
        print(f"{v}:", flush=True)
        res = run_ranked(v, args) if v in RANKED else run_variant(v, args, clip, z)
        results.append(res)
        if v == "fedavg" and clip is None:
            clip = statistics.median(res["rounds"][0]["update_norms"])
            print(f"  DP clipping norm: {clip:.4g} (median fedavg round-1 update norm)", flush=True)

    names = list(results[0]["base"])
    print(f"\nholdout loss per edge after round {args.rounds} (same {args.tokens} tokens per edge and round)\n")
    print("| variant | " + " | ".join(names) + " | mean | epsilon |")
    print("|---" * (len(names) + 3) + "|")
    print("| base (no LoRA) | " + " | ".join(f"{results[0]['base'][n]:.4f}" for n in names)
          + f" | {statistics.mean(results[0]['base'].values()):.4f} | - |")
    for res in results:
        last = res["rounds"][-1]
        eps = f"{last['epsilon']:.1f}" if last.get("epsilon") is not None else "-"
        label = res["variant"] + (f" (C {res['clip']:.3g})" if res["clip"] else "")
        print(f"| {label} | " + " | ".join(f"{last['loss'][n]:.4f}" for n in names)
              + f" | {statistics.mean(last['loss'].values()):.4f} | {eps} |")
    ranked = [res for res in results if "ranks" in res]
    if ranked:
        print("\nmixed ranks: energy kept in the last round, and per edge the mean training seconds per round and "
              "the bytes on the wire per round (global down / update up)\n")
        print("| variant | ranks | server energy | edge energy | " + " | ".join(f"{n} s, down/up KiB" for n in names) + " |")
        print("|---" * (len(names) + 4) + "|")
        for res in ranked:
            last, rs = res["rounds"][-1], res["rounds"]
            se = f"{last['server_energy']:.3f}" if last["server_energy"] is not None else "-"
            ee = ", ".join(f"{v:.3f}" for v in last["edge_energy"].values()) if None not in last["edge_energy"].values() else "-"
            cells = [f"{statistics.mean(x['train_s'][n] for x in rs):.1f}, "
                     f"{statistics.mean(x['bytes_down'][n] for x in rs[1:]) / 1024 if len(rs) > 1 else 0:.0f}/"
                     f"{statistics.mean(x['bytes_up'][n] for x in rs) / 1024:.0f}" for n in names]
            print(f"| {res['variant']} | {'/'.join(map(str, res['ranks'].values()))} | {se} | {ee} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results, "wall_s": time.time() - t_start}, indent=1))
    print(f"\nwrote {out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
