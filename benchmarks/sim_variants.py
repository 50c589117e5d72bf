"""collm-sim screen of collm variants before a real A/B: the same arrivals and seeds for every variant.

    python benchmarks/sim_variants.py --variants '{"base": {}, "newest": {"router": {"pack_newest": true}}}'
    python benchmarks/sim_variants.py --variants '{"e0": {}, "e25": {"top": {"eval_share": 0.25}}}' --seeds 10

Each variant is configs/sim-fidelity.yaml's setting with the router at its defaults (the fidelity preset pins
the 2026-12-04 run's router) and collm only, with `router:` merged into the sim's router settings and `top:`
into the top level. Per seed the capacity is searched once and every variant replays the same load points.
Printed per variant and load point, means over the seeds: attainment, training tokens/s, rounds, the served
loss at the end and a quality-weighted goodput (per met request, the base loss minus the loss of the version
that served it, per second of the point's window).
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path

import yaml

from collm.sim.config import SimConfig
from collm.sim.profile import load_profile
from collm.sim.run import capacity, load_requests, point_result
from collm.sim.world import World, fleet_profiles


def screen(variants: dict, seeds: int, fractions: list[float], config: str) -> dict:
    raw = yaml.safe_load(Path(config).read_text())
    raw.pop("collm_routing", None)
    raw.update(router={}, modes=["collm"])
    raw["load"]["fractions"] = fractions
    base = SimConfig(**raw)
    reqs = load_requests(base)
    rows: dict = {}
    for seed in range(seeds):
        cap = capacity(base, reqs, base.edges, seed)
        points = [base.trace.segment(reqs, f * cap["rate"], base.load.seconds, base.load.min_requests)
                  for f in fractions]
        for name, v in variants.items():
            d = json.loads(json.dumps(raw))
            d["router"].update(v.get("router", {}))
            d.update(v.get("top", {}))
            cfg = SimConfig(**d)
            world = World(cfg, "collm", fleet_profiles(cfg, cfg.edges, load_profile), seed)
            spans = world.run(points, cfg.warmup_s, cfg.load.drain_s)["spans"]
            loss = {version: value for _, version, value in world.losses}
            b = cfg.quality.loss(0.0)
            rounds = sum(1 for r in world.rounds if r.aggregated_at is not None)
            for i, (seg, span) in enumerate(zip(points, spans)):
                p = point_result(world, seg, span, {"fraction": fractions[i], "_point": i}, 200)
                qwg = sum(b - loss.get(s.version, b) for s in world.out if s.point == i and s.met) / p["window_s"]
                rows.setdefault((name, fractions[i]), []).append(
                    (p["slo_attainment"], p["train_tokens_per_s"], rounds, world.losses[-1][2], qwg))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True, help="JSON: name -> {router: {...}, top: {...}}")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--fractions", default="0.3,0.8,1.0", help="load points, x the simulated capacity")
    ap.add_argument("--config", default="configs/sim-fidelity.yaml")
    a = ap.parse_args()
    rows = screen(json.loads(a.variants), a.seeds, [float(f) for f in a.fractions.split(",")], a.config)
    for (name, f), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        att, train, rounds, loss, qwg = (st.mean(c) for c in zip(*v))
        print(f"{name:>12} {f:>4}: attainment {att:.3f}  train {train:6.1f} tok/s  rounds {rounds:.1f}  "
              f"end loss {loss:.4f}  QWG {qwg:.4f}")


if __name__ == "__main__":
    main()
