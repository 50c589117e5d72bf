"""`collm-bench --config bench.yaml`: trace-replay goodput of CoLLM against the deployments it replaces.

Every mode runs on the same replicas (edge processes on this machine, each pinned to its own cores),
the same SLOs and the same arrivals, one mode after another:

* `collm`            every replica serves and trains (training only in time serving does not need),
                     the balancer sizes each round, the SLO-aware router spreads requests, shadow swaps;
* `isolated`         the usual split: half the replicas only serve, half only train federated; the
                     serving half reloads the new global adapter from disk after each round;
* `colocated-naive`  every replica serves and trains flat out (a whole micro-batch after every step,
                     no SLO control, equal budgets), round-robin routing;
* `serve-only`       no training at all (quality stays where it started), round-robin routing.

The run, in order:

1. capacity: on the serve-only topology, probe rates `start_rate * growth^k` until SLO attainment
   falls below the target, then bisect; serve-only's capacity C is the interpolated crossing;
2. load points: offered loads `fraction * C` (0.2x..1.2x), each a segment of the trace whose
   arrival times are scaled to that mean rate (bursts kept), with enough requests to measure it;
   every mode replays exactly these plans, so request i of a point is the same arrival in every mode;
3. per point and mode: attainment, goodput and latency percentiles, training tokens/s (the edges'
   counters); 95% bootstrap intervals, and paired-bootstrap intervals for goodput ratios between
   modes (request i resampled together in both);
4. served quality: after each mode, the loss of every global adapter it served on one fixed
   held-out set, at the time it was swapped in.

It writes results.json (per request: SLO met or not, so every number can be recomputed),
report.md and plots, and results.partial.json after the capacity search and after every point.
The processes of one mode are `bench_topology.ModeRun`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from collm.common.durable import write_atomic
from collm.common.errors import UserError, cli_entry
from collm.common.rounds import complete_rounds
from collm.common.stats import mean_ci
from collm.lab.bench_analysis import add_quality, combine_passes, max_sustained_rate, search_capacity
from collm.lab.bench_config import BenchConfig
from collm.lab.bench_quality import QualityJudge, served_loss_timeline
from collm.lab.bench_topology import ModeRun, check_mode_configs
from collm.lab.bench_workload import Workload, window_of
from collm.lab.loadgen import Outcome, Planned, replay, summarize
from collm.lab.topology import config_path, prepare_out, stop_on_signals


# ----------------------------------------------------------------------------- one load point
def measure(run: ModeRun, plan: list[Planned], cfg: BenchConfig, label: dict) -> dict:
    """Replay `plan` through the mode's router; the point's numbers, with 95% intervals."""
    tok0, t0 = run.training_tokens(), time.time()
    outcomes = replay(plan, run.router)
    t1 = time.time()
    tokens = run.training_tokens() - tok0
    window = window_of(plan)
    s = summarize(outcomes, window)
    met = [1.0 if o.slo_met else 0.0 for o in outcomes]
    att, lo, hi = mean_ci(met, resamples=cfg.bootstrap)
    n = len(outcomes)
    return {**label, "rate": n / window, "window_s": window, **s,
            "attainment_ci": [lo, hi], "goodput_ci": [lo * n / window, hi * n / window],
            "train_tokens": tokens, "train_tokens_per_s": tokens / max(t1 - t0, 1e-9),
            "started_at": t0, "ended_at": t1, "slo_met": met, "outcomes": [_compact(o, t0) for o in outcomes]}


def _compact(o: Outcome, t0: float) -> dict:
    """`at`: seconds after the point's `started_at` on the wall clock the edges' timelines use (the replay's own
    clock starts a little later, by as much as a loaded machine delays it)."""
    return {"at": round(o.sent_wall - t0, 4), "status": o.status, "ttft_s": o.ttft_s, "tpot_s": o.tpot_s,
            "tokens": o.output_tokens, "version": o.adapter_version, "edge": o.edge, "miss": o.miss,
            "soonest_ttft_s": o.soonest_ttft_s}


def find_capacity(run: ModeRun, work: Workload, cfg: BenchConfig, bar) -> dict:
    """Serve-only's highest rate at >= the target attainment (`search_capacity`), probed over HTTP."""
    c = cfg.capacity
    n = [0]

    def probe(rate: float) -> dict:
        n[0] += 1
        plan = work.plan(work.segment(rate, c.probe_s or cfg.load.seconds, c.min_requests or cfg.load.min_requests),
                         run.model_id)
        p = measure(run, plan, cfg, {"probe": n[0]})
        bar.write(f"  capacity probe {n[0]}: {p['rate']:.3f} req/s, {p['requests']} requests, attainment "
                  f"{p['slo_attainment']:.3f} [{p['attainment_ci'][0]:.2f}, {p['attainment_ci'][1]:.2f}]")
        return {k: v for k, v in p.items() if k not in ("outcomes", "slo_met")}

    return search_capacity(probe, c)


# ----------------------------------------------------------------------------- one mode
def run_mode(cfg: BenchConfig, mode: str, out: Path, work: Workload, plans: list[tuple[float, list[Planned]]] | None,
             judge: QualityJudge, base_loss: float, bar, on_point=lambda progress: None) -> dict:
    """Start the mode's topology, (serve-only without a fixed capacity: find it), replay every load point.
    `on_point(progress)` gets what is finished so far (the capacity, the points) after the capacity and after each
    point, so an interrupted run keeps it."""
    run = ModeRun(cfg, mode, out)
    result: dict = {"mode": mode, "replicas": cfg.replicas, "roles": dict(zip((e.name for e in run.edges), run.roles))}
    t_start = time.time()
    try:
        run.start()
        result["startup_s"] = round(time.time() - t_start, 1)
        time.sleep(cfg.warmup_s)
        if plans is None:  # the serve-only run measures the capacity every load point is a fraction of
            cap = ({"rate": cfg.capacity.rate, "note": "fixed in the config", "probes": [],
                    "target_attainment": cfg.capacity.target_attainment} if cfg.capacity.rate
                   else find_capacity(run, work, cfg, bar))
            result["capacity"] = cap
            on_point({"mode": mode, "capacity": cap, "points": []})
            plans = [(f, work.plan(work.segment(f * cap["rate"], cfg.load.seconds, cfg.load.min_requests),
                                   run.model_id)) for f in cfg.load.fractions]
        result["plans"] = plans
        t_start = time.time()
        points = []
        for f, plan in plans:
            bar.set_postfix_str(f"{mode} {f:g}x")
            p = measure(run, plan, cfg, {"fraction": f})
            points.append(p)
            on_point({"mode": mode, "capacity": result.get("capacity"), "points": points})
            bar.update(1)
            bar.write(f"  {mode} {f:g}x capacity ({p['rate']:.3f} req/s, {p['requests']} requests): goodput "
                      f"{p['goodput_rps']:.3f} req/s, attainment {p['slo_attainment']:.3f} "
                      f"[{p['attainment_ci'][0]:.2f}, {p['attainment_ci'][1]:.2f}], training "
                      f"{p['train_tokens_per_s']:.0f} tok/s")
            time.sleep(cfg.load.drain_s)
        result["points"] = points
        result["max_rate"] = max_sustained_rate(points, cfg.capacity.target_attainment)
        result["versions_served"] = sorted({o["version"] for p in points for o in p["outcomes"]
                                            if o["version"] is not None})
        result["rounds_completed"] = len(complete_rounds(run.ckpt_dir))
        result["reloads"] = run.reloads
        result["wall_s"] = round(time.time() - t_start, 1)
    finally:
        run.stop()
    result["served_loss"] = served_loss_timeline(judge, run, t_start, base_loss)
    result["final_loss"] = result["served_loss"][-1]["loss"]
    return result


def run_order(modes: list[str], order: str, drift_check: bool) -> list[str]:
    """The modes in the order they run, serve-only first (it measures the capacity): once each; with the
    drift check serve-only again at the end; counterbalanced, every mode twice, A B C D then D C B A."""
    if order == "counterbalanced":
        return modes + modes[::-1]
    return modes + (["serve-only"] if drift_check and len(modes) > 1 else [])


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-bench", description="Trace-replay goodput benchmark of CoLLM "
                                "against isolated, colocated-naive and serve-only deployments.")
    p.add_argument("--config", default="configs/bench-quick.yaml")
    p.add_argument("--out", help="override `out`")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier benchmark's results in `out`")
    p.add_argument("--replot", metavar="RESULTS", help="run nothing: draw the report and plots of a finished run "
                   "(its results.json, or the results.json.gz docs/ keeps) into --out")
    return p


def replot(results_path: str, out: str | None, overwrite: bool) -> int:
    """report.md and the plots of a kept run, from its results alone (docs/ keeps no plots for most A/Bs)."""
    import shutil
    import tempfile

    from collm.lab.bench_report import read_results, write_report

    if not out:
        raise UserError("--replot: give --out, the folder to draw into (e.g. runs/replot)")
    source, dest = Path(results_path).resolve(), Path(out).resolve()
    if dest == source.parent or dest in source.parents:
        raise UserError(f"--replot: --out {out} holds the results it would redraw (and, for a run's own folder, its "
                        "timelines and logs); draw into another folder")
    try:
        results = read_results(results_path)
    except (OSError, ValueError) as e:
        raise UserError(f"--replot: cannot read {results_path}: {e}") from None
    if not isinstance(results, dict) or not isinstance(results.get("modes"), dict) or "config" not in results:
        raise UserError(f"--replot: {results_path} is not a finished collm-bench run's results (no modes / config)")
    if not results["modes"]:  # an interrupted run's results.partial.json
        pool_finished_modes(results, results_path)
    with tempfile.TemporaryDirectory() as tmp:  # drawn aside first: a results file that fails leaves no folder
        try:
            write_report(results, Path(tmp))
        except Exception as e:  # any shape write_report cannot draw: one line, not a traceback
            raise UserError(f"--replot: {results_path} is not a finished collm-bench run's results "
                            f"({type(e).__name__}: {e})") from None
        dest = prepare_out(dest, overwrite)
        for f in Path(tmp).iterdir():
            shutil.move(str(f), dest / f.name)
    print(f"collm-bench: report {dest / 'report.md'}, plots beside it", flush=True)
    return 0


def pool_finished_modes(results: dict, results_path: str) -> None:
    """An interrupted run's results.partial.json: its finished modes pooled as at a run's end (each mode's first
    pass where the modes had run different numbers of passes); in place."""
    if not isinstance(results.get("passes"), dict) or not any(results["passes"].values()):
        raise UserError(f"--replot: {results_path} has no finished mode yet (an interrupted run keeps its "
                        "finished points under in_progress, but a mode is drawn only once it has run all of them)")
    passes = {m: rs for m, rs in results["passes"].items() if rs}
    if len({len(rs) for rs in passes.values()}) > 1:  # stopped between two modes' second passes: like with like
        passes = {m: rs[:1] for m, rs in passes.items()}
        results["order"] = [o for o in results.get("order", []) if o.endswith("(pass 1)")]
        print("collm-bench: the modes had run different numbers of passes; drawing each mode's first",
              flush=True)
    results["passes"] = passes
    results.setdefault("wall_s", sum(r.get("wall_s", 0.0) for rs in passes.values() for r in rs))
    try:
        combine_passes(results, BenchConfig.model_validate(results["config"]))
    except Exception as e:  # noqa: BLE001 - a partial file of another version: one line
        raise UserError(f"--replot: cannot pool the finished modes of {results_path} ({type(e).__name__}: "
                        f"{e})") from None
    print(f"collm-bench: {results_path} is an interrupted run's; drawing its finished modes: "
          f"{', '.join(results['modes'])}", flush=True)


def interrupt_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _say_where_on_interrupt(partial: Path):
    try:
        yield
    except (KeyboardInterrupt, UserError):
        if partial.is_file():
            print(f"\ncollm-bench: stopped; what finished is in {partial} (`collm-bench --replot {partial} --out "
                  f"DIR` draws the finished modes)", file=sys.stderr, flush=True)
        raise


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from collm.common.config import load_config
    from collm.lab.bench_report import write_report

    args = build_parser().parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, args.out, args.overwrite)
    if threading.current_thread() is threading.main_thread():
        stop_on_signals(interrupt_on_signal)  # the mode's processes stop, like on ^C
    cfg = load_config(BenchConfig, config_path(args.config), {"out": args.out} if args.out else None)
    check_mode_configs(cfg)
    out = prepare_out(Path(cfg.out), args.overwrite)
    work = Workload(cfg)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t0 = time.time()
    modes = ["serve-only"] + [m for m in cfg.modes if m != "serve-only"]  # serve-only first: it sets the capacity
    print(f"collm-bench: model {cfg.model}, {cfg.replicas} replicas, modes {', '.join(modes)}, load points "
          f"{cfg.load.fractions} x capacity; writing to {out}", flush=True)
    judge = QualityJudge(cfg)
    base_loss = judge.loss(None)
    results: dict = {"config": cfg.model_dump(mode="json"), "base_loss": base_loss, "modes": {}, "order": [],
                     "passes": {}}
    plans = None
    runs = run_order(modes, cfg.order, cfg.drift_check)
    partial = out / "results.partial.json"

    def keep(progress: dict | None = None) -> None:
        """The finished modes and, with `progress`, the mode in progress (its capacity, its finished points):
        an interrupted run loses nothing that finished, and `--replot` draws its finished modes."""
        data = {**results, "in_progress": progress} if progress else results
        write_atomic(partial, json.dumps(data, indent=1, default=str), sync_dir=False)

    with tqdm(total=len(runs) * len(cfg.load.fractions), desc="collm-bench", unit="point", file=sys.stdout,
              dynamic_ncols=True) as bar, _say_where_on_interrupt(partial):
        for mode in runs:
            passes = results["passes"].setdefault(mode, [])
            where = out / (mode if not passes else f"{mode}-pass{len(passes) + 1}")
            r = run_mode(cfg, mode, where, work, plans, judge, base_loss, bar, on_point=keep)
            plans = r.pop("plans")
            if "capacity" in r:
                results["capacity"] = r.pop("capacity")  # serve-only's first pass: every ratio's baseline
            add_quality(r, base_loss, cfg.bootstrap)
            passes.append(r)
            results["order"].append(f"{mode} (pass {len(passes)})")
            bar.write(f"  {mode} (pass {len(passes)}): max rate at >= {cfg.capacity.target_attainment:.0%} "
                      f"attainment {r['max_rate']:.3f} req/s, rounds {r['rounds_completed']}, served loss "
                      f"{r['served_loss'][0]['loss']:.4f} -> {r['final_loss']:.4f}")
            keep()
    combine_passes(results, cfg)
    results["wall_s"] = round(time.time() - t0, 1)
    paths = write_report(results, out)
    print(f"collm-bench: done in {results['wall_s']:.0f} s; report {paths['markdown']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
