"""How much do two replicas on one machine slow each other down? Measured from a collm-bench run's timelines.

    collm-bench --config configs/bench.yaml          # with `timeline: true` (on in the presets)
    python benchmarks/interference.py runs/bench     # prints the tables and collm-sim's setting

Every serving step and every training unit in a replica's engine timeline is put in a group by what
the other replica of the same mode was doing for most (>= 90%) of it: nothing (idle), serving steps,
or background units (training or evaluation); an event in between is left out. Steps are compared
within one shape (decode rows, no prefill; prefill chunks by 32 tokens), units per unit kind by their
time per token. Printed: the median of each group, the busy groups' medians against the idle one,
and the slowdown collm-sim's `interference.slowdown` takes (the request-weighted mean over decode
steps of batch 1-4 with both a busy and an idle neighbour). On this 2-core machine the rows measure
shared memory bandwidth and caches (each replica has its own core); the router, the load generator
and the Flower processes run on the same cores too and are part of what is measured.
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


def groups(mode_dir: Path) -> dict[str, dict[str, list[float]]]:
    """shape -> neighbour state -> durations (steps in ms; units in ms per 1,000 tokens)."""
    files = sorted(mode_dir.glob("timeline-*.jsonl"))
    if len(files) != 2:
        return {}
    events = [read_timeline(f) for f in files]
    busy = [Busy(ev) for ev in events]
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for me, other in ((0, 1), (1, 0)):
        for e in events[me]:
            if e["ev"] not in ("step", "unit"):
                continue
            st = busy[other].state(e["t"], e["t"] + e["s"])
            if st is None:
                continue
            out[shape(e)][st].append(1000 * e["s"] if e["ev"] == "step" else 1e6 * e["s"] / max(e["tok"], 1))
    return out


def slowdown(by_shape: dict[str, dict[str, list[float]]]) -> tuple[float | None, int]:
    """Weighted mean of (busy median / idle median - 1) over decode steps of batch 1-4, and its weight."""
    num = weight = 0.0
    for k in (f"step decode {b}" for b in range(1, 5)):
        g = by_shape.get(k, {})
        idle = g.get("idle", [])
        busy = g.get("serve", []) + g.get("background", [])
        if len(idle) >= 10 and len(busy) >= 10:
            n = min(len(idle), len(busy))
            num += n * (statistics.median(busy) / statistics.median(idle) - 1)
            weight += n
    return (num / weight if weight else None), int(weight)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a collm-bench output folder with timelines")
    ap.add_argument("--json", type=Path, help="also write the medians and the slowdown here")
    args = ap.parse_args(argv)
    mode_dirs = sorted(d for d in args.run.iterdir() if d.is_dir() and list(d.glob("timeline-*.jsonl")))
    if not mode_dirs:
        print(f"interference: no timelines under {args.run} (run collm-bench with `timeline: true`)", file=sys.stderr)
        return 1
    pooled: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    report = {}
    for d in mode_dirs:
        for k, g in groups(d).items():
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
    report["slowdown"] = s
    if s is None:
        print("\nnot enough decode steps beside an idle and a busy neighbour to set interference.slowdown")
    else:
        print(f"\ncollm-sim: interference: {{per_machine: 2, slowdown: {max(s, 0.0):.3f}}}   "
              f"(decode steps of batch 1-4, {n} pairs)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
