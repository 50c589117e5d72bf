"""The benchmark's outputs: results.json, report.md and three PNG plots (matplotlib, no display)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path


def _fmt(v, nd=3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or not b:
        return None
    return a / b


def write_report(results: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md", "goodput_png": out / "goodput.png",
             "sweep_png": out / "attainment_vs_rate.png", "loss_png": out / "served_loss.png"}
    modes = results["modes"]
    results["ratios"] = {
        f"collm/{m}": ratio(modes["collm"]["window"]["goodput_rps"], modes[m]["window"]["goodput_rps"])
        for m in modes if "collm" in modes and m != "collm"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str))
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
    names = list(modes)
    with _figure(paths["goodput_png"], "Goodput per deployment, same replicas and trace") as ax:
        vals = [modes[m]["window"]["goodput_rps"] or 0.0 for m in names]
        bars = ax.bar(names, vals, color=["#2b7bba" if m == "collm" else "#9aa5b1" for m in names])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel("goodput (req/s meeting every SLO)")

    with _figure(paths["sweep_png"], "SLO attainment against request rate") as ax:
        for m in names:
            pts = sorted((p["rate"], p["slo_attainment"] or 0.0) for p in modes[m]["sweep"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.axhline(results["config"]["sweep"]["target_attainment"], color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.legend()

    with _figure(paths["loss_png"], "Quality of the served model over time") as ax:
        for m in names:
            pts = modes[m]["served_loss"]
            end = modes[m].get("wall_s") or max(p["t"] for p in pts)
            xs = [max(p["t"], 0.0) for p in pts] + [end]
            ys = [p["loss"] for p in pts] + [pts[-1]["loss"]]
            ax.step(xs, ys, where="post", label=m)
        ax.set_xlabel("seconds after the window started")
        ax.set_ylabel("served adapter: held-out loss")
        ax.legend()


def _markdown(results: dict, paths: dict) -> str:
    cfg, modes = results["config"], results["modes"]
    t = cfg["trace"]
    lines = [
        "# collm-bench report", "",
        f"Model `{cfg['model']}`, {cfg['replicas']} replicas on one machine, every mode on the same replicas, "
        f"trace and SLOs (TTFT ≤ {cfg['ttft_ms']:g} ms, TPOT ≤ {cfg['tpot_ms']:g} ms). Wall time {results['wall_s']:.0f} s.",
        "",
        f"Trace: {t['path'] or 'shipped Azure LLM conv trace (CC BY 4.0)'}, from {t['start_s']:g} s, speed ×{t['speed']:g}, "
        f"token counts ×{t['token_scale']:g} clipped to prompt ≤ {t['max_prompt_tokens']} and output "
        f"{t['min_output_tokens']}–{t['max_output_tokens']} tokens; window {cfg['window_s']:g} s per mode; "
        f"sweep factors {cfg['sweep']['factors']} × {cfg['sweep']['seconds']:g} s.", "",
        "| mode | goodput (req/s) | SLO attainment | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (s) | E2E p99 (s) | "
        "max rate ≥ {:.0%} (req/s) | training tokens | rounds | served loss (start → end) |".format(
            cfg["sweep"]["target_attainment"]),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in modes.items():
        w = r["window"]
        lines.append(
            f"| {m} | {_fmt(w['goodput_rps'])} | {_fmt(w['slo_attainment'])} | "
            f"{_fmt(w['ttft_p50'], 2)}/{_fmt(w['ttft_p90'], 2)}/{_fmt(w['ttft_p99'], 2)} | "
            f"{_fmt(w['tpot_p50'], 3)}/{_fmt(w['tpot_p90'], 3)}/{_fmt(w['tpot_p99'], 3)} | {_fmt(w['e2e_p99'], 2)} | "
            f"{_fmt(r['max_rate'], 2)} | {r['train']['tokens']:.0f} | {r['rounds_completed']} | "
            f"{r['served_loss'][0]['loss']:.4f} → {r['final_loss']:.4f} |")
    lines += ["", "Goodput ratios (same run): " + ", ".join(
        f"{k} = {_fmt(v, 2)}" for k, v in results["ratios"].items()), ""]
    lines += [f"![goodput]({paths['goodput_png'].name})", f"![attainment vs rate]({paths['sweep_png'].name})",
              f"![served loss]({paths['loss_png'].name})", ""]
    lines += ["## Rate sweep", "", "| mode | rate (req/s) | attainment | goodput (req/s) |", "|---|---|---|---|"]
    for m, r in modes.items():
        for p in r["sweep"]:
            lines.append(f"| {m} | {p['rate']:.2f} | {_fmt(p['slo_attainment'])} | {_fmt(p['goodput_rps'])} |")
    return "\n".join(lines) + "\n"
