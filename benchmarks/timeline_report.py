"""Where did a slow request's time go? collm-bench's requests laid beside their replicas' engine timelines.

    collm-bench --config configs/bench.yaml      # with `timeline: true`
    python benchmarks/timeline_report.py runs/bench [--modes collm,serve-only]

For every request of every load point, the replica that served it is looked up in that replica's
timeline (`engine.timeline`, one event per serving step and per unit of background work), and the
request's life (from when it was sent to its last token) is split into the replica's time in
serving steps, in training units, in evaluation units, and in neither: the loop's own work between
forwards (admission, planning, sampling's bookkeeping, detokenizing and handing tokens to the HTTP
side), waiting for work, or being held up by another thread or process. The report prints, per mode
and load point, those shares for the requests that met their SLOs and for those that missed (only
requests that reached a replica and got a first token: a refusal has no life on a replica), and how
much slower the replica's steps were than its median step of the same shape over the whole run (a
neighbour on shared memory bandwidth, or a process on its core, shows up there, not as training).
Then, per load point, pass and replica, the shares of the point's window each replica spent in
serving steps, training units, evaluation units and neither (where the replicas' time went).

Last, when the run has serve-only, isolated and a co-located mode, the ceiling idle time sets: per load
point, the replica-seconds per second serve-only's replicas spent in neither (idle, for a co-located
trainer that only takes what serving leaves), against the replica-seconds per second the isolated
trainer spends in training and evaluation units. Their ratio is the training a co-located deployment
reaches against the isolated trainer if it takes every idle second of serve-only and nothing from
serving, at the same tokens per background second; each co-located mode's own background time and
measured training ratio stand beside it. Past the ceiling training must take time serving needs
(or serving must get cheaper with training beside it: requests batched while a unit runs).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import table  # noqa: E402

from collm.edge_client.engine.timeline import read_timeline  # noqa: E402
from collm.lab.bench_report import read_results  # noqa: E402

KINDS = ("step", "train", "eval", "other")


class ReplicaTimeline:
    """One replica's busy intervals (start, end, kind), sorted, with each step's slowdown factor."""

    def __init__(self, events: list[dict]):
        spans = []
        for e in events:
            if e["ev"] == "step":
                spans.append((e["t"], e["t"] + e["s"], "step", e))
            elif e["ev"] == "unit":
                spans.append((e["t"], e["t"] + e["s"], "train" if e["job"] == "train" else "eval", e))
        spans.sort(key=lambda s: s[0])
        self.spans = spans
        self.starts = [s[0] for s in spans]
        by_shape: dict[tuple, list[float]] = defaultdict(list)
        for _, _, kind, e in spans:
            if kind == "step":
                by_shape[self.shape(e)].append(e["s"])
        self.typical = {k: statistics.median(v) for k, v in by_shape.items()}

    @staticmethod
    def shape(e: dict) -> tuple:
        """Steps alike enough to compare: decode rows, prefill tokens in 32-token buckets, KV tokens
        attended in 512-token buckets (timelines written before `att` was recorded: one bucket)."""
        return e["dec"], -(-e["pf"] // 32), e.get("att", 0) // 512

    def split(self, t0: float, t1: float) -> dict:
        """Seconds of [t0, t1] in steps, training units, evaluation units and neither; the steps'
        actual / typical time."""
        out = dict.fromkeys(KINDS, 0.0)
        actual = typical = 0.0
        i = max(0, bisect.bisect_left(self.starts, t0) - 1)
        while i < len(self.spans) and self.spans[i][0] < t1:
            a, b, kind, e = self.spans[i]
            overlap = min(b, t1) - max(a, t0)
            if overlap > 0:
                out[kind] += overlap
                if kind == "step":
                    actual += e["s"]
                    typical += self.typical[self.shape(e)]
            i += 1
        out["other"] = max(0.0, (t1 - t0) - out["step"] - out["train"] - out["eval"])
        out["slowdown"] = actual / typical if typical else None
        return out


def mode_folder(mode: str, k: int) -> str:
    """Where collm-bench wrote pass k (0-based) of a mode: `mode`, then `mode-pass2`, ..."""
    return mode if k == 0 else f"{mode}-pass{k + 1}"


def pass_points(point: dict) -> list[dict]:
    """A reported load point as its passes' points: a pooled point holds its passes' requests one pass
    after another (the same arrivals each time) and each pass's start in `per_pass`."""
    per = point.get("per_pass")
    if not per:
        return [point]
    n, left = divmod(len(point["outcomes"]), len(per))
    if left:  # every pass replays the same arrivals; anything else cannot be split back into passes
        raise ValueError(f"a {point['fraction']:g}x point pools {len(point['outcomes'])} requests over {len(per)} "
                         "passes of unequal size")
    window = point.get("window_s") and point["window_s"] / len(per)  # pooled: the passes' equal windows summed
    return [{"fraction": point["fraction"], "started_at": q["started_at"], "window_s": window,
             "outcomes": point["outcomes"][k * n:(k + 1) * n], "slo_met": point["slo_met"][k * n:(k + 1) * n]}
            for k, q in enumerate(per)]


def load_mode(results: dict, out: Path, mode: str) -> list[tuple[list[dict], dict]]:
    """Each pass's load points and its replicas' timelines (by edge name); [] if the mode did not run or
    wrote no timelines. A counterbalanced run's passes each have their own folder."""
    run = results["modes"].get(mode)
    if run is None:
        return []
    by_pass = list(zip(*(pass_points(p) for p in run["points"])))
    loaded = []
    for k, points in enumerate(by_pass):
        folder = out / mode_folder(mode, k)
        timelines = {p.stem.removeprefix("timeline-"): ReplicaTimeline(read_timeline(p))
                     for p in sorted(folder.glob("timeline-*.jsonl"))}
        if timelines:
            loaded.append((list(points), timelines))
    return loaded


def point_rows(loaded: list[tuple[list[dict], dict]]) -> list[dict]:
    """Per load point and met/missed: the shares of the requests' lifetimes, pooled over the passes."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for points, timelines in loaded:
        for p in points:
            for o, met in zip(p["outcomes"], p["slo_met"]):
                tl = timelines.get(o["edge"] or "")
                if tl is None or o["ttft_s"] is None:
                    continue
                t0 = p["started_at"] + o["at"]
                life = o["ttft_s"] + (o["tpot_s"] or 0.0) * max(0, (o["tokens"] or 1) - 1)
                groups.setdefault((p["fraction"], "met" if met else "missed"), []).append(
                    tl.split(t0, t0 + life) | {"life": life})
    rows = []
    for (fraction, name), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        life = sum(x["life"] for x in g)
        slow = [x["slowdown"] for x in g if x["slowdown"]]
        rows.append({"fraction": fraction, "group": name, "n": len(g),
                     **{k: sum(x[k] for x in g) / life for k in KINDS},
                     "life_s": life / len(g), "slowdown": statistics.median(slow) if slow else None})
    return rows


def replica_rows(loaded: list[tuple[list[dict], dict]]) -> list[dict]:
    """Per load point, pass and replica: the shares of the point's window the replica spent in serving
    steps, training units, evaluation units and neither (where its time went, whoever it served)."""
    rows = []
    for k, (points, timelines) in enumerate(loaded):
        for p in points:
            if not p.get("window_s"):
                continue
            t0 = p["started_at"]
            for name, tl in timelines.items():
                x = tl.split(t0, t0 + p["window_s"])
                rows.append({"fraction": p["fraction"], "pass": k + 1, "replica": name,
                             **{kind: x[kind] / p["window_s"] for kind in KINDS}})
    return sorted(rows, key=lambda r: (r["fraction"], r["pass"], r["replica"]))


def background_per_point(rows: list[dict], replicas=lambda name: True, kinds=("train", "eval")) -> dict[float, float]:
    """Per load point: replica-seconds per second the chosen replicas spent in `kinds`, summed over them
    and averaged over passes (from `replica_rows`)."""
    by: dict[float, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        if replicas(r["replica"]):
            by[r["fraction"]][r["pass"]] += sum(r[k] for k in kinds)
    return {f: statistics.fmean(passes.values()) for f, passes in by.items()}


def ceiling_rows(replicas_by_mode: dict[str, list[dict]], results: dict) -> list[dict]:
    """Per load point and co-located mode: serve-only's idle replica-seconds per second, the isolated
    trainer's background (training and evaluation) replica-seconds per second, their ratio (the
    ceiling), the mode's own background replica-seconds per second and its measured training ratio
    against isolated. [] unless serve-only, isolated and a co-located mode have timelines."""
    if "serve-only" not in replicas_by_mode or "isolated" not in replicas_by_mode:
        return []
    idle = background_per_point(replicas_by_mode["serve-only"], kinds=("other",))
    trainer = background_per_point(replicas_by_mode["isolated"], replicas=lambda n: n.startswith("train"))
    iso_tok = {p["fraction"]: p["train_tokens_per_s"] for p in results["modes"]["isolated"]["points"]}
    rows = []
    for mode, rr in replicas_by_mode.items():
        if mode in ("serve-only", "isolated"):
            continue
        own = background_per_point(rr)
        tok = {p["fraction"]: p["train_tokens_per_s"] for p in results["modes"][mode]["points"]}
        for f in sorted(set(idle) & set(trainer) & set(own)):
            rows.append({"fraction": f, "mode": mode, "idle": idle[f], "trainer": trainer[f],
                         "ceiling": idle[f] / trainer[f] if trainer[f] else None, "own": own[f],
                         "measured": tok[f] / iso_tok[f] if iso_tok.get(f) else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="a collm-bench output folder run with `timeline: true`")
    ap.add_argument("--modes", help="comma-separated (default: every mode with timelines)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    names = ("results.json", "results.json.gz", "results.partial.json", "results.partial.json.gz")
    src = next((out / n for n in names if (out / n).exists()), None)
    if src is None:
        ap.error(f"{out} has no results.json or results.partial.json (or .gz): give a collm-bench output folder "
                 "(its `out`)")
    try:
        results = read_results(src)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read {src}: {e}")
    modes = args.modes.split(",") if args.modes else list(results["modes"])
    unknown = sorted(set(modes) - set(results["modes"]))
    if unknown:
        ap.error(f"--modes: {unknown} not in this run; it has {sorted(results['modes'])}")
    replicas_by_mode = {}
    for mode in modes:
        loaded = load_mode(results, out, mode)
        if not loaded:
            print(f"{mode}: no timelines under {out / mode}")
            continue
        rows = point_rows(loaded)
        print(f"\n{mode}: share of the requests' lifetimes their replica spent in ...")
        print(table(["load", "requests", "n", "serving steps", "training units", "eval units", "neither",
                     "mean life s", "step slowdown"],
                    [[f"{r['fraction']:g}x", r["group"], r["n"], f"{r['step']:.2f}", f"{r['train']:.2f}",
                      f"{r['eval']:.2f}", f"{r['other']:.2f}", f"{r['life_s']:.2f}",
                      "-" if r["slowdown"] is None else f"{r['slowdown']:.2f}"] for r in rows]))
        replicas_by_mode[mode] = replica_rows(loaded)
        print(f"\n{mode}: share of each load point's window each replica spent in ...")
        print(table(["load", "pass", "replica", "serving steps", "training units", "eval units", "neither"],
                    [[f"{r['fraction']:g}x", r["pass"], r["replica"], f"{r['step']:.2f}", f"{r['train']:.2f}",
                      f"{r['eval']:.2f}", f"{r['other']:.2f}"] for r in replicas_by_mode[mode]]))
    ceiling = ceiling_rows(replicas_by_mode, results)
    if ceiling:
        print("\nThe ceiling idle time sets (replica-seconds per second; training ratio against the isolated trainer)")
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(table(["load", "mode", "serve-only idle", "isolated trainer busy", "ceiling", "mode's background",
                     "measured"],
                    [[f"{r['fraction']:g}x", r["mode"], fmt(r["idle"]), fmt(r["trainer"]), fmt(r["ceiling"]),
                      fmt(r["own"]), fmt(r["measured"])] for r in ceiling]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
