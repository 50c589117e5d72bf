"""collm-bench's analysis of measured points, as pure functions over its result dicts (no processes).

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


def pool_mode(passes: list[dict], resamples: int) -> dict:
    """A mode run in several passes as one result: pooled points, and each pass's rounds and served loss."""
    r = dict(passes[0])
    r["points"] = [pool_points(list(ps), resamples) for ps in zip(*(p["points"] for p in passes))]
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
