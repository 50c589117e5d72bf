"""collm-bench's outputs: results.json, report.md and four PNG plots (matplotlib, no display).

Runs kept under docs/ store their results.json gzipped (results.json.gz: a tenth of the size, so the tracked
tree stays small enough to carry); `read_results` reads either, and a path to X.json finds X.json.gz.

Ratios between modes are computed at each load point on the same requests (paired bootstrap over
request indices: request i is the same arrival in both modes), so their intervals are honest even
with tens of requests a point.
"""

from __future__ import annotations

import gzip
import json
import zlib
from contextlib import contextmanager
from pathlib import Path

from collm.lab.bench_analysis import split_passes, widened_ratio

COLORS = {"collm": "#2b7bba", "isolated": "#d95f02", "colocated-naive": "#7570b3", "serve-only": "#66a61e"}
VARIANT_COLORS = ("#1b9e77", "#e7298a", "#a6761d", "#666666")


def read_results(path: str | Path) -> dict:
    """A collm-bench results file: X.json, X.json.gz, or X.json given when only X.json.gz exists.
    OSError if neither exists or it cannot be read, ValueError if it is not JSON or a damaged gzip."""
    path = Path(path)
    if not path.exists() and path.suffix == ".json" and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return json.load(f)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # truncated, corrupt, or not gzip at all
            raise ValueError(f"{path}: not a readable gzip ({e})") from None
    return json.loads(path.read_text(encoding="utf-8"))


def ratio_pairs(modes) -> list[tuple[str, str]]:
    """Which modes are compared: collm against each baseline, and each collm variant against collm and the
    baselines (those whose modes ran). A run of variants only (an A/B of two settings, neither the default)
    reads each later variant against the first one listed."""
    pairs = [("collm", "isolated"), ("collm", "colocated-naive"), ("collm", "serve-only")]
    variants = [m for m in modes if m.startswith("collm-")]
    reference = "collm" if "collm" in modes or not variants else variants[0]
    for v in variants:
        pairs += [(v, reference)] if v != reference else []
        pairs += [(v, "isolated"), (v, "serve-only")]
    return pairs


def color(mode: str, modes) -> str | None:
    variants = [m for m in modes if m.startswith("collm-")]
    if mode in variants:
        return VARIANT_COLORS[variants.index(mode) % len(VARIANT_COLORS)]
    return COLORS.get(mode)


def _fmt(v, nd=3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ci(lo, hi, nd=2) -> str:
    return "" if lo is None or hi is None else f" [{lo:.{nd}f}, {hi:.{nd}f}]"


def point_ratios(results: dict, resamples: int) -> dict[str, list[dict]]:
    """Goodput, quality-weighted goodput and training-throughput ratios of collm to every other mode, per
    load point: paired over the same requests, and over pooled passes widened to each pass's own ratio
    (`bench_analysis.widened_ratio`)."""
    modes = results["modes"]
    out: dict[str, list[dict]] = {}
    for a, b in ratio_pairs(modes):
        if a not in modes or b not in modes:
            continue
        rows = []
        for pa, pb in zip(modes[a]["points"], modes[b]["points"]):
            k = pa.get("passes", 1)
            sizes = [len(pa["slo_met"]) // k] * k

            def ratio(key: str) -> dict:
                if key not in pa or key not in pb:
                    return {"ratio": None, "ci": [None, None], "per_pass": []}
                return widened_ratio(pa[key], pb[key], list(zip(split_passes(pa[key], sizes),
                                                                split_passes(pb[key], sizes))), resamples)

            good, quality = ratio("slo_met"), ratio("qw")
            train = (pa["train_tokens_per_s"] / pb["train_tokens_per_s"]) if pb["train_tokens_per_s"] > 0 else None
            rows.append({"fraction": pa["fraction"], "rate": pa["rate"], "goodput_ratio": good["ratio"],
                         "ci": good["ci"], "per_pass": good["per_pass"], "qwg_ratio": quality["ratio"],
                         "qwg_ci": quality["ci"], "train_ratio": train})
        out[f"{a}/{b}"] = rows
    return out


def _refused_late(p: dict, ttft_s: float) -> str:
    """Requests answered 429 (by the router's admission or an edge) / served with a first token past the
    TTFT target: where an admission change moves its misses. collm-sim's points count refusals only."""
    if "outcomes" not in p:
        return f"{p.get('refused', 0) + p.get('expired', 0)} / -" if "refused" in p else "-"
    oc = p["outcomes"]
    late = sum(1 for o in oc if o["status"] == 200 and o.get("ttft_s") is not None and o["ttft_s"] > ttft_s)
    return f"{sum(1 for o in oc if o['status'] == 429)} / {late}"


def write_report(results: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md", "goodput_png": out / "goodput.png",
             "attainment_png": out / "attainment_vs_load.png", "training_png": out / "training_vs_load.png",
             "loss_png": out / "served_loss.png", "tradeoff_png": out / "training_vs_goodput.png"}
    results["ratios"] = point_ratios(results, results["config"]["bootstrap"])
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    _plots(results, paths)
    paths["markdown"].write_text(_markdown(results, paths))
    return paths


@contextmanager
def _figure(path, title: str):
    """One 6x3.5 in chart: yields its axes, then titles, lays out, saves at 120 dpi and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    try:
        yield ax
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _plots(results: dict, paths: dict) -> None:
    modes = results["modes"]
    cap = results["capacity"]["rate"]

    def x(p) -> float:
        return p["rate"] / cap

    with _figure(paths["goodput_png"], "Goodput against offered load (95% CI)") as ax:
        for m, r in modes.items():
            pts = r["points"]
            ax.plot([x(p) for p in pts], [p["goodput_rps"] for p in pts], marker="o", label=m, color=color(m, modes))
            ax.fill_between([x(p) for p in pts], [p["goodput_ci"][0] for p in pts], [p["goodput_ci"][1] for p in pts],
                            alpha=0.2, color=color(m, modes))
        _again(ax, results, x, "goodput_again")
        ax.set_xlabel("offered load (x serve-only capacity)")
        ax.set_ylabel("goodput (req/s meeting every SLO)")
        ax.legend()

    with _figure(paths["attainment_png"], "SLO attainment against offered load (95% CI)") as ax:
        for m, r in modes.items():
            pts = r["points"]
            ax.errorbar([x(p) for p in pts], [p["slo_attainment"] for p in pts], marker="o", label=m,
                        color=color(m, modes), capsize=3,
                        yerr=[[p["slo_attainment"] - p["attainment_ci"][0] for p in pts],
                              [p["attainment_ci"][1] - p["slo_attainment"] for p in pts]])
        _again(ax, results, x, "attainment_again")
        ax.axhline(results["capacity"]["target_attainment"], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("offered load (x serve-only capacity)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.legend()

    with _figure(paths["training_png"], "Training throughput against offered load") as ax:
        for m, r in modes.items():
            if m == "serve-only":
                continue
            pts = r["points"]
            ax.plot([x(p) for p in pts], [p["train_tokens_per_s"] for p in pts], marker="o", label=m,
                    color=color(m, modes))
        ax.set_xlabel("offered load (x serve-only capacity)")
        ax.set_ylabel("training tokens/s (all replicas)")
        ax.legend()

    with _figure(paths["loss_png"], "Quality of the served model over time") as ax:
        for m, r in modes.items():
            for k, run in enumerate(r.get("passes") or [r]):  # counterbalanced: each pass, the second dashed
                pts = run["served_loss"]
                end = run.get("wall_s") or max(p["t"] for p in pts)
                xs = [max(p["t"], 0.0) for p in pts] + [end]
                ys = [p["loss"] for p in pts] + [pts[-1]["loss"]]
                ax.step(xs, ys, where="post", label=m if k == 0 else f"{m} (pass {k + 1})", color=color(m, modes),
                        linestyle="-" if k == 0 else "--")
        ax.set_xlabel("seconds after the mode's first load point started")
        ax.set_ylabel("served adapter: held-out loss")
        ax.legend(fontsize=7)

    _tradeoff_plot(results, paths["tradeoff_png"])


def _tradeoff_plot(results: dict, path) -> None:
    """Training tokens/s against goodput, one panel per load point, one marker per mode: a mode up and
    to the right of another dominates it (serves more on time and adapts more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    fractions = [p["fraction"] for p in next(iter(modes.values()))["points"]]
    fig, axes = plt.subplots(1, len(fractions), figsize=(3 * len(fractions), 3.2), squeeze=False)
    try:
        for i, (ax, f) in enumerate(zip(axes[0], fractions)):
            for m, r in modes.items():
                p = r["points"][i]
                lo, hi = p["goodput_ci"]
                ax.errorbar([p["goodput_rps"]], [p["train_tokens_per_s"]], capsize=3, marker="o", color=color(m, modes),
                            label=m, xerr=[[p["goodput_rps"] - lo], [hi - p["goodput_rps"]]])
            ax.set_title(f"{f:g}× capacity", fontsize=9)
            ax.set_xlabel("goodput (req/s)", fontsize=8)
            if i == 0:
                ax.set_ylabel("training tokens/s", fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0][0].legend(fontsize=7)
        fig.suptitle("Training against goodput per load point (up and right dominates)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _again(ax, results: dict, x, key: str) -> None:
    """The drift check's second serve-only pass, dashed: how far serve-only itself moved during the run."""
    if results.get("drift") and "serve-only" in results["modes"]:
        pts = results["modes"]["serve-only"]["points"]
        ax.plot([x(p) for p in pts], [d[key] for d in results["drift"]], marker="o", linestyle="--",
                color=COLORS["serve-only"], alpha=0.6, label="serve-only (again, at the end)")


def _passes(per_pass) -> str:
    """A ratio's own value in each pass (counterbalanced runs), after its pooled interval."""
    if not per_pass or len(per_pass) < 2:
        return ""
    return " (passes " + ", ".join(_fmt(v, 2) for v in per_pass) + ")"


def _quality_section(results: dict, fractions: list[float]) -> list[str]:
    """Quality-weighted goodput per point and mode, beside goodput and training throughput, and its ratios."""
    modes = results["modes"]
    if not modes or "qwg" not in next(iter(modes.values()))["points"][0]:
        return []  # results from before it was measured
    lines = ["", "## Quality-weighted goodput", "",
             "Each request that met its SLOs counts the held-out loss drop (base model minus the adapter version "
             "that served it) per second: serving on time *and* with a better model. Base loss "
             f"{results['base_loss']:.4f}. QWG is goodput times the mean loss drop of the met requests' versions, "
             "so a QWG ratio is the goodput ratio times the ratio of that drop: it says which of serving and the "
             "model a difference comes from.", "",
             "| load | mode | goodput (req/s) | loss drop per met request | QWG (loss drop · req/s) | training tok/s |",
             "|---|---|---|---|---|---|"]
    for i, f in enumerate(fractions):
        for m, r in modes.items():
            p = r["points"][i]
            lo, hi = p.get("qwg_ci") or (None, None)
            unknown = f" ({p['qw_unknown_version']} by unscored versions)" if p.get("qw_unknown_version") else ""
            drop = p["qwg"] / p["goodput_rps"] if p.get("qwg") is not None and p["goodput_rps"] else None
            lines.append(f"| {f:g}× | {m} | {_fmt(p['goodput_rps'])} | {_fmt(drop, 4)} | "
                         f"{_fmt(p['qwg'], 4)}{_ci(lo, hi, 4)}{unknown} | "
                         f"{p['train_tokens_per_s']:.0f} |")
    ratios = {k: v for k, v in results["ratios"].items() if any(row.get("qwg_ratio") is not None for row in v)}
    if ratios:
        lines += ["", "| load | " + " | ".join(f"QWG {k}" for k in ratios) + " |", "|---|" + "---|" * len(ratios)]
        for i, f in enumerate(fractions):
            lines.append(f"| {f:g}× | " + " | ".join(
                f"{_fmt(rows[i]['qwg_ratio'], 2)}{_ci(*rows[i]['qwg_ci'])}" for rows in ratios.values()) + " |")
    return lines


def _order_line(results: dict) -> str:
    if not results.get("order"):
        return ""  # results from before the order was kept
    pooled = (results["config"].get("order") == "counterbalanced"  # and (an interrupted run's) every mode ran twice
              and all(len(rs) > 1 for rs in results.get("passes", {}).values()))
    return (f"Modes ran in this order: {', '.join(results['order'])}"
            + ("; each mode's numbers pool its two passes, and each ratio's interval also covers both passes' own "
               "ratios." if pooled else "."))


def _markdown(results: dict, paths: dict) -> str:
    cfg, modes, cap = results["config"], results["modes"], results["capacity"]
    t = cfg["trace"]
    where = ("simulated edges (collm-sim: CoLLM's own policy code on measured edge profiles)"
             if results.get("simulated") else "replicas on one machine (each pinned to its own cores)")
    lines = [
        "# collm-sim report" if results.get("simulated") else "# collm-bench report", "",
        f"Model `{cfg['model']}`, {cfg['replicas']} {where}, every "
        f"mode on the same replicas, arrivals and SLOs (TTFT ≤ {cfg['ttft_ms']:g} ms, TPOT ≤ {cfg['tpot_ms']:g} ms). "
        f"Wall time {results['wall_s']:.0f} s.", "",
        f"Trace: {t['path'] or 'shipped Azure LLM conv trace (CC BY 4.0)'} from {t['start_s']:g} s, token counts "
        f"×{t['token_scale']:g} clipped to prompt ≤ {t['max_prompt_tokens']} and output "
        f"{t['min_output_tokens']}–{t['max_output_tokens']} tokens; each load point is a fresh segment of the trace "
        f"with its arrival times scaled to the point's mean rate (bursts kept). Intervals are 95% bootstrap "
        f"({cfg['bootstrap']} resamples); ratios use a paired bootstrap over the same requests.", "",
        _order_line(results), "",
        f"**Serve-only capacity: {cap['rate']:.3f} req/s** at ≥ {cap['target_attainment']:.0%} attainment "
        f"({cap['note']}).", "",
    ]
    if cap.get("probes"):
        lines += ["| probe | rate (req/s) | requests | attainment |", "|---|---|---|---|"]
        lines += [f"| {p['probe']} | {p['rate']:.3f} | {p['requests']} | {_fmt(p['slo_attainment'])}"
                  f"{_ci(*p['attainment_ci'])} |" for p in cap["probes"]]
        lines.append("")
    so = modes.get("serve-only")
    if so and cap.get("probes") and so.get("max_rate", 0) > 1.05 * cap["rate"]:
        lines += [f"Serve-only's own load points sustained {so['max_rate']:.3f} req/s ({so['max_rate'] / cap['rate']:.2f} "
                  "× the capacity the probes found): the probes measured it low, so every point is lighter than "
                  "its name.", ""]
    lines += ["## Every load point", "",
              "| load | mode | rate (req/s) | requests | refused / late first token | attainment | goodput (req/s) | "
              "TTFT p50/p90 (s) | TPOT p50/p90 (s) | training tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    fractions = [p["fraction"] for p in next(iter(modes.values()))["points"]] if modes else []
    ttft_s = cfg["ttft_ms"] / 1000
    for i, f in enumerate(fractions):
        for m, r in modes.items():
            p = r["points"][i]
            lines.append(
                f"| {f:g}× | {m} | {p['rate']:.3f} | {p['requests']} | {_refused_late(p, ttft_s)} | "
                f"{_fmt(p['slo_attainment'])}"
                f"{_ci(*p['attainment_ci'])} | {_fmt(p['goodput_rps'])}{_ci(*p['goodput_ci'], nd=3)} | "
                f"{_fmt(p['ttft_p50'], 2)}/{_fmt(p['ttft_p90'], 2)} | {_fmt(p['tpot_p50'], 3)}/{_fmt(p['tpot_p90'], 3)} "
                f"| {p['train_tokens_per_s']:.0f} |")
    lines += ["", "## Goodput ratios (same requests, paired 95% CI)", "",
              "| load | " + " | ".join(results["ratios"]) + " |", "|---|" + "---|" * len(results["ratios"])]
    for i, f in enumerate(fractions):
        cells = []
        for rows in results["ratios"].values():
            row = rows[i]
            cells.append(f"{_fmt(row['goodput_ratio'], 2)}{_ci(*row['ci'])}{_passes(row.get('per_pass'))}")
        lines.append(f"| {f:g}× | " + " | ".join(cells) + " |")
    if "collm/isolated" in results["ratios"]:
        lines += ["", "Training throughput collm/isolated per point: " + ", ".join(
            f"{row['fraction']:g}× {_fmt(row['train_ratio'], 2)}" for row in results["ratios"]["collm/isolated"])]
    lines += _quality_section(results, fractions)
    if results.get("drift"):
        vs_modes = list(results["drift"][0].get("vs_again", {}))  # absent in results from before it was kept
        lines += ["", "## Drift check", "",
                  "Modes run one after another; serve-only ran again at the end on the same arrivals. A ratio "
                  "between modes is good only to within how far this moved; the last columns read each mode against the "
                  "second pass (paired over the same requests).", "",
                  "| load | serve-only goodput first | again | again / first | attainment first → again |"
                  + "".join(f" {m} / again |" for m in vs_modes),
                  "|---|---|---|---|---|" + "---|" * len(vs_modes)]
        for d in results["drift"]:
            lines.append(f"| {d['fraction']:g}× | {_fmt(d['goodput_first'])} | {_fmt(d['goodput_again'])} | "
                         f"{_fmt(d['ratio'], 2)}{_ci(*d['ci'])} | {_fmt(d['attainment_first'])} → "
                         f"{_fmt(d['attainment_again'])} |" + "".join(
                             f" {_fmt(d['vs_again'][m]['ratio'], 2)}{_ci(*d['vs_again'][m]['ci'])} |"
                             for m in vs_modes))
    lines += ["", "## Per mode", "", f"| mode | max rate ≥ {cap['target_attainment']:.0%} (req/s) | × capacity | "
              "rounds | served loss start → end | startup (s) |", "|---|---|---|---|---|---|"]
    for m, r in modes.items():
        runs = r.get("passes") or [r]  # pooled passes: each pass's own rounds and end loss
        rounds = " / ".join(f"{x['rounds_completed']:g}" for x in runs)
        ends = " / ".join(f"{x['final_loss']:.4f}" for x in runs)
        startup = " / ".join(f"{x['startup_s']}" for x in runs)
        lines.append(f"| {m} | {r['max_rate']:.3f} | {r['max_rate'] / cap['rate']:.2f} | {rounds} | "
                     f"{r['served_loss'][0]['loss']:.4f} → {ends} | {startup} |")
    lines += ["", "Max rate: where a mode's attainment over the load points, fitted non-increasing in load "
              "(adjacent points pooled by their requests where a lighter point did worse), crosses the target. "
              "With passes, rounds and end loss are given per pass (a / b); the max rate is read from the pooled "
              "points."]
    lines += ["", f"![goodput]({paths['goodput_png'].name})", f"![attainment]({paths['attainment_png'].name})",
              f"![training]({paths['training_png'].name})", f"![training against goodput]({paths['tradeoff_png'].name})",
              f"![served loss]({paths['loss_png'].name})", ""]
    return "\n".join(lines) + "\n"
