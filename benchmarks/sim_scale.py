"""collm-sim at fleet scale: wall time and peak memory of one mode on 10-1,000 edges.

    python benchmarks/sim_scale.py --edges 1000 --seconds 600 --fraction 0.8
    python benchmarks/sim_scale.py --edges 100 --seconds 3600

The offered rate is `fraction` x (the 2-edge serve-only capacity the config's capacity search finds,
per edge) x edges, so every fleet size runs at the same relative load. Prints, per mode, simulated
seconds, requests, events, wall seconds, events per second and the process's peak RSS; the issue's
bound is 2 minutes on 2 cores for 1,000 edges x 10 minutes and for 100 edges x 1 hour.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from collm.common.config import load_config
from collm.common.traces import trace_segment
from collm.sim.config import SimConfig
from collm.sim.run import capacity, load_requests, simulate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/sim.yaml")
    p.add_argument("--edges", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--fraction", type=float, default=0.8)
    p.add_argument("--modes", default="collm", help="comma-separated")
    p.add_argument("--capacity-per-edge", type=float, help="skip the 2-edge capacity search (req/s per edge)")
    args = p.parse_args(argv)
    cfg = load_config(SimConfig, args.config)
    reqs = load_requests(cfg)
    t0 = time.perf_counter()
    per_edge = args.capacity_per_edge or capacity(cfg, reqs, 2, cfg.seed)["rate"] / 2
    print(f"capacity per edge {per_edge:.3f} req/s ({time.perf_counter() - t0:.1f} s to find)", flush=True)
    rate = args.fraction * per_edge * args.edges
    seg = trace_segment(reqs, rate, args.seconds, 2)
    print(f"{args.edges} edges, {args.seconds:g} s of arrivals at {rate:.1f} req/s: {len(seg)} requests", flush=True)
    print("| mode | simulated s | requests | attainment | events | wall s | events/s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        t = time.perf_counter()
        r = simulate(cfg, mode, args.edges, [seg], [{"fraction": args.fraction}], cfg.seed)
        wall = time.perf_counter() - t
        pt = r["points"][0]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"| {mode} | {r['wall_s']:.0f} | {pt['requests']} | {pt['slo_attainment']:.3f} | {r['events']} | "
              f"{wall:.1f} | {r['events'] / wall:.0f} | {rss:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
