"""Is a co-located replica's decode step slower after a training unit, or once it serves a trained version?

    python benchmarks/step_context.py RUN_DIR      # a collm-bench output folder with timelines

`benchmarks/interference.py` finds collm's decode steps slower than serve-only's in the same neighbour state
(collm-sim's `federation_slowdown`). This reads each mode folder's engine timelines two ways to narrow where:

* by what ran just before the step on the same replica (another serving step, a training or evaluation
  unit, or an idle gap over 50 ms), per decode batch (1, 2, 3, 4, 5-8 rows), against the steps after a step;
* by the federated version the replica served (before its first federated publish, or after it; the edge's
  own adapter publishes do not count), per decode batch; and, with the load held (`--around`: within that
  many seconds of the version, one load point) and the neighbour's state held (`interference.Busy`).

Decode steps only (no prefill rows); medians; groups with fewer than 20 steps are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from collm.edge_client.engine.timeline import read_timeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import Busy  # noqa: E402  (the neighbour's state, as interference.py reads it)

MIN_N = 20
BATCHES = ("1", "2", "3", "4", "5-8")  # decode rows: 1-4 each (the few-row kernels differ by row count), then the rest


def _batch(rows: int) -> str:
    return str(rows) if rows <= 4 else "5-8"


def after_what(events: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Decode step seconds by (batch, what ran just before on this replica)."""
    ev = sorted((e for e in events if e.get("ev") in ("step", "unit")), key=lambda e: e["t"])
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for prev, e in zip(ev, ev[1:]):
        if e["ev"] != "step" or e.get("pf") or not e.get("dec"):
            continue
        gap = e["t"] - (prev["t"] + prev["s"])
        what = ("idle gap" if gap > 0.05 else f"{prev['job']} {prev['unit']}" if prev["ev"] == "unit"
                else "step")
        out[(_batch(e["dec"]), what)].append(e["s"])
    return out


def by_version(events: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Decode step seconds by (batch, before / after the replica's first federated version)."""
    first = min((e["t"] + e["s"] for e in events if e.get("ev") == "publish"
                 and isinstance(e.get("version"), int) and e["version"] >= 1), default=float("inf"))
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("ev") == "step" and not e.get("pf") and e.get("dec"):
            out[(_batch(e["dec"]), "before" if e["t"] < first else "after")].append(e["s"])
    return out


def around_version(events: list[dict], neighbour: Busy | None, seconds: float) -> dict[tuple[str, str, str], list[float]]:
    """Decode step seconds within `seconds` before and after the replica's first federated version, by
    (batch, before / after, what the neighbour replica did during the step, as `interference.Busy.state`
    reads it: idle, serve or background; steps beside a mix are left out; "none" without a neighbour).
    Both sides then fall in the same load point (a point is longer than the first round), so the load is
    the same on either side of the version."""
    first = min((e["t"] + e["s"] for e in events if e.get("ev") == "publish"
                 and isinstance(e.get("version"), int) and e["version"] >= 1), default=None)
    out: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    if first is None:
        return out
    for e in events:
        if e.get("ev") != "step" or e.get("pf") or not e.get("dec") or abs(e["t"] - first) > seconds:
            continue
        state = "none" if neighbour is None else neighbour.state(e["t"], e["t"] + e["s"])
        if state is not None:
            out[(_batch(e["dec"]), "before" if e["t"] < first else "after", state)].append(e["s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a collm-bench output folder with timelines")
    ap.add_argument("--around", type=float, default=40.0,
                    help="seconds either side of the first federated version for the same-load view (default 40)")
    args = ap.parse_args(argv)
    if not args.around > 0:
        print(f"step_context: --around must be a positive number of seconds, got {args.around}", file=sys.stderr)
        return 2
    folders = sorted(d for d in args.run.iterdir() if d.is_dir() and list(d.glob("timeline-*.jsonl"))) \
        if args.run.is_dir() else []
    if not folders:
        print(f"step_context: run: no mode folder with timeline-*.jsonl under {args.run}", file=sys.stderr)
        return 2
    for d in folders:
        before: dict = defaultdict(list)
        version: dict = defaultdict(list)
        around: dict = defaultdict(list)
        timelines = {p: read_timeline(p) for p in sorted(d.glob("timeline-*.jsonl"))}
        for p, events in timelines.items():
            for k, v in after_what(events).items():
                before[k] += v
            for k, v in by_version(events).items():
                version[k] += v
            others = [Busy(e) for q, e in timelines.items() if q != p]
            for k, v in around_version(events, others[0] if len(others) == 1 else None, args.around).items():
                around[k] += v
        print(f"{d.name}: decode step ms (median, n) by what ran before it on the same replica, and x after a step")
        for b in BATCHES:
            base = before.get((b, "step"), [])
            if len(base) < MIN_N:
                continue
            m0 = statistics.median(base)
            cells = [f"{what} {1000 * statistics.median(v):.1f} (n={len(v)}) x{statistics.median(v) / m0:.3f}"
                     for (bb, what), v in sorted(before.items()) if bb == b and len(v) >= MIN_N]
            print(f"  {b:>3} rows: " + "; ".join(cells))
        print(f"{d.name}: decode step ms before / after the first federated version")
        for b in BATCHES:
            a, z = version.get((b, "before"), []), version.get((b, "after"), [])
            if len(a) >= MIN_N and len(z) >= MIN_N:
                print(f"  {b:>3} rows: {1000 * statistics.median(a):.1f} (n={len(a)}) / "
                      f"{1000 * statistics.median(z):.1f} (n={len(z)}) x{statistics.median(z) / statistics.median(a):.3f}")
        print(f"{d.name}: the same within {args.around:g} s of it (the same load point), by the neighbour's state")
        for b in BATCHES:
            for state in ("idle", "serve", "background", "none"):
                a, z = around.get((b, "before", state), []), around.get((b, "after", state), [])
                if len(a) >= MIN_N // 2 and len(z) >= MIN_N // 2:
                    print(f"  {b:>3} rows, neighbour {state}: {1000 * statistics.median(a):.1f} (n={len(a)}) / "
                          f"{1000 * statistics.median(z):.1f} (n={len(z)}) x{statistics.median(z) / statistics.median(a):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
