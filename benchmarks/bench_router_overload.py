"""Past capacity, does the router's admission pay? The same arrivals through three routers on the same edges.

    python benchmarks/bench_router_overload.py                          # tiny model, 2 edges, ~10 min
    python benchmarks/bench_router_overload.py --fractions 0.8,1.5,2 --seconds 30 --capacity 11.6

Serve-only edges of a collm-bench config (default configs/bench-load.yaml: the tiny model, 2
replicas pinned to a core each) with three routers in front of them at once:

* `slo+admission`: the slo rule, answering 429 when no edge's estimated TTFT meets the target;
* `slo`:           the slo rule, routing every request (routing.admission: false);
* `round_robin`:   the baseline.

Capacity is serve-only's under round robin, found as collm-bench finds it (or given). At each
load point (a fraction of it) the same trace segment is replayed through each router in turn
(the order rotates per point), and each router's goodput is reported with its 95% bootstrap
interval, with the paired ratio to round robin over the same requests. A refused request is a
miss, like a late one: admission wins only if it spares capacity for requests that can still
make their SLOs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import table  # noqa: E402

from collm.common.config import load_config  # noqa: E402
from collm.common.stats import ratio_ci  # noqa: E402
from collm.lab.bench import ModeRun, Workload, find_capacity, interrupt_on_signal, measure  # noqa: E402
from collm.lab.bench_config import BenchConfig  # noqa: E402
from collm.common.procs import BIN_DIR  # noqa: E402
from collm.lab.topology import free_port, wait_http  # noqa: E402

VARIANTS = {"slo+admission": {"policy": "slo", "admission": True},
            "slo": {"policy": "slo", "admission": False},
            "round_robin": {"policy": "round_robin"}}


def start_routers(run: ModeRun, margin: float) -> dict[str, str]:
    """One collm-router per variant in front of the run's edges; name -> URL."""
    urls = {}
    for name, routing in VARIANTS.items():
        routing = {**routing, "admission_margin": margin} if routing.get("admission") else routing
        port = free_port()
        cfg = {"api": {"host": "127.0.0.1", "port": port}, "routing": routing,
               "edges": [{"name": e.name, "url": run.urls[e.name]} for e in run.edges]}
        path = run.out / f"router-{name.replace('+', '-')}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run.group.spawn(f"router-{name.replace('+', '-')}", [str(BIN_DIR / "collm-router"), "--config", str(path)])
        urls[name] = f"http://127.0.0.1:{port}"
        wait_http(urls[name] + "/health", run.group, 60, f"router {name}")
    return urls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/bench-load.yaml", help="a collm-bench config (model, SLOs, trace)")
    p.add_argument("--fractions", default="0.8,1.5,2.0", help="load points as fractions of capacity")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each load point")
    p.add_argument("--capacity", type=float, help="serve-only capacity in req/s (default: measure it)")
    p.add_argument("--margin", type=float, default=1.0, help="routing.admission_margin of the admission router")
    p.add_argument("--out", default="runs/bench-router-overload")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # SIGTERM stops the edges and routers, like ^C
    fractions = [float(f) for f in args.fractions.split(",")]
    overrides = {"out": args.out, "modes": ["serve-only"]}
    if args.capacity:
        overrides["capacity"] = {"rate": args.capacity}
    cfg = load_config(BenchConfig, args.config, overrides)
    out = Path(cfg.out)
    work = Workload(cfg)
    run = ModeRun(cfg, "serve-only", out / "serve-only")
    results: dict = {"config": cfg.model_dump(mode="json"), "points": []}
    try:
        run.start()
        routers = start_routers(run, args.margin)
        time.sleep(cfg.warmup_s)
        with tqdm(total=len(fractions) * len(VARIANTS), desc="router-overload", unit="point", file=sys.stdout) as bar:
            if cfg.capacity.rate:
                capacity = cfg.capacity.rate
            else:
                run.router = routers["round_robin"]
                capacity = find_capacity(run, work, cfg, bar)["rate"]
            results["capacity"] = capacity
            bar.write(f"  capacity (serve-only, round robin): {capacity:.3f} req/s")
            for k, f in enumerate(fractions):
                plan = work.plan(work.segment(f * capacity, args.seconds, cfg.load.min_requests), run.model_id)
                names = list(VARIANTS)
                names = names[k % len(names):] + names[:k % len(names)]  # rotate who goes first
                met = {}
                for name in names:
                    run.router = routers[name]
                    pt = measure(run, plan, cfg, {"fraction": f, "router": name})
                    met[name] = pt["slo_met"]
                    refused = sum(1 for o in pt["outcomes"] if o["status"] == 429)
                    row = {k2: pt[k2] for k2 in ("fraction", "router", "rate", "requests", "slo_attainment",
                                                   "attainment_ci", "goodput_rps", "goodput_ci", "ttft_p50",
                                                   "ttft_p90")}
                    results["points"].append({**row, "refused": refused, "point": k})
                    bar.write(f"  {f:g}x {name}: goodput {pt['goodput_rps']:.2f} req/s "
                              f"[{pt['goodput_ci'][0]:.2f}, {pt['goodput_ci'][1]:.2f}], attainment "
                              f"{pt['slo_attainment']:.3f}, refused {refused}/{pt['requests']}")
                    bar.update(1)
                    time.sleep(cfg.load.drain_s)
                for name in ("slo+admission", "slo"):
                    r, lo, hi = ratio_ci(met[name], met["round_robin"], resamples=cfg.bootstrap)
                    pt = next(q for q in results["points"] if q["point"] == k and q["router"] == name)
                    pt["vs_round_robin"] = [r, lo, hi]
                r, lo, hi = ratio_ci(met["slo+admission"], met["slo"], resamples=cfg.bootstrap)
                next(q for q in results["points"] if q["point"] == k and q["router"] == "slo+admission")[
                    "vs_slo"] = [r, lo, hi]
    finally:
        run.stop()
    (out / "results.json").write_text(json.dumps(results, indent=1))

    def ci(v):
        return "-" if not v or v[0] is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"

    print(table(["load", "router", "req", "attainment", "goodput (req/s)", "refused", "vs round robin",
                 "vs slo"],
                [[f"{q['fraction']:g}x", q["router"], q["requests"], f"{q['slo_attainment']:.3f}",
                  f"{q['goodput_rps']:.2f} [{q['goodput_ci'][0]:.2f}, {q['goodput_ci'][1]:.2f}]", q["refused"],
                  ci(q.get("vs_round_robin")), ci(q.get("vs_slo"))] for q in results["points"]]))
    print(f"capacity {results['capacity']:.3f} req/s; results {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
