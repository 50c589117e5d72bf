"""How well did the router's TTFT estimate predict the first tokens it relayed? From a collm-bench results.json.

    python benchmarks/estimate_report.py runs/bench-burst/results.json   # or a run's results.partial.json, or a .json.gz

Each request of a mode with the slo router carries `soonest_ttft_s`: the estimate admission compared with the
target. Per mode and load point this prints how many were refused, and for the admitted ones the measured
TTFT over that estimate (median and 10th-90th percentiles), split by the estimate: under the TTFT target
(no queue to speak of) and above it (a queue, where admission decides). A ratio well under 1 above the
target means admission refused requests that would have met their SLO (docs/benchmarks.md, 'The wait a
burst is read at').
"""

from __future__ import annotations

import sys

from collm.common.stats import percentile
from collm.lab.bench_report import read_results


def rows(results: dict) -> list[list[str]]:
    target = results["config"]["ttft_ms"] / 1000  # the bench config always records it (BenchConfig.ttft_ms)
    out = []
    runs = [(mode, m["points"]) for mode, m in results.get("modes", {}).items()]
    if not runs:  # results.partial.json of a run under way: its passes so far
        runs = [(f"{mode} (pass {i + 1})", r["points"]) for mode, rs in results.get("passes", {}).items()
                for i, r in enumerate(rs)]
    for mode, points in runs:
        for p in points:
            oc = p.get("outcomes") or []
            if not any(o.get("soonest_ttft_s") is not None for o in oc):
                continue  # a mode without the slo router (round robin): no estimates
            refused = [o for o in oc if o["status"] == 429]
            cells = [mode, f"{p['fraction']:g}x", str(len(oc)), str(len(refused)),
                     f"{percentile([o['soonest_ttft_s'] for o in refused], 0.5):.2f}" if refused else "-"]
            for lo, hi in ((0.0, target), (target, float("inf"))):
                r = [o["ttft_s"] / o["soonest_ttft_s"] for o in oc
                     if o["status"] == 200 and o.get("ttft_s") and o.get("soonest_ttft_s")
                     and lo <= o["soonest_ttft_s"] < hi and o["soonest_ttft_s"] > 0.05]
                cells.append(f"{percentile(r, 0.5):.2f} [{percentile(r, 0.1):.2f}, {percentile(r, 0.9):.2f}] n={len(r)}"
                             if r else "-")
            out.append(cells)
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        results = read_results(args[0])
    except (OSError, ValueError) as e:
        print(f"estimate_report: cannot read {args[0]}: {e}", file=sys.stderr)
        return 2
    head = ["mode", "load", "requests", "refused", "refused: estimate p50 s",
            "TTFT / estimate, estimate < target", "TTFT / estimate, estimate >= target"]
    try:
        table = [head] + rows(results)
    except (KeyError, TypeError, AttributeError) as e:
        print(f"estimate_report: {args[0]} is not a collm-bench results.json (missing {e})", file=sys.stderr)
        return 2
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
