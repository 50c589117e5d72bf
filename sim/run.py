"""`collm-sim --config sim.yaml`: collm-bench's experiment on a simulated fleet of 2-1,000 edges.

The run, as collm-bench runs it (lab/bench.py): serve-only's capacity C first (the same search,
`search_capacity`, over simulated probes), then load points `fraction x C`, each a segment of the
trace at that mean rate (`TraceConfig.segment`, bursts kept), every mode replaying the same arrivals;
per point attainment, goodput, latency percentiles (`summarize`, the bench's) and training tokens/s,
with bootstrap intervals; ratios between modes paired over the same requests (`write_report`, the
bench's report). Then, with `sweep`, the same at every fleet size, and the fleet each mode needs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from collm.common.errors import cli_entry
from collm.common.stats import mean_ci, ratio_ci
from collm.lab.bench_analysis import max_sustained_rate, search_capacity, window_span
from collm.lab.loadgen import Outcome, summarize
from collm.sim.config import SimConfig
from collm.sim.profile import load_profile
from collm.sim.world import World, fleet_profiles


def load_requests(cfg: SimConfig):
    return cfg.trace.load()


def point_result(world: World, reqs, span: dict, label: dict, resamples: int) -> dict:
    """One load point's numbers, shaped as collm-bench's `measure` shapes them."""
    ttft_slo, tpot_slo = world.slo.ttft_s, world.slo.tpot_s
    by_index = {s.index: s for s in world.out if s.point == label["_point"]}
    outcomes = []
    for i, r in enumerate(reqs):
        s = by_index.get(i)
        if s is None or s.status != "length":
            status = 429 if s is not None and s.status in ("refused", "expired") else "unfinished"
            outcomes.append(Outcome(str(i), r.arrival_s, status, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo))
        else:
            e2e = s.ttft_s + s.tpot_s * max(r.output_tokens - 1, 0)
            outcomes.append(Outcome(str(i), r.arrival_s, 200, s.ttft_s, s.tpot_s, e2e, r.output_tokens, "length",
                                    s.version, str(s.edge), ttft_slo, tpot_slo))
    window = window_span(reqs[-1].arrival_s, len(reqs))
    summary = summarize(outcomes, window)
    met = [1.0 if o.slo_met else 0.0 for o in outcomes]
    att, lo, hi = mean_ci(met, resamples=resamples)
    n = len(outcomes)
    seconds = max(span["end"] - span["start"], 1e-9)
    label = {k: v for k, v in label.items() if k != "_point"}
    return {**label, "rate": n / window, "window_s": window, **summary, "attainment_ci": [lo, hi],
            "goodput_ci": [lo * n / window, hi * n / window], "train_tokens": span["train_tokens"],
            "train_tokens_per_s": span["train_tokens"] / seconds, "slo_met": met,
            "refused": sum(1 for s in by_index.values() if s.status == "refused"),
            "expired": sum(1 for s in by_index.values() if s.status == "expired")}


def simulate(cfg: SimConfig, mode: str, n_edges: int, point_reqs: list, labels: list[dict], seed: int) -> dict:
    """One mode on `n_edges` edges over the given load points (one World, points back to back)."""
    profiles = fleet_profiles(cfg, n_edges, load_profile)
    world = World(cfg, mode, profiles, seed)
    t0 = time.perf_counter()
    spans = world.run(point_reqs, cfg.warmup_s, cfg.load.drain_s)["spans"]
    points = [point_result(world, reqs, span, {**label, "_point": i}, cfg.bootstrap)
              for i, (reqs, span, label) in enumerate(zip(point_reqs, spans, labels))]
    first = spans[0]["start"] if spans else 0.0
    served = [{"t": max(t - first, 0.0) if v else 0.0, "round": v, "loss": loss} for t, v, loss in world.losses]
    return {"mode": mode, "replicas": n_edges, "points": points,
            "rounds_completed": sum(1 for r in world.rounds if r.aggregated_at is not None),
            "served_loss": served, "final_loss": served[-1]["loss"], "startup_s": 0.0,
            "wall_s": round((spans[-1]["end"] - first) if spans else 0.0, 1),
            "sim_seconds": round(time.perf_counter() - t0, 2), "events": world.seq,
            "versions_served": sorted({s.version for s in world.out if s.version >= 0})}


def _seconds(seconds: float, rate: float, max_requests: int | None) -> float:
    """A point's or probe's seconds of arrivals, shortened so it holds at most `max_requests`."""
    return min(seconds, max_requests / rate) if max_requests else seconds


def for_fleet(cfg: SimConfig, n_edges: int) -> SimConfig:
    """`cfg` on `n_edges` edges with the same training budget per edge (federation.round_token_budget
    is the budget of `cfg.edges` edges)."""
    if n_edges == cfg.edges:
        return cfg
    f = cfg.federation
    return cfg.model_copy(update={"federation": f.model_copy(update={
        "round_token_budget": max(1, round(f.round_token_budget * n_edges / cfg.edges))})})


def capacity(cfg: SimConfig, reqs, n_edges: int, seed: int, max_requests: int | None = None) -> dict:
    c = cfg.capacity
    if c.rate:
        return {"rate": c.rate * n_edges / cfg.edges, "note": "fixed in the config (scaled to the fleet)",
                "probes": [], "target_attainment": c.target_attainment}
    scale = n_edges / 2  # start near a 2-edge fleet's capacity times the fleet's size
    c = c.model_copy(update={"start_rate": c.start_rate * scale})
    n = [0]

    def probe(rate: float) -> dict:
        n[0] += 1
        seg = cfg.trace.segment(reqs, rate, _seconds(c.probe_s or cfg.load.seconds, rate, max_requests),
                            c.min_requests or cfg.load.min_requests)
        r = simulate(cfg, "serve-only", n_edges, [seg], [{"probe": n[0]}], seed + 1000 * n[0])
        return {k: v for k, v in r["points"][0].items() if k != "slo_met"}

    return search_capacity(probe, c)


def run_fleet(cfg: SimConfig, n_edges: int, seed: int, bar=None, max_requests: int | None = None) -> dict:
    """collm-bench's whole experiment at one fleet size; bench-shaped results. `max_requests`: at most
    this many requests per probe and point (large fleets: a shorter stretch of arrivals)."""
    reqs = load_requests(cfg)
    t0 = time.perf_counter()
    cfg = for_fleet(cfg, n_edges)
    cap = capacity(cfg, reqs, n_edges, seed, max_requests)
    fractions = cfg.load.fractions
    point_reqs = [cfg.trace.segment(reqs, f * cap["rate"], _seconds(cfg.load.seconds, f * cap["rate"], max_requests),
                                    cfg.load.min_requests) for f in fractions]
    modes = ["serve-only"] + [m for m in cfg.modes if m != "serve-only"]
    results = {"modes": {}}
    for mode in modes:
        r = simulate(cfg, mode, n_edges, point_reqs, [{"fraction": f} for f in fractions], seed)
        r["max_rate"] = max_sustained_rate(r["points"], cfg.capacity.target_attainment)
        results["modes"][mode] = r
        if bar is not None:
            bar.update(1)
            bar.write(f"  {n_edges} edges, {mode}: " + ", ".join(
                f"{p['fraction']:g}x att {p['slo_attainment']:.3f} train {p['train_tokens_per_s']:.0f} tok/s"
                for p in r["points"]) + f" ({r['sim_seconds']:.1f} s, {r['events']} events)")
    results["capacity"] = cap
    results["base_loss"] = cfg.quality.loss(0.0)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    results["config"] = bench_shaped_config(cfg, n_edges)
    return results


def device_label(d) -> str:
    """`smollm2-cpu1 x4 nf4 r16 @20Mbps`: what differs from the profile as measured."""
    return (d.profile + (f" x{d.speed:g}" if d.speed != 1 else "") + (f" {d.precision}" if d.precision != "none" else "")
            + (f" r{d.lora_r}" if d.lora_r != 8 else "") + (f" @{d.uplink_mbps:g}Mbps" if d.uplink_mbps else ""))


def bench_shaped_config(cfg: SimConfig, n_edges: int) -> dict:
    d = cfg.model_dump(mode="json")
    d.update(model=" + ".join(device_label(x) for x in cfg.devices), replicas=n_edges)
    return d


def sweep_table(cfg: SimConfig, bar) -> list[dict]:
    """goodput collm/isolated (and the other ratios) at every fleet size and load, paired 95% CIs."""
    rows = []
    for n in cfg.sweep.fleet_sizes:
        for s in range(cfg.sweep.seeds):
            sub = cfg.model_copy(update={"load": cfg.load.model_copy(update={"fractions": cfg.sweep.fractions})})
            res = run_fleet(sub, n, cfg.seed + 7919 * s, bar, cfg.sweep.max_requests)
            modes = res["modes"]
            for i, f in enumerate(cfg.sweep.fractions):
                row = {"edges": n, "seed": s, "fraction": f, "capacity_rps": res["capacity"]["rate"],
                       "window_s": res["modes"]["collm"]["points"][i]["window_s"] if "collm" in modes else None}
                for m, r in modes.items():
                    p = r["points"][i]
                    row[m] = {"attainment": p["slo_attainment"], "goodput": p["goodput_rps"],
                              "train_tokens_per_s": p["train_tokens_per_s"], "requests": p["requests"]}
                for other in ("isolated", "colocated-naive", "serve-only"):
                    if "collm" in modes and other in modes:
                        r, lo, hi = ratio_ci(modes["collm"]["points"][i]["slo_met"],
                                             modes[other]["points"][i]["slo_met"], resamples=cfg.bootstrap)
                        row[f"collm/{other}"] = [r, lo, hi]
                rows.append(row)
    return rows


def fleet_needed(cfg: SimConfig, rate: float, bar) -> dict:
    """Per mode: the smallest even fleet whose attainment at `rate` req/s is at least the target."""
    reqs = load_requests(cfg)
    seg = cfg.trace.segment(reqs, rate, cfg.load.seconds, cfg.load.min_requests)
    target = cfg.capacity.target_attainment
    out = {}
    for mode in cfg.modes:
        def ok(n: int) -> bool:
            r = simulate(for_fleet(cfg, n), mode, n, [seg], [{"fraction": 0}], cfg.seed)
            return r["points"][0]["slo_attainment"] >= target

        lo, hi = 2, 2
        while not ok(hi):
            lo, hi = hi, hi * 2
            if hi > 4096:
                hi = None
                break
        if hi is None:
            out[mode] = None
            continue
        while hi - lo > 2:
            mid = (lo + hi) // 2 // 2 * 2
            if mid in (lo, hi):
                break
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        out[mode] = hi
        if bar is not None:
            bar.write(f"  {mode}: {hi} edges meet {target:.0%} attainment at {rate:g} req/s")
    return out


def profile_bench_edge(bench_yaml: str, out: str, reps: int, alone: bool = False) -> int:
    """Measure the edges collm-bench BENCH.yaml runs in its collm mode (same model, threads, cores,
    engine settings) with `collm-edge --profile`, every replica at once (they share the machine's
    memory bandwidth in the bench, and a step costs more beside a busy neighbour); `alone`: only
    replica 0, the others idle. Writes replica 0's profile to `out`."""
    import subprocess
    import tempfile

    from collm.common.config import check_writable_file, load_config
    from collm.common.procs import BIN_DIR
    from collm.lab.bench_topology import ModeRun
    from collm.lab.bench_config import BenchConfig
    from collm.lab.topology import write_config

    bench = load_config(BenchConfig, bench_yaml)
    target = check_writable_file(out, "--profile-bench OUT.json").resolve()
    with tempfile.TemporaryDirectory(prefix="collm-profile-") as tmp:
        edges = ModeRun(bench, "collm", Path(tmp)).edges
        procs = []
        for i, edge in enumerate(edges[:1] if alone else edges):
            path = write_config(Path(tmp) / f"edge{i}.yaml", edge)
            dest = target if i == 0 else Path(tmp) / f"profile{i}.json"
            procs.append(subprocess.Popen([str(BIN_DIR / "collm-edge"), "--config", str(path), "--profile", str(dest),
                                           "--profile-reps", str(reps)]))
        codes = [p.wait() for p in procs]
    if any(codes):
        return max(codes)
    d = json.loads(target.read_text())
    d["measured_beside"] = 0 if alone else len(edges) - 1  # replicas profiling at the same time
    target.write_text(json.dumps(d, indent=1) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-sim", description="Simulate collm-bench's modes on a fleet of edges "
                                "(profiles measured with `collm-edge --profile`), with CoLLM's own policy code.")
    p.add_argument("--config", default="configs/sim.yaml")
    p.add_argument("--out", help="override `out`")
    p.add_argument("--edges", type=int, help="override `edges`")
    p.add_argument("--no-sweep", action="store_true", help="skip the config's sweep")
    p.add_argument("--profile-bench", nargs=2, metavar=("BENCH.yaml", "OUT.json"),
                   help="measure a profile of the edge that collm-bench BENCH.yaml runs (replica 0) and exit")
    p.add_argument("--profile-reps", type=int, default=5)
    p.add_argument("--alone", action="store_true", help="with --profile-bench: profile replica 0 with the others idle")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from collm.common.config import check_writable_dir, load_config
    from collm.lab.bench_report import write_report
    from collm.lab.topology import config_path

    args = build_parser().parse_args(argv)
    if args.profile_bench:
        return profile_bench_edge(*args.profile_bench, args.profile_reps, args.alone)
    over = {k: v for k, v in (("out", args.out), ("edges", args.edges)) if v is not None}
    cfg = load_config(SimConfig, config_path(args.config), over or None)
    out = check_writable_dir(cfg.out, "out")  # before the run, not when its report is written
    t0 = time.perf_counter()
    sweep = cfg.sweep if not args.no_sweep else None
    total = len(cfg.modes) + (1 if "serve-only" not in cfg.modes else 0)
    steps = total * (1 + (len(sweep.fleet_sizes) * sweep.seeds if sweep else 0))
    print(f"collm-sim: {cfg.edges} edges of {bench_shaped_config(cfg, cfg.edges)['model']}, modes "
          f"{', '.join(cfg.modes)}, load points {cfg.load.fractions} x capacity; writing to {out}", flush=True)
    with tqdm(total=steps, desc="collm-sim", unit="mode", file=sys.stdout, dynamic_ncols=True) as bar:
        results = run_fleet(cfg, cfg.edges, cfg.seed, bar)
        results["simulated"] = True
        if sweep:
            results["sweep"] = sweep_table(cfg, bar)
            if sweep.sizing_rate:
                results["fleet_needed"] = {"rate": sweep.sizing_rate,
                                           "edges": fleet_needed(cfg, sweep.sizing_rate, bar)}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    paths = write_report(results, out)
    if sweep:
        _append_sweep(paths["markdown"], results)
    print(f"collm-sim: done in {results['wall_s']:.0f} s; report {paths['markdown']}", flush=True)
    return 0


def _append_sweep(md: Path, results: dict) -> None:
    lines = ["", "## Fleet-size sweep (paired 95% CIs)", "",
             "| edges | load | capacity (req/s) | collm att | isolated att | collm/isolated | collm/serve-only | "
             "training tok/s collm / isolated |", "|---|---|---|---|---|---|---|---|"]

    def ci(v):
        return "-" if not v or v[0] is None else f"{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"

    for r in results["sweep"]:
        c, i = r.get("collm", {}), r.get("isolated", {})
        lines.append(f"| {r['edges']} | {r['fraction']:g}x | {r['capacity_rps']:.2f} | "
                     f"{c.get('attainment', float('nan')):.3f} | {i.get('attainment', float('nan')):.3f} | "
                     f"{ci(r.get('collm/isolated'))} | {ci(r.get('collm/serve-only'))} | "
                     f"{c.get('train_tokens_per_s', 0):.0f} / {i.get('train_tokens_per_s', 0):.0f} |")
    if "fleet_needed" in results:
        fn = results["fleet_needed"]
        lines += ["", f"Edges needed for {fn['rate']:g} req/s at the target attainment: " + ", ".join(
            f"{m} {n if n is not None else '> 4096'}" for m, n in fn["edges"].items())]
    md.write_text(md.read_text() + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
