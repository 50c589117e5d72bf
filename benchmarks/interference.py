"""How much do two replicas on one machine slow each other down? Measured from a collm-bench run's timelines.

    collm-bench --config configs/bench.yaml          # with `timeline: true` (on in the presets)
    python benchmarks/interference.py runs/bench     # prints the tables and collm-sim's setting

Every serving step and every training unit in a replica's engine timeline is put in a group by what
the other replica of the same mode was doing for most (>= 90%) of it: nothing (idle), serving steps,
or background units (training or evaluation); an event in between is left out. Steps are compared
within one shape (decode rows, no prefill; prefill chunks by 32 tokens), units per unit kind by their
time per token. Printed: the median of each group, the busy groups' medians against the idle one,
and collm-sim's three `interference` settings from the decode steps of batch 1-4 (`settings`): a
serving neighbour (serve-only), a training neighbour (isolated's serving replica) and what running
a federation adds to a step (collm against serve-only in the same neighbour state). On this 2-core
machine the rows measure shared memory bandwidth and caches (each replica has its own core); the
router, the load generator and the Flower processes run on the same cores too and are part of what
is measured.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import table  # noqa: E402

from collm.edge_client.engine.timeline import read_timeline  # noqa: E402

STATES = ("idle", "serve", "background")


class Busy:
    """One replica's busy intervals by kind, for asking what it did during [a, b]."""

    def __init__(self, events: list[dict]):
        self.spans = {"serve": sorted((e["t"], e["t"] + e["s"]) for e in events if e["ev"] == "step"),
                      "background": sorted((e["t"], e["t"] + e["s"]) for e in events if e["ev"] == "unit")}

    def cover(self, kind: str, a: float, b: float) -> float:
        spans = self.spans[kind]
        i = max(0, bisect.bisect_left(spans, (a, a)) - 1)
        c = 0.0
        while i < len(spans) and spans[i][0] < b:
            c += max(0.0, min(spans[i][1], b) - max(spans[i][0], a))
            i += 1
        return c / (b - a) if b > a else 0.0

    def state(self, a: float, b: float) -> str | None:
        serve, bg = self.cover("serve", a, b), self.cover("background", a, b)
        if serve + bg < 0.05:
            return "idle"
        if serve >= 0.9:
            return "serve"
        if bg >= 0.9:
            return "background"
        return None


def shape(e: dict) -> str:
    if e["ev"] == "step":
        return f"step decode {e['dec']}" if not e["pf"] else f"step prefill <= {32 * -(-e['pf'] // 32)}"
    return f"{e['job']} {e['unit']} (per 1k tokens)"


def paired(mode_dir: Path) -> list[tuple[list[dict], Busy]]:
    """Each replica's events with its neighbour's busy intervals (a two-replica mode folder; else [])."""
    files = sorted(mode_dir.glob("timeline-*.jsonl"))
    if len(files) != 2:
        return []
    events = [read_timeline(f) for f in files]
    busy = [Busy(ev) for ev in events]
    return [(events[0], busy[1]), (events[1], busy[0])]


def groups(mode_dir: Path) -> dict[str, dict[str, list[float]]]:
    """shape -> neighbour state -> durations (steps in ms; units in ms per 1,000 tokens)."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for events, other in paired(mode_dir):
        for e in events:
            if e["ev"] not in ("step", "unit"):
                continue
            st = other.state(e["t"], e["t"] + e["s"])
            if st is None:
                continue
            out[shape(e)][st].append(1000 * e["s"] if e["ev"] == "step" else 1e6 * e["s"] / max(e["tok"], 1))
    return out


DECODES = tuple(f"step decode {b}" for b in range(1, 5))


def excess(num: dict[str, list[float]], den: dict[str, list[float]]) -> tuple[float | None, int]:
    """How much longer `num`'s decode steps take than `den`'s of the same batch (1-4): the weighted mean
    of median(num) / median(den) - 1, weighted by the smaller group; and the weight."""
    total = weight = 0.0
    for k in DECODES:
        xs, ys = num.get(k, []), den.get(k, [])
        if len(xs) >= 10 and len(ys) >= 10:
            n = min(len(xs), len(ys))
            total += n * (statistics.median(xs) / statistics.median(ys) - 1)
            weight += n
    return (total / weight if weight else None), int(weight)


def by_state(g: dict[str, dict[str, list[float]]], state: str) -> dict[str, list[float]]:
    return {k: g.get(k, {}).get(state, []) for k in DECODES}


def slowdown(by_shape: dict[str, dict[str, list[float]]]) -> tuple[float | None, int]:
    """Any busy neighbour against an idle one, pooled over every mode (the single-number setting)."""
    busy = {k: by_shape.get(k, {}).get("serve", []) + by_shape.get(k, {}).get("background", []) for k in DECODES}
    return excess(busy, by_state(by_shape, "idle"))


def settings(by_folder: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, tuple[float | None, int]]:
    """collm-sim's three interference settings from the modes' decode steps:

    * `slowdown`: serve-only's steps beside a serving neighbour against beside an idle one;
    * `federation_slowdown`: collm's steps beside a serving neighbour against serve-only's (the same
      shapes and neighbour state; what differs is the Flower processes and the training state);
    * `background_slowdown`: isolated's serving replica (its neighbour trains) against serve-only's
      steps beside an idle neighbour, with the federation's share divided out.

    A counterbalanced run's passes are compared pass with pass (`collm-pass2` with `serve-only-pass2`:
    each pair ran next to each other, so the machine's drift over the run stays out), then averaged
    weighted by their pairs."""
    parts: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for suffix in ("", "-pass2"):
        so, co, iso = (by_folder.get(m + suffix, {}) for m in ("serve-only", "collm", "isolated"))
        serve, n = excess(by_state(so, "serve"), by_state(so, "idle"))
        fed, nf = excess(by_state(co, "serve"), by_state(so, "serve"))
        bg, nb = excess(by_state(iso, "background"), by_state(so, "idle"))
        if serve is not None:
            parts["slowdown"].append((serve, n))
        if fed is not None:
            parts["federation_slowdown"].append((fed, nf))
        if bg is not None:
            parts["background_slowdown"].append(((1 + bg) / (1 + (fed or 0.0)) - 1, nb))

    def mean(xs: list[tuple[float, int]]) -> tuple[float | None, int]:
        w = sum(n for _, n in xs)
        return (sum(v * n for v, n in xs) / w if w else None), w

    return {k: mean(parts[k]) for k in ("slowdown", "federation_slowdown", "background_slowdown")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a collm-bench output folder with timelines")
    ap.add_argument("--json", type=Path, help="also write the medians and the slowdown here")
    args = ap.parse_args(argv)
    if not args.run.is_dir():
        print(f"interference: run: no folder {args.run}", file=sys.stderr)
        return 2
    mode_dirs = sorted(d for d in args.run.iterdir() if d.is_dir() and list(d.glob("timeline-*.jsonl")))
    if not mode_dirs:
        print(f"interference: no timelines under {args.run} (run collm-bench with `timeline: true`)", file=sys.stderr)
        return 1
    pooled: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_folder: dict[str, dict[str, dict[str, list[float]]]] = {}
    report = {}
    for d in mode_dirs:
        by_folder[d.name] = groups(d)
        for k, g in by_folder[d.name].items():
            for st, xs in g.items():
                pooled[k][st] += xs
    rows = []
    for k in sorted(pooled):
        g = pooled[k]
        med = {st: statistics.median(g[st]) if g.get(st) else None for st in STATES}
        if sum(len(g.get(st, [])) for st in STATES) < 20:
            continue
        idle = med["idle"]
        rows.append([k] + [f"{len(g.get(st, []))}: {med[st]:.1f}" if med[st] else "-" for st in STATES]
                    + [f"{med[st] / idle:.2f}" if med[st] and idle else "-" for st in ("serve", "background")])
        report[k] = {st: {"n": len(g.get(st, [])), "median": med[st]} for st in STATES}
    print(f"Pooled over {len(mode_dirs)} mode folders of {args.run} (steps in ms, units in ms per 1k tokens; "
          "n: median):\n")
    print(table(["event", "neighbour idle", "neighbour serving", "neighbour in background work",
                 "serving / idle", "background / idle"], rows))
    s, n = slowdown(pooled)
    report["slowdown_pooled"] = s
    if s is not None:
        print(f"\nAny busy neighbour against an idle one, every mode pooled: {s:+.3f} (decode steps of batch 1-4, "
              f"{n} pairs)")
    parts = settings(by_folder)
    report["settings"] = {k: v[0] for k, v in parts.items()}
    for k, (v, w) in parts.items():
        print(f"  {k}: " + (f"{v:+.3f} ({w} pairs)" if v is not None else "not enough steps (needs serve-only, collm "
                                                                          "and isolated folders)"))
    found = {k: round(max(v, 0.0), 3) for k, (v, _) in parts.items() if v is not None}
    if found:
        print("\ncollm-sim: interference: {per_machine: 2, "
              + ", ".join(f"{k}: {v}" for k, v in found.items()) + "}")
    else:
        print("\nnot enough decode steps to set collm-sim's interference")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
