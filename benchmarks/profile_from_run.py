"""An edge profile for collm-sim from a collm-bench run's own engine timelines.

    python benchmarks/profile_from_run.py runs/bench-full --out runs/profile-bench.json
    python benchmarks/sim_fidelity.py --real runs/bench-full/results.json --config configs/sim-fidelity.yaml \
        --profile runs/profile-bench.json

`collm-edge --profile` times a few dozen steps outside the HTTP server on the day it runs; a bench run
has thousands of steps of the very replicas it measures, on the day of the run. This fits the
profile's serving cost (the engine's own step formula, `common/step_cost.py`, with each decode batch's
residual and the loop's gap between steps) to serve-only's steps, both passes pooled, with the
measured interference of a serving neighbour divided out (`benchmarks/interference.py`'s settings,
which it also prints), and the training and evaluation micro-batches to isolated's and collm's units.
Limits and the rest are the base profile's. What the other modes do is left for the simulation to
predict: only serve-only's steps and the background units' speed are fitted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import groups, paired, settings  # noqa: E402

from collm.common.step_cost import KV_UNIT  # noqa: E402
from collm.sim.profile import PROFILE_DIR  # noqa: E402

MAX_SAMPLES = 6000  # the profile's step samples (every k-th step beyond that)


def folders(run: Path, mode: str) -> list[Path]:
    return [d for d in (run / mode, run / f"{mode}-pass2") if d.is_dir()]


def step_samples(run: Path, serve_slowdown: float) -> tuple[list[list[float]], dict[int, list[float]]]:
    """serve-only's steps as [decode, prefill, attended, seconds] with the serving neighbour's share
    divided out, and the gaps between consecutive steps by running sequences."""
    samples, gaps = [], defaultdict(list)
    for folder in folders(run, "serve-only"):
        for events, other in paired(folder):
            steps = [e for e in events if e["ev"] == "step"]
            for e in steps:
                k = 1.0 + serve_slowdown * other.cover("serve", e["t"], e["t"] + e["s"])
                samples.append([e["dec"], e["pf"], e["att"], e["s"] / k])
            for a, b in zip(steps, steps[1:]):
                g = b["t"] - (a["t"] + a["s"])
                if 0 <= g < 0.2 and b["run"] > 0:
                    gaps[min(b["run"], 8)].append(g)
    return samples, gaps


def fit(samples: list[list[float]]) -> list[float]:
    """Least squares of the step formula's coefficients (non-negative: a negative one is refitted at 0)."""
    X = np.array([[1.0, d, p, kv / KV_UNIT] for d, p, kv, _ in samples])
    y = np.array([s for *_, s in samples])
    keep = list(range(4))
    while True:
        c, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (c >= 0).all():
            break
        keep.pop(int(np.argmin(c)))
    coef = [0.0] * 4
    for i, v in zip(keep, c):
        coef[i] = float(v)
    return coef


def microbatch_s(run: Path, modes: tuple[str, ...], job: str, units: int, slow: dict[str, float]) -> float | None:
    """Mean seconds of one `job` micro-batch of `units` units in `modes`' timelines, with the neighbour's
    share (serving: slowdown, background: the same, as collm-sim charges a unit) divided out."""
    total, n = 0.0, 0
    for mode in modes:
        for folder in folders(run, mode):
            for events, other in paired(folder):
                for e in events:
                    if e["ev"] == "unit" and e["job"] == job:
                        a, b = e["t"], e["t"] + e["s"]
                        busy = other.cover("serve", a, b) + other.cover("background", a, b)
                        total += e["s"] / (1.0 + slow["slowdown"] * busy)
                        n += 1
    return total / (n / units) if n >= units else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a collm-bench output folder with timelines (serve-only, isolated, collm)")
    ap.add_argument("--base", default="smollm2-cpu1", help="the profile whose limits and micro-batch shapes it keeps")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    base_path = Path(args.base) if args.base.endswith(".json") else PROFILE_DIR / f"{args.base}.json"
    if not base_path.is_file():
        print(f"profile_from_run: --base: no profile {base_path}", file=sys.stderr)
        return 2
    if not args.run.is_dir():
        print(f"profile_from_run: run: no folder {args.run}", file=sys.stderr)
        return 2
    base = json.loads(base_path.read_text())
    by_folder = {d.name: groups(d) for d in sorted(args.run.iterdir()) if d.is_dir()}
    inter = {k: v for k, (v, _) in settings(by_folder).items()}
    if inter["slowdown"] is None:
        print(f"profile_from_run: no serve-only timelines under {args.run} (collm-bench with `timeline: true`)",
              file=sys.stderr)
        return 1
    inter = {k: round(max(v, 0.0), 3) for k, v in inter.items() if v is not None}
    samples, gaps = step_samples(args.run, inter["slowdown"])
    coef = fit(samples)
    every = max(1, len(samples) // MAX_SAMPLES)
    g1 = statistics.median(gaps[1]) if len(gaps[1]) >= 10 else 0.0
    g8 = statistics.median(gaps[8]) if len(gaps[8]) >= 10 else g1
    out = dict(base)
    out["speed"] = 1.0
    out["source_run"] = str(args.run)
    out["step"] = {"features": base["step"]["features"], "coef": coef, "samples": samples[::every],
                   "fitted_on": len(samples),
                   "overhead_runs": [{"batch": 1, "per_step_s": g1}, {"batch": 8, "per_step_s": g8}]}
    for key, job, modes in (("train_microbatch", "train", ("isolated",)),
                            ("eval_microbatch", "eval", ("collm", "isolated"))):
        mb = dict(base[key])
        s = microbatch_s(args.run, modes, job, int(mb["units"]), inter)
        if s is not None:
            mb["seconds"] = s
        out[key] = mb
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    mape = float(np.median([abs(s - (coef[0] + coef[1] * d + coef[2] * p + coef[3] * kv / KV_UNIT)) / s
                            for d, p, kv, s in samples]))
    print(f"{len(samples)} serve-only steps: coef {[round(c, 5) for c in coef]}, median abs error {mape:.1%}; "
          f"gap between steps {1000 * g1:.1f} ms at 1 sequence, {1000 * g8:.1f} ms at 8")
    tr, ev = out["train_microbatch"]["seconds"], out["eval_microbatch"]["seconds"]
    print(f"training micro-batch {tr:.2f} s, evaluation {ev:.2f} s "
          f"(base {base['train_microbatch']['seconds']:.2f}, {base['eval_microbatch']['seconds']:.2f})")
    print("collm-sim: interference: {per_machine: 2, " + ", ".join(f"{k}: {v}" for k, v in inter.items()) + "}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
