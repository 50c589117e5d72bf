"""How long one routing decision takes, by fleet size: the router's own `choose` on synthetic edge views.

    python benchmarks/bench_router_decisions.py                 # 10, 100, 1000 edges, 2000 decisions each
    python benchmarks/bench_router_decisions.py --edges 10,100,1000,5000 --decisions 5000

Each decision is what `Router.pick` asks of `collm.router.policy.choose` for one request: every
routable edge's view (a random but plausible scrape: queue, running batch, cost coefficients,
training load), the request, the policy. It prints p50/p99 per fleet size and policy, and the
ratio of the p99 at the largest fleet to the smallest (linear work gives about their size ratio).
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
from collm.router.policy import Assumptions, EdgeView, RequestView, choose  # noqa: E402


def views(n: int, rng: random.Random) -> list[EdgeView]:
    out = []
    for i in range(n):
        running = rng.randint(0, 8)
        out.append(EdgeView(
            f"edge{i}", outstanding=rng.randint(0, 4), outstanding_at_scrape=rng.randint(0, 4),
            queue_depth=float(rng.choice([0, 0, 0, 1, 3])), running=float(running), max_running=8.0,
            step_coef=(0.01 + rng.random() * 0.01, 0.002, 2e-5, 0.001), ttft_target_s=2.0, tpot_target_s=0.2,
            training_active=rng.random() < 0.5, training_busy=rng.random() * 0.5, spare_capacity=rng.random(),
            finish_rate=rng.random() * 2, unused_s=rng.random() * 3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", default="10,100,1000")
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.edges.split(",")]
    rng = random.Random(args.seed)
    a = Assumptions()
    rows, p99 = [], {}
    for policy in ("slo", "round_robin", "least_outstanding"):
        for n in sizes:
            fleet = views(n, rng)
            times = []
            for i in range(args.decisions):
                x = RequestView(rng.randint(20, 400), rng.randint(8, 128), rng.choice([None, 1.0, 3.0]), None)
                t0 = time.perf_counter()
                choose(policy, fleet, x, rng, i, a)
                times.append(time.perf_counter() - t0)
            p99[(policy, n)] = percentile(times, 0.99)
            rows.append([policy, n, f"{1000 * statistics.median(times):.3f}", f"{1000 * p99[(policy, n)]:.3f}"])
    print(table(["policy", "edges", "decision p50 (ms)", "p99 (ms)"], rows))
    lo, hi = sizes[0], sizes[-1]
    print(f"slo policy: p99 at {hi} edges / at {lo} edges = {p99[('slo', hi)] / p99[('slo', lo)]:.1f}x "
          f"(fleet {hi / lo:.0f}x larger)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
