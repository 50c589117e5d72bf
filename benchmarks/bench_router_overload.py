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

`--edges default,no-shed` starts a second set of edges (here with `engine.shed_late: false`) beside
the first (an idle set costs nothing) and replays every point through both, interleaved, so an
edge setting's effect is measured in the same run; the capacity is measured on the first set.
Each row counts why requests missed: refused (429), late first token, or slow tokens after it.

Admission's own accuracy, in the same run and on the same requests: the `slo` router routes every
request but still says what admission would have judged (X-CoLLM-Soonest-TTFT), so the script
replays the test at each `--check-margins` value: how many requests admission would have refused,
how many of those met their SLO anyway (refused wrongly), and how many of the misses it would
have caught. That separates "admission refuses requests that would have made it" from the noise
between two replays of the same arrivals.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import table  # noqa: E402

from collm.common.config import deep_merge, load_config  # noqa: E402
from collm.common.stats import ratio_ci  # noqa: E402
from collm.lab.bench import find_capacity, interrupt_on_signal, measure  # noqa: E402
from collm.lab.bench_workload import Workload  # noqa: E402
from collm.lab.bench_topology import ModeRun  # noqa: E402
from collm.lab.bench_config import BenchConfig  # noqa: E402
from collm.lab.topology import start_router  # noqa: E402

EDGE_VARIANTS = {"default": {},  # the edges as they ship
                 "no-shed": {"engine": {"shed_late": False}}}  # edges that serve every request, however late
VARIANTS = {"slo+admission": {"policy": "slo", "admission": True},
            "slo": {"policy": "slo", "admission": False},
            "round_robin": {"policy": "round_robin"}}


def start_routers(run: ModeRun, margin: float, tag: str = "") -> dict[str, str]:
    """One collm-router per variant in front of the run's edges; name -> URL."""
    urls = {}
    for name, routing in VARIANTS.items():
        routing = ({**routing, "admission_margin": margin, "admission_margin_max": None}  # a fixed margin
                   if routing.get("admission") else routing)
        urls[name] = start_router(run.group, run.out, {e.name: run.urls[e.name] for e in run.edges},
                                  {"routing": routing}, what=f"router {name}",
                                  label=f"router-{tag}{name.replace('+', '-')}")
    return urls


def cpu_seconds(runs: dict) -> dict[str, float]:
    """CPU seconds used so far by the edges, the routers and this process (the load generator): on 2
    shared cores the harness competes with the edges it measures, so each point says how much it took."""
    import psutil

    out = {"edges": 0.0, "routers": 0.0, "loadgen": 0.0}
    for run in runs.values():
        for name, proc in run.group.procs:
            try:
                t = psutil.Process(proc.pid).cpu_times()
            except psutil.Error:
                continue
            out["routers" if name.startswith("router") else "edges"] += t.user + t.system
    me = psutil.Process().cpu_times()
    out["loadgen"] = me.user + me.system
    return out


def slowdowns(results: dict, runs: dict) -> None:
    """Per point, how much slower the edges' serving steps were than their median step of the same shape
    over the whole run (`timeline_report`): a point far above 1 ran on a machine slowed by something
    outside the point (another tenant, the harness), and a comparison with it is weak."""
    from timeline_report import ReplicaTimeline

    from collm.edge_client.engine.timeline import read_timeline

    for e, run in runs.items():
        tls = [ReplicaTimeline(read_timeline(p)) for p in sorted(run.out.glob("timeline-*.jsonl"))]  # this run's
        for q in results["points"]:
            if q["edges"] == e and tls:
                ratios = [tl.split(q["started_at"], q["ended_at"])["slowdown"] for tl in tls]
                q["step_slowdown"] = max((r for r in ratios if r), default=None)


PAIRS = (("slo+admission", "round_robin"), ("slo+admission", "slo"), ("slo", "round_robin"))


def pooled(results: dict, max_slowdown: float, resamples: int) -> list[dict]:
    """Each load fraction's repeats (`--fractions 1.5,2,1.5,2`) together: per router pair, the goodput
    ratio over the requests of every kept repeat (paired bootstrap over requests; the same arrival in
    both), and each repeat's own ratio. A repeat is kept only if none of its slots ran on a slowed
    machine (step slowdown <= max_slowdown), for every router alike, so the filter favours none."""
    out = []
    for e in results["edges"]:
        pts = [q for q in results["points"] if q["edges"] == e]
        for f in sorted({q["fraction"] for q in pts}):
            reps = sorted({q["point"] for q in pts if q["fraction"] == f})
            slot = {(q["point"], q["router"]): q for q in pts if q["fraction"] == f}
            kept = [k for k in reps if all((slot[k, r].get("step_slowdown") or 1.0) <= max_slowdown
                                           for r in VARIANTS)]
            for a, b in PAIRS:
                each = [sum(slot[k, a]["slo_met"]) / sum(slot[k, b]["slo_met"]) if sum(slot[k, b]["slo_met"]) else None
                        for k in reps]
                met_a = [m for k in kept for m in slot[k, a]["slo_met"]]
                met_b = [m for k in kept for m in slot[k, b]["slo_met"]]
                out.append({"fraction": f, "edges": e, "pair": f"{a} / {b}", "repeats": reps, "kept": kept,
                            "ratio": list(ratio_ci(met_a, met_b, resamples=resamples)), "per_repeat": each})
    return out


def misses(outcomes: list[dict]) -> dict[str, int]:
    """Why requests missed (`common.slo.slo_miss`, the bench's `miss` field), refusals (429) apart."""
    out = {"refused": 0, "ttft": 0, "tpot": 0, "failed": 0}
    for o in outcomes:
        if o["status"] == 429:
            out["refused"] += 1
        elif o["miss"]:
            out[o["miss"]] += 1
    return out


def would_refuse(outcomes: list[dict], target_s: float, margins: list[float]) -> dict[str, dict[str, int]]:
    """Admission's test replayed on a router that routed everything (the `slo` variant): per margin m,
    how many requests had a soonest-edge TTFT estimate (X-CoLLM-Soonest-TTFT) past m x target, how
    many of those still met their SLO (what admission at m would have refused wrongly), and how many
    of all misses it would have caught. Same requests, same run: no noise between variants."""
    seen = [o for o in outcomes if o.get("soonest_ttft_s") is not None]
    out = {}
    for m in margins:
        flagged = [o for o in seen if o["soonest_ttft_s"] > m * target_s]
        out[f"{m:g}"] = {"estimated": len(seen), "would_refuse": len(flagged),
                         "met_anyway": sum(1 for o in flagged if not o["miss"]),
                         "missed": sum(1 for o in seen if o["miss"]),
                         "misses_caught": sum(1 for o in flagged if o["miss"])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/bench-load.yaml", help="a collm-bench config (model, SLOs, trace)")
    p.add_argument("--fractions", default="0.8,1.5,2.0", help="load points as fractions of capacity")
    p.add_argument("--seconds", type=float, default=30.0, help="length of each load point")
    p.add_argument("--capacity", type=float, help="serve-only capacity in req/s (default: measure it)")
    p.add_argument("--margin", type=float, default=1.0, help="routing.admission_margin of the admission router")
    p.add_argument("--check-margins", default="1.0,1.25,1.5,2.0",
                   help="margins at which to replay admission's test on the slo router's requests")
    p.add_argument("--edges", default="default", help=f"edge variants, comma-separated, of {sorted(EDGE_VARIANTS)}")
    p.add_argument("--max-slowdown", type=float, default=1.25,
                   help="pool a load point's repeats only where every slot's step slowdown is at most this")
    p.add_argument("--out", default="runs/bench-router-overload")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # SIGTERM stops the edges and routers, like ^C
    fractions = [float(f) for f in args.fractions.split(",")]
    check_margins = [float(m) for m in args.check_margins.split(",") if m.strip()]
    edge_names = [e.strip() for e in args.edges.split(",") if e.strip()]
    unknown = sorted(set(edge_names) - set(EDGE_VARIANTS))
    if unknown or not edge_names:
        p.error(f"--edges: unknown variant(s) {unknown}; choose from {sorted(EDGE_VARIANTS)}")
    try:
        import psutil  # noqa: F401  (cpu_seconds; checked now, not after the capacity search)
    except ImportError:
        p.error("needs psutil for the per-slot CPU accounting: pip install -e '.[test]' (or pip install psutil)")
    # timelines on, whatever the config says (the step slowdown that decides which repeats pool is read
    # from them); load.seconds = --seconds, so capacity probes are as long as the points, as in collm-bench
    overrides = {"out": args.out, "modes": ["serve-only"], "timeline": True, "load": {"seconds": args.seconds}}
    if args.capacity:
        overrides["capacity"] = {"rate": args.capacity}
    cfg = load_config(BenchConfig, args.config, overrides)
    out = Path(cfg.out)
    work = Workload(cfg)
    runs = {e: ModeRun(cfg.model_copy(update={"edge": deep_merge(cfg.edge, EDGE_VARIANTS[e])}), "serve-only",
                       out / f"serve-only-{e}") for e in edge_names}
    results: dict = {"config": cfg.model_dump(mode="json"), "edges": edge_names, "points": []}
    combos = [(e, r) for e in edge_names for r in VARIANTS]
    for run in runs.values():  # an earlier run's timelines in the same --out would blur this run's step medians
        for old in run.out.glob("timeline-*.jsonl"):
            old.unlink()
    try:
        routers = {}
        for e, run in runs.items():
            run.start()
            routers[e] = start_routers(run, args.margin, f"{e}-")
        time.sleep(cfg.warmup_s)
        first = runs[edge_names[0]]
        with tqdm(total=len(fractions) * len(combos), desc="router-overload", unit="point", file=sys.stdout) as bar:
            if cfg.capacity.rate:
                capacity = cfg.capacity.rate
            else:
                first.router = routers[edge_names[0]]["round_robin"]
                capacity = find_capacity(first, work, cfg, bar)["rate"]
            results["capacity"] = capacity
            bar.write(f"  capacity (serve-only, {edge_names[0]} edges, round robin): {capacity:.3f} req/s")
            for k, f in enumerate(fractions):
                plan = work.plan(work.segment(f * capacity, cfg.load.seconds, cfg.load.min_requests), first.model_id)
                order = combos[k % len(combos):] + combos[:k % len(combos)]  # rotate who goes first
                met = {}
                for e, name in order:
                    run = runs[e]
                    run.router = routers[e][name]
                    cpu0 = cpu_seconds(runs)
                    pt = measure(run, plan, cfg, {"fraction": f, "router": name, "edges": e})
                    cpu = {k: round(v - cpu0[k], 2) for k, v in cpu_seconds(runs).items()}
                    met[e, name] = pt["slo_met"]
                    why = misses(pt["outcomes"])
                    row = {k2: pt[k2] for k2 in ("fraction", "router", "edges", "rate", "requests", "slo_attainment",
                                                   "attainment_ci", "goodput_rps", "goodput_ci", "ttft_p50",
                                                   "ttft_p90", "tpot_p50", "tpot_p90", "started_at", "ended_at")}
                    check = would_refuse(pt["outcomes"], cfg.ttft_ms / 1000, check_margins) if name == "slo" else None
                    results["points"].append({**row, "refused": why["refused"], "misses": why, "point": k,
                                              "slo_met": pt["slo_met"],
                                              "would_refuse": check, "outcomes": pt["outcomes"], "cpu_s": cpu})
                    bar.write(f"  {f:g}x {e} {name}: goodput {pt['goodput_rps']:.2f} req/s "
                              f"[{pt['goodput_ci'][0]:.2f}, {pt['goodput_ci'][1]:.2f}], attainment "
                              f"{pt['slo_attainment']:.3f}, refused {why['refused']}/{pt['requests']}, late TTFT {why['ttft']}, "
                              f"slow TPOT {why['tpot']}; CPU s edges {cpu['edges']:.1f}, routers {cpu['routers']:.1f}, "
                              f"load generator {cpu['loadgen']:.1f}")
                    bar.update(1)
                    time.sleep(cfg.load.drain_s)

                def row_of(e, name):
                    return next(q for q in results["points"] if q["point"] == k and q["router"] == name
                                and q["edges"] == e)

                for e in edge_names:
                    for name in ("slo+admission", "slo"):
                        row_of(e, name)["vs_round_robin"] = list(ratio_ci(met[e, name], met[e, "round_robin"],
                                                                          resamples=cfg.bootstrap))
                    row_of(e, "slo+admission")["vs_slo"] = list(ratio_ci(met[e, "slo+admission"], met[e, "slo"],
                                                                         resamples=cfg.bootstrap))
                    if e != edge_names[0]:
                        for name in VARIANTS:
                            row_of(edge_names[0], name)[f"vs_{e}"] = list(ratio_ci(
                                met[edge_names[0], name], met[e, name], resamples=cfg.bootstrap))
    finally:
        for run in runs.values():
            run.stop()
    slowdowns(results, runs)
    (out / "results.json").write_text(json.dumps(results, indent=1))

    def ci(v):
        return "-" if not v or v[0] is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"

    others = edge_names[1:]
    print(table(["load", "edges", "router", "req", "attainment", "goodput (req/s)", "refused", "late TTFT",
                 "slow TPOT", "step slowdown", "vs round robin", "vs slo"] + [f"vs {e}" for e in others],
                [[f"{q['fraction']:g}x", q["edges"], q["router"], q["requests"], f"{q['slo_attainment']:.3f}",
                  f"{q['goodput_rps']:.2f} [{q['goodput_ci'][0]:.2f}, {q['goodput_ci'][1]:.2f}]", q["refused"],
                  q["misses"]["ttft"], q["misses"]["tpot"],
                  "-" if q.get("step_slowdown") is None else f"{q['step_slowdown']:.2f}",
                  ci(q.get("vs_round_robin")), ci(q.get("vs_slo"))]
                 + [ci(q.get(f"vs_{e}")) for e in others] for q in results["points"]]))
    checked = [q for q in results["points"] if q.get("would_refuse")]
    if checked:
        print("\nAdmission's test replayed on the slo router's requests (it routed them all): would refuse "
              "at margin m / of those, met the SLO anyway / of all misses, caught")
        print(table(["load", "edges", "req", "missed"] + [f"m = {m:g}" for m in check_margins],
                    [[f"{q['fraction']:g}x", q["edges"], q["requests"], q["misses"]["ttft"] + q["misses"]["tpot"]
                      + q["misses"]["failed"] + q["refused"]]
                     + [f"{c['would_refuse']} / {c['met_anyway']} / {c['misses_caught']}"
                        for c in q["would_refuse"].values()] for q in checked]))
    results["pooled"] = pooled(results, args.max_slowdown, cfg.bootstrap)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if any(len(r["repeats"]) > 1 for r in results["pooled"]):
        print(f"\nRepeats pooled per load point (slots with step slowdown > {args.max_slowdown:g} drop their repeat "
              "for every router): goodput ratio over all kept requests, paired [95% CI over requests: it leaves out "
              "the spread between repeats, which the per-repeat ratios show], and each repeat's ratio")
        print(table(["load", "edges", "ratio", "kept / repeats", "pooled", "per repeat"],
                    [[f"{r['fraction']:g}x", r["edges"], r["pair"], f"{len(r['kept'])} / {len(r['repeats'])}",
                      ci(r["ratio"]), ", ".join("-" if v is None else f"{v:.2f}" for v in r["per_repeat"])]
                     for r in results["pooled"]]))
    print(f"capacity {results['capacity']:.3f} req/s; results {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
