"""collm-sim against a real collm-bench run of the same setting: per mode and load point.

    collm-bench --config configs/bench.yaml --out runs/bench          # the real run (60-85 min)
    python benchmarks/sim_fidelity.py --real runs/bench/results.json --config configs/sim-fidelity.yaml

The simulation replays the real run's own load points: the same trace segments at the same
absolute rates (its capacity C is fixed to the real run's), so request i is the same arrival in
both. It also runs the simulator's own capacity search and prints it beside the real one.
Printed per point and mode: attainment (real, simulated, difference; target within +-0.07), the
same over serve-only's attainment at that point (a drift of the real machine's speed over the run
moves both alike), TTFT and TPOT p50/p90 (relative error; target 15%), training tokens/s; then
goodput collm/isolated real vs simulated (target within 15%). Writes the table to --md if given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from collm.common.config import load_config
from collm.common.stats import ratio_ci
from collm.lab.bench_report import read_results
from collm.sim.config import SimConfig
from collm.sim.run import capacity, load_requests, run_fleet


def rel(sim, real) -> str:
    if sim is None or real is None or real == 0:
        return "-"
    return f"{100 * (sim - real) / real:+.0f}%"


def calibrate(cfg: SimConfig, real: dict) -> tuple[SimConfig, str]:
    """The device speed (one factor on every profile) at which simulated serve-only TPOT p50 equals
    the real run's, averaged over its load points (bisection on log speed)."""
    import math

    n = real["config"]["replicas"]
    pts = real["modes"]["serve-only"]["points"]
    fixed = cfg.model_copy(update={"edges": n, "modes": ["serve-only"],
                                   "capacity": cfg.capacity.model_copy(update={"rate": real["capacity"]["rate"]}),
                                   "load": cfg.load.model_copy(update={"fractions": [q["fraction"] for q in pts]})})

    def error(speed: float) -> float:
        c = fixed.model_copy(update={"devices": [d.model_copy(update={"speed": d.speed * speed}) for d in cfg.devices]})
        sim = run_fleet(c, n, cfg.seed)["modes"]["serve-only"]["points"]
        return sum(math.log(s["tpot_p50"] / r["tpot_p50"]) for s, r in zip(sim, pts)) / len(pts)

    lo, hi = 0.4, 2.0
    for _ in range(14):
        mid = math.sqrt(lo * hi)
        if error(mid) < 0:  # simulated TPOT too short: the device is slower than the profile
            hi = mid
        else:
            lo = mid
    speed = math.sqrt(lo * hi)
    devices = [d.model_copy(update={"speed": d.speed * speed}) for d in cfg.devices]
    return cfg.model_copy(update={"devices": devices}), (
        f"Calibrated: speed x{speed:.3f} on every profile (serve-only TPOT p50 fitted; the other modes are held out).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", required=True, help="results.json (or .json.gz) of a collm-bench run")
    p.add_argument("--config", default="configs/sim-fidelity.yaml")
    p.add_argument("--md", help="also write the table here")
    p.add_argument("--seeds", type=int, default=3, help="simulations (seeds) to average the simulated figures over")
    p.add_argument("--calibrate", action="store_true",
                   help="first scale the profiles' speed so that serve-only's TPOT p50 matches the real run's (mean "
                        "over its points); the other modes are then held out")
    p.add_argument("--profile", help="simulate every edge with this profile (e.g. one benchmarks/profile_from_run.py fitted "
                   "to the real run's serve-only timelines) in place of the config's devices")
    p.add_argument("--interference", help="override the config's interference, as YAML: "
                   "'{per_machine: 2, slowdown: 0.05, ...}' (benchmarks/interference.py prints it)")
    args = p.parse_args(argv)
    try:
        real = read_results(args.real)
    except (OSError, ValueError) as e:
        p.error(f"--real: cannot read {args.real}: {e}")
    cfg = load_config(SimConfig, args.config)
    if args.profile:
        cfg = cfg.model_copy(update={"devices": [d.model_copy(update={"profile": args.profile, "speed": 1.0})
                                                 for d in cfg.devices]})
    if args.interference:
        import yaml

        from collm.sim.config import InterferenceConfig

        from pydantic import ValidationError

        from collm.common.config import format_validation_error

        try:
            inter = InterferenceConfig.model_validate(yaml.safe_load(args.interference))
        except (ValidationError, yaml.YAMLError) as e:
            msg = (format_validation_error("--interference", InterferenceConfig, e) if isinstance(e, ValidationError)
                   else f"--interference: not YAML: {e}")
            print(f"sim_fidelity: {msg}", file=sys.stderr)
            return 2
        cfg = cfg.model_copy(update={"interference": inter})
    note = ""
    if args.calibrate:
        cfg, note = calibrate(cfg, real)
    n = real["config"]["replicas"]
    fractions = [pt["fraction"] for pt in real["modes"]["serve-only"]["points"]]
    modes = [m for m in real["modes"] if m in cfg.modes or m == "serve-only"]
    own = capacity(cfg, load_requests(cfg), n, cfg.seed)["rate"]
    fixed = cfg.model_copy(update={
        "edges": n, "modes": modes,
        "capacity": cfg.capacity.model_copy(update={"rate": real["capacity"]["rate"]}),
        "load": cfg.load.model_copy(update={"fractions": fractions})})
    sims = [run_fleet(fixed.model_copy(update={"seed": cfg.seed + s}), n, cfg.seed + s) for s in range(args.seeds)]
    lines = ([note, ""] if note else []) + [f"Capacity (serve-only, >= {cfg.capacity.target_attainment:.0%}): real {real['capacity']['rate']:.3f} "
             f"req/s, simulated search {own:.3f} req/s ({rel(own, real['capacity']['rate'])}).", "",
             f"Simulated figures: mean over {args.seeds} seeds.", "",
             "| load | mode | attainment real / sim (diff) | over serve-only's real / sim (diff) | TTFT p50 real / sim | "
             "TTFT p90 real / sim | TPOT p50 real / sim | TPOT p90 real / sim | training tok/s real / sim |",
             "|---|---|---|---|---|---|---|---|---|"]

    def mean(key, mode, i):
        vals = [s["modes"][mode]["points"][i][key] for s in sims]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    worst = {"attainment": 0.0, "relative": 0.0}
    for i, f in enumerate(fractions):
        so_real = real["modes"]["serve-only"]["points"][i]["slo_attainment"]
        so_sim = mean("slo_attainment", "serve-only", i)
        for m in modes:
            rp = real["modes"][m]["points"][i]
            a_s = mean("slo_attainment", m, i)
            worst["attainment"] = max(worst["attainment"], abs(a_s - rp["slo_attainment"]))
            # Against serve-only at the same point: a drift of the real machine's speed over the run
            # (which the simulator does not have) moves both alike.
            rel_r = rp["slo_attainment"] / so_real if so_real else None
            rel_s = a_s / so_sim if so_sim else None
            if rel_r is not None and rel_s is not None:
                worst["relative"] = max(worst["relative"], abs(rel_s - rel_r))
                rel_cell = f"{rel_r:.3f} / {rel_s:.3f} ({rel_s - rel_r:+.3f})"
            else:
                rel_cell = "-"
            cells = []
            for key in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
                s_v, r_v = mean(key, m, i), rp[key]
                cells.append(f"{r_v:.3f} / {s_v:.3f} ({rel(s_v, r_v)})" if s_v is not None and r_v is not None
                             else "-")
            lines.append(f"| {f:g}x | {m} | {rp['slo_attainment']:.3f} / {a_s:.3f} ({a_s - rp['slo_attainment']:+.3f}) | "
                         f"{rel_cell} | " + " | ".join(cells) + f" | {rp['train_tokens_per_s']:.0f} / {mean('train_tokens_per_s', m, i):.0f} |")
    if "collm" in modes and "isolated" in modes:
        lines += ["", "| load | goodput collm/isolated real [95% CI] | sim (mean of seeds) | difference |", "|---|---|---|---|"]
        for i, f in enumerate(fractions):
            r, lo, hi = ratio_ci(real["modes"]["collm"]["points"][i]["slo_met"],
                                 real["modes"]["isolated"]["points"][i]["slo_met"])
            ss = [ratio_ci(s["modes"]["collm"]["points"][i]["slo_met"], s["modes"]["isolated"]["points"][i]["slo_met"],
                           resamples=200)[0] for s in sims]
            ss = [x for x in ss if x is not None]
            sv = sum(ss) / len(ss) if ss else None
            lines.append(f"| {f:g}x | {r:.2f} [{lo:.2f}, {hi:.2f}] | {sv:.2f} | {rel(sv, r)} |" if r and sv
                         else f"| {f:g}x | - | - | - |")
    lines += ["", f"Largest attainment difference: {worst['attainment']:.3f}; of attainment over serve-only's at the "
              f"same point: {worst['relative']:.3f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
