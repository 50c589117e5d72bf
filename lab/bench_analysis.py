"""collm-bench's analysis of measured points, as pure functions over its result dicts (no processes):
what collm-sim reads its own runs with too.

* **Reading a sweep**: `search_capacity` (serve-only's capacity over any probe), `monotone_attainment`
  and `max_sustained_rate` (a mode's points read with attainment fitted non-increasing in rate),
  `window_span` (a point's window, for goodput).
* **Drift**: `drift_rows`, serve-only's last pass against its first; `combine_passes`.

* **Quality-weighted goodput** (QWG): one number for both halves of CoLLM's claim. Each request that
  met its SLOs counts the holdout-loss improvement over the base model of the adapter version that
  served it (each version's loss measured once on the same held-out set, `QualityJudge`):

      QWG = (1 / T) · Σ_{r met its SLO} (L_base − L(v_r))

  so a deployment scores by serving many requests on time *and* with a better model; a version
  worse than the base counts against it. A version the judge never scored (it was not a round's
  global) counts 0 and is reported.
* **Passes**: with `order: counterbalanced` every mode runs twice, A B C D then D C B A, so a drift
  in the machine's speed that is linear over the run weighs on every mode alike. A mode's points
  are the two passes pooled (request i of pass k pairs with request i of pass k of every other
  mode), and a ratio's interval is the paired bootstrap over the pooled requests widened to cover
  each pass's own ratio: the spread between passes is part of the doubt.
"""

from __future__ import annotations

import math

from collm.common.errors import UserError
from collm.common.stats import mean_ci, percentile, ratio_ci


# ----------------------------------------------------------------------------- quality-weighted goodput
def version_losses(served_loss: list[dict]) -> dict[int, float]:
    """Held-out loss by served adapter version (a mode's `served_loss` timeline: round 0 is the base)."""
    return {int(e["round"]): float(e["loss"]) for e in served_loss}


def quality_weights(outcomes: list[dict], met: list[float], losses: dict[int, float],
                    base_loss: float) -> tuple[list[float], int]:
    """Per request: (L_base − L(v)) if it met its SLO, else 0; and how many met requests were served by a
    version without a measured loss (counted 0)."""
    out, unknown = [], 0
    for o, m in zip(outcomes, met):
        if not m:
            out.append(0.0)
            continue
        v = o.get("version")
        loss = losses.get(int(v)) if v is not None else None
        if loss is None:
            unknown += 1
            out.append(0.0)
        else:
            out.append(base_loss - loss)
    return out, unknown


def add_quality(result: dict, base_loss: float, resamples: int) -> None:
    """Each point of one mode's pass gets `qw` (per-request weights), `qwg` (loss drop · req/s) and its
    95% interval, from the pass's own served-loss timeline (round numbers restart with every pass)."""
    losses = version_losses(result["served_loss"])
    for p in result["points"]:
        qw, unknown = quality_weights(p["outcomes"], p["slo_met"], losses, base_loss)
        _set_qwg(p, qw, unknown, resamples)


def _set_qwg(p: dict, qw: list[float], unknown: int, resamples: int) -> None:
    n, window = len(qw), p["window_s"]
    m, lo, hi = mean_ci(qw, resamples=resamples)
    p["qw"], p["qw_unknown_version"] = qw, unknown
    p["qwg"] = None if m is None else m * n / window
    p["qwg_ci"] = [None, None] if m is None else [lo * n / window, hi * n / window]


# ----------------------------------------------------------------------------- passes
def pool_points(points: list[dict], resamples: int) -> dict:
    """One load point measured in several passes (the same arrivals each time) as one point: requests
    concatenated in pass order, rates over the passes' windows together, latency percentiles over every
    completed request, training throughput the passes' mean."""
    first = points[0]
    met = [m for p in points for m in p["slo_met"]]
    outcomes = [o for p in points for o in p["outcomes"]]
    window = sum(p["window_s"] for p in points)
    n = len(met)
    att, lo, hi = mean_ci(met, resamples=resamples)
    done = [o for o in outcomes if o.get("miss") != "failed"]
    pooled = {
        "fraction": first["fraction"], "rate": n / window, "window_s": window, "requests": n,
        "completed": sum(p["completed"] for p in points), "failed": sum(p["failed"] for p in points),
        "slo_met": met, "slo_attainment": att, "attainment_ci": [lo, hi],
        "goodput_rps": sum(met) / window, "goodput_ci": [lo * n / window, hi * n / window],
        "throughput_rps": len(done) / window,
        "train_tokens": sum(p["train_tokens"] for p in points),
        "train_tokens_per_s": sum(p["train_tokens_per_s"] for p in points) / len(points),
        "outcomes": outcomes, "passes": len(points),
        "per_pass": [{k: p.get(k) for k in ("slo_attainment", "goodput_rps", "train_tokens_per_s", "qwg",
                                            "started_at")} for p in points],
    }
    for key, field in (("ttft", "ttft_s"), ("tpot", "tpot_s")):
        xs = [o[field] for o in done if o.get(field) is not None]
        for q in (50, 90, 99):
            pooled[f"{key}_p{q}"] = percentile(xs, q / 100)
    if all("qw" in p for p in points):
        _set_qwg(pooled, [w for p in points for w in p["qw"]], sum(p["qw_unknown_version"] for p in points),
                 resamples)
    return pooled


def pool_mode(passes: list[dict], resamples: int, target_attainment: float) -> dict:
    """A mode run in several passes as one result: pooled points and the max rate read from them, the
    passes' mean rounds and end loss (each pass starts from the base model), and each pass's own."""
    r = dict(passes[0])
    r["points"] = [pool_points(list(ps), resamples) for ps in zip(*(p["points"] for p in passes))]
    r["max_rate"] = max_sustained_rate(r["points"], target_attainment)
    r["rounds_completed"] = sum(p["rounds_completed"] for p in passes) / len(passes)
    r["final_loss"] = sum(p["final_loss"] for p in passes) / len(passes)
    r["passes"] = [{k: p.get(k) for k in ("rounds_completed", "final_loss", "served_loss", "wall_s", "startup_s",
                                          "max_rate", "versions_served")} for p in passes]
    return r


def widened_ratio(a: list[float], b: list[float], per_pass: list[tuple[list[float], list[float]]],
                  resamples: int) -> dict:
    """sum a / sum b over pooled requests with its paired bootstrap interval, widened to include every
    pass's own ratio; `per_pass` holds each pass's (a, b)."""
    r, lo, hi = ratio_ci(a, b, resamples=resamples)
    own = [sum(x) / sum(y) if sum(y) else None for x, y in per_pass]
    known = [v for v in own if v is not None and math.isfinite(v)]
    if r is not None and known:
        lo, hi = min([lo, *known]), max([hi, *known])
    return {"ratio": r, "ci": [lo, hi], "per_pass": own}


def split_passes(values: list[float], sizes: list[int]) -> list[list[float]]:
    """A pooled per-request list cut back into its passes (of `sizes` requests each)."""
    out, i = [], 0
    for n in sizes:
        out.append(values[i:i + n])
        i += n
    return out


# ----------------------------------------------------------------------------- reading a sweep
def window_span(last_arrival_s: float, n: int) -> float:
    """n arrivals from 0 to `last_arrival_s` span n / rate = last * n / (n - 1) seconds."""
    return last_arrival_s * n / (n - 1) if n >= 2 else 1.0


def search_capacity(probe, c) -> dict:
    """Grow the rate from `c.start_rate` by `c.growth` until attainment falls below the target, then
    bisect `c.refine` times; the capacity is where all probes, read as the load points are
    (`max_sustained_rate`), cross the target. With `c.confirm` a probe that fails is replayed once at
    the same rate and the rate judged on both: on a shared machine one slow minute can fail a probe
    that the same arrivals pass the next minute, and the whole run's load points would then be set
    too light. `probe(rate)` measures one rate and returns a point with `rate`, `slo_attainment` and
    `requests` (collm-bench over HTTP, collm-sim)."""
    probes: list[dict] = []
    target = c.target_attainment

    def passes(rate: float) -> bool:
        here = [probe(rate)]
        if here[0]["slo_attainment"] < target and c.confirm and len(probes) + 1 < c.max_probes:
            here.append(probe(rate))  # the same arrivals again
        probes.extend(here)
        return monotone_attainment(here)[0][1] >= target

    rate, passed, failed = c.start_rate, None, None  # the highest rate that passed, the lowest that failed
    while len(probes) < c.max_probes:
        if passes(rate):
            passed = rate
            if failed is not None:
                break
            rate *= c.growth
        else:
            failed = rate
            if passed is not None:
                break
            rate /= c.growth
    for _ in range(c.refine):
        if passed is None or failed is None or len(probes) >= c.max_probes:
            break
        rate = math.sqrt(passed * failed)
        if passes(rate):
            passed = rate
        else:
            failed = rate
    if passed is None:
        raise UserError(f"serve-only missed {target:.0%} attainment even at {probes[-1]['rate']:.3g} "
                        "req/s: lower capacity.start_rate or relax the SLOs (ttft_ms, tpot_ms)")
    if failed is None:
        rate = passed
        note = "no probe failed: capacity is at least this (raise capacity.max_probes or start_rate)"
    else:  # the bench's own reading of a sweep, over every probe (`max_sustained_rate`)
        rate = max_sustained_rate(probes, target)
        note = "where the probes' attainment, fitted non-increasing in rate, crosses the target"
    return {"rate": rate, "note": note, "probes": probes, "target_attainment": target}


def monotone_attainment(points: list[dict]) -> list[tuple[float, float]]:
    """(rate, attainment) per distinct rate, ascending: points at one rate (a repeated probe) are one,
    weighted by their requests; then fitted non-increasing by pool-adjacent-violators.
    Attainment cannot rise with load, so a point below a later one is noise; pooling weighs the two
    by their samples instead of trusting whichever comes first."""
    by_rate: dict[float, list[float]] = {}
    for p in points:
        w = float(p.get("requests") or 1)
        acc = by_rate.setdefault(p["rate"], [0.0, 0.0])
        acc[0] += (p["slo_attainment"] or 0.0) * w
        acc[1] += w
    rates = sorted(by_rate)
    blocks: list[list[float]] = []  # [weighted sum, weight, rates in block]
    for r in rates:
        blocks.append([*by_rate[r], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            s, w, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + s, blocks[-1][1] + w, blocks[-1][2] + n]
    return list(zip(rates, [b[0] / b[1] for b in blocks for _ in range(b[2])]))


def max_sustained_rate(points: list[dict], target: float) -> float:
    """Highest rate at which the fitted attainment (`monotone_attainment`) is >= target, interpolated
    between the last fitted pass and the first fitted fail (from (0, 1) below the first point)."""
    pts = monotone_attainment(points)
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0)] + pts, pts):
        if a1 >= target:
            best = r1
            continue
        if a0 >= target and a0 != a1:
            best = r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
        break
    return best


# ----------------------------------------------------------------------------- drift and passes
def drift_rows(first: list[dict], again: list[dict], resamples: int,
               others: dict[str, list[dict]] | None = None) -> list[dict]:
    """Serve-only measured twice, first and last, on the same arrivals: per point, the goodput ratio
    again / first with its paired 95% interval. An interval away from 1 means the machine's speed
    changed during the run, and every ratio between modes carries that much doubt. `others` (mode ->
    its points) adds each mode's goodput against the second pass too (`vs_again`), paired over the
    same requests, so a mode can be read against whichever serve-only pass ran on the faster machine."""
    rows = []
    for i, (a, b) in enumerate(zip(first, again)):
        r, lo, hi = ratio_ci(b["slo_met"], a["slo_met"], resamples=resamples)
        vs = {}
        for mode, points in (others or {}).items():
            vr, vlo, vhi = ratio_ci(points[i]["slo_met"], b["slo_met"], resamples=resamples)
            vs[mode] = {"ratio": vr, "ci": [vlo, vhi]}
        rows.append({"fraction": a["fraction"], "goodput_first": a["goodput_rps"], "goodput_again": b["goodput_rps"],
                     "attainment_first": a["slo_attainment"], "attainment_again": b["slo_attainment"],
                     "ratio": r, "ci": [lo, hi], "vs_again": vs})
    return rows


def combine_passes(results: dict, cfg) -> None:
    """Each mode's passes as its result (`bench_analysis.pool_mode`; one pass: itself), and the drift check:
    serve-only's last pass against its first (sequential: every other mode read against that last pass too)."""
    passes = results["passes"]
    for mode, rs in passes.items():
        pooled = len(rs) > 1 and (cfg.order == "counterbalanced" or mode != "serve-only")
        results["modes"][mode] = pool_mode(rs, cfg.bootstrap, cfg.capacity.target_attainment) if pooled else rs[0]
    so = passes.get("serve-only", [])
    if len(so) > 1:
        others = ({m: r["points"] for m, r in results["modes"].items() if m != "serve-only"}
                  if cfg.order == "sequential" else None)
        results["drift"] = drift_rows(so[0]["points"], so[-1]["points"], cfg.bootstrap, others)
    for mode, rs in passes.items():  # per-request lists live in the modes' points; the passes keep summaries
        for r in rs:
            if r is not results["modes"][mode]:
                for p in r["points"]:
                    for k in ("outcomes", "slo_met", "qw"):
                        p.pop(k, None)
