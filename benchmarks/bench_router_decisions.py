"""How long one routing decision takes, by fleet size: the router's own decision path on synthetic edges.

    python benchmarks/bench_router_decisions.py                 # 10, 100, 1000 edges, 2000 decisions each
    python benchmarks/bench_router_decisions.py --edges 10,100,1000,5000 --decisions 5000

Two paths per policy: `router` is what `Router.pick` runs per request (the healthy pool, the
FleetTable's columns with each edge's live counts, `collm.router.fleet.choose`); `reference` is
`collm.router.policy.choose` over one EdgeView per edge (the readable rule the router's columnar one
is tested against). The edges have random but plausible scrapes (queue, running batch, cost
coefficients, training load); between decisions the scrapes that polling brings at --rate requests
per second arrive (health.max_polls_per_s bounds them). It prints p50/p99 per fleet size, policy
and path, and the p99 ratio between the largest and the smallest fleet.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import table  # noqa: E402

from collm.common.stats import percentile  # noqa: E402
from collm.router.app import Router  # noqa: E402
from collm.router.config import RouterConfig  # noqa: E402
from collm.router.policy import POLICIES, RequestView, choose  # noqa: E402
from collm.router.state import Scrape  # noqa: E402


def scrape(rng: random.Random, at: float) -> Scrape:
    return Scrape(at=at, outstanding_at=rng.randint(0, 4), queue_depth=float(rng.choice([0, 0, 0, 1, 3])),
                  running=float(rng.randint(0, 8)), max_running=8.0,
                  step_coef=(0.01 + rng.random() * 0.01, 0.002, 2e-5, 0.001), ttft_target_s=2.0, tpot_target_s=0.2,
                  training_active=rng.random() < 0.5, training_busy=rng.random() * 0.5,
                  spare_capacity=rng.random(), finish_rate=rng.random() * 2, step_token_budget=256.0,
                  slo_safety=0.8)


def fleet_of(n: int, rng: random.Random) -> Router:
    cfg = RouterConfig(edges=[{"name": f"edge{i}", "url": f"http://10.0.{i // 250}.{i % 250}:8000"}
                              for i in range(n)])
    router = Router(cfg)
    now = time.monotonic()
    for e in router.edges:
        e.healthy, e.outstanding, e.scrape = True, rng.randint(0, 4), scrape(rng, now)
    return router


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", default="10,100,1000")
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=1000.0,
                   help="requests per second the fleet routes: how many new scrapes arrive between decisions")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.edges.split(",")]
    rng = random.Random(args.seed)
    rows, p99 = [], {}
    for policy in POLICIES:
        for n in sizes:
            router = fleet_of(n, rng)
            router.cfg.routing.policy = policy
            a = router.assumptions()
            times = {"router": [], "reference": []}
            h, pending = router.cfg.health, 0.0
            for i in range(args.decisions):
                pending += min(n / h.interval_s, h.max_polls_per_s) / args.rate  # polls land between decisions
                while pending >= 1:
                    rng.choice(router.edges).scrape = scrape(rng, time.monotonic())
                    pending -= 1
                x = RequestView(rng.randint(20, 400), rng.randint(8, 128), rng.choice([None, 1.0, 3.0]), None)
                t0 = time.perf_counter()
                router.pick(x, exclude=[])
                times["router"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                now = time.monotonic()
                views = [e.view(router.cfg.routing, router.cfg.health.stale_after_s, now) for e in router.edges]
                choose(policy, views, x, rng, i, a)
                times["reference"].append(time.perf_counter() - t0)
            for path, ts in times.items():
                p99[(policy, path, n)] = percentile(ts, 0.99)
                rows.append([policy, path, n, f"{1000 * statistics.median(ts):.3f}",
                             f"{1000 * p99[(policy, path, n)]:.3f}"])
    print(table(["policy", "path", "edges", "decision p50 (ms)", "p99 (ms)"], rows))
    lo, hi = sizes[0], sizes[-1]
    for path in ("router", "reference"):
        print(f"slo policy, {path}: p99 at {hi} edges / at {lo} edges = "
              f"{p99[('slo', path, hi)] / p99[('slo', path, lo)]:.1f}x (fleet {hi / lo:.0f}x larger)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
