"""Which term of the router's TTFT estimate makes it pessimistic in a burst? A collm-sim decomposition.

    python benchmarks/estimate_terms.py --config docs/bench-run-2026-12-06-unseen/sim-fidelity.yaml --seeds 3

collm only, at `--fractions` x the capacity searched per seed (as sim_variants.py does). For every
request the simulated router routes, the soonest-edge TTFT estimate is recomputed on the same snapshot with one
term switched off at a time, by the rule's own code (`router.fleet.estimates` on the columns it routed by):
`g = 1` (no stretch for training beside serving) and `no guard` (the finish-rate guard on the wait term off,
leaving the cost model's departures). Printed per load point, over the seeds: the refused requests' estimates
(median) and how many each variant would still refuse, and for the admitted requests whose routed estimate
was at least `--above` seconds, the simulated TTFT over each variant's estimate (median [10th, 90th
percentile]). 1 is a true estimate; the real run's `estimate_report.py` gives the routed one's. Last, the stretch
g = 1 + b / max(1 - sigma, 0.05) of the training edges the router saw (median and maximum) and their b, the
share of the window spent training beside serving (mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from pathlib import Path

import numpy as np
import yaml

from collm.common.stats import percentile
from collm.router import fleet
from collm.sim.config import SimConfig
from collm.sim.profile import load_profile
from collm.sim.run import capacity, load_requests
from collm.sim.world import World, fleet_profiles

VARIANTS = {
    "as routed": lambda c: c,
    "g = 1": lambda c: dataclasses.replace(c, training=np.zeros_like(c.training)),
    "no guard": lambda c: dataclasses.replace(c, finish_rate=np.zeros_like(c.finish_rate)),
}


class Probe(World):
    """collm-sim's world, noting each routed request's soonest estimate under every variant."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.estimates: dict[tuple[int, int], list[float]] = {}
        self.stretch: dict[int, list[tuple[float, float]]] = {}  # load point -> (g, b) of each training edge seen
        self._cols = None

    def _columns(self, now, shard=0):
        self._cols = super()._columns(now, shard)
        return self._cols

    def _route(self, i, tr, now):
        shard = self.counter % self.shards
        super()._route(i, tr, now)
        x = self.request_view(tr)
        a = self.assumptions[shard]
        c = self._cols
        on = c.training.astype(bool)  # the router's own g (fleet.stretch) of each training edge, and its b
        self.stretch.setdefault(self._point, []).extend(zip(fleet.stretch(c)[on], np.nan_to_num(c.busy[on])))
        self.estimates[(self._point, i)] = [float(np.nanmin(fleet.estimates(v(self._cols), x, a)["ttft"]))
                                            for v in VARIANTS.values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sim-fidelity.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--fractions", default="0.8,1.0,1.2", help="load points, x the simulated capacity")
    ap.add_argument("--above", type=float, default=1.0, help="admitted requests with a routed estimate of at least "
                    "this many seconds (a queue to speak of)")
    a = ap.parse_args()
    raw = yaml.safe_load(Path(a.config).read_text())
    raw.pop("collm_routing", None)
    fractions = [float(f) for f in a.fractions.split(",")]
    raw.update(modes=["collm"])
    raw["load"]["fractions"] = fractions
    cfg = SimConfig(**raw)
    reqs = load_requests(cfg)
    target = cfg.ttft_ms / 1000
    refused: dict[int, list[list[float]]] = {}
    admitted: dict[int, list[tuple[float, list[float]]]] = {}
    stretch: dict[int, list[tuple[float, float]]] = {}
    for seed in range(a.seeds):
        cap = capacity(cfg, reqs, cfg.edges, seed)
        points = [cfg.trace.segment(reqs, f * cap["rate"], cfg.load.seconds, cfg.load.min_requests) for f in fractions]
        world = Probe(cfg, "collm", fleet_profiles(cfg, cfg.edges, load_profile), seed)
        world.run(points, cfg.warmup_s, cfg.load.drain_s)
        for i, gb in world.stretch.items():
            stretch.setdefault(i, []).extend(gb)
        for s in world.out:
            est = world.estimates.get((s.point, s.index))
            if est is None or not 0 <= s.point < len(fractions):
                continue
            if s.status == "refused" and s.edge < 0:  # the router's 429, not an edge's
                refused.setdefault(s.point, []).append(est)
            elif s.ttft_s is not None and est[0] >= a.above:
                admitted.setdefault(s.point, []).append((s.ttft_s, est))
    names = list(VARIANTS)
    print(f"collm-sim, {a.seeds} seeds, TTFT target {target:g} s; admitted: routed estimate >= {a.above:g} s")
    for i, f in enumerate(fractions):
        ref, adm = refused.get(i, []), admitted.get(i, [])
        print(f"{f:g} x C: refused {len(ref)}, admitted above {len(adm)}")
        for j, name in enumerate(names):
            r = [e[j] for e in ref]
            q = [t / e[j] for t, e in adm if e[j] > 0]
            est = f"refused: estimate p50 {statistics.median(r):.2f} s, still refused {sum(v > target for v in r)}" \
                if r else "refused: -"
            got = f"TTFT / estimate {percentile(q, 0.5):.2f} [{percentile(q, 0.1):.2f}, {percentile(q, 0.9):.2f}]" \
                if q else "TTFT / estimate -"
            print(f"    {name:>10}: {est};  admitted: {got}")
        gb = stretch.get(i, [])
        g = [v for v, _ in gb if math.isfinite(v)]  # an edge whose columns came back NaN has no g
        if g:
            print(f"    training edges seen: g p50 {percentile(g, 0.5):.2f}, max {max(g):.2f}; "
                  f"b mean {statistics.fmean(b for _, b in gb):.3f}")


if __name__ == "__main__":
    main()
