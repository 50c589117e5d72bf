"""collm-bench's pure parts: the workload at a rate, capacity interpolation, intervals, the output folder."""

import math

import pytest

from collm.common.errors import UserError
from collm.common.stats import mean_ci, ratio_ci
from collm.common.traces import TraceRequest, at_rate
from collm.lab.bench_workload import Workload, window_of
from collm.lab.bench_analysis import max_sustained_rate, monotone_attainment
from collm.lab.bench_config import BenchConfig
from collm.lab.topology import prepare_out


def test_a_higher_load_is_the_same_workload_faster():
    w = Workload(BenchConfig())
    slow, fast = w.segment(2.0, 10, 10), w.segment(4.0, 10, 10)
    assert len(slow) == 20 and len(fast) == 40
    assert [(r.prompt_tokens, r.output_tokens) for r in fast[:20]] == [(r.prompt_tokens, r.output_tokens)
                                                                       for r in slow]
    assert (len(fast) - 1) / fast[-1].arrival_s == pytest.approx(4.0)  # the mean rate asked for
    plan = w.plan(fast, "m")
    assert window_of(plan) == pytest.approx(len(plan) / 4.0)
    assert plan[3].body["max_tokens"] == fast[3].output_tokens and plan[3].body["slo"]["ttft_ms"] == 1000


def test_at_rate_keeps_the_shape_of_bursts():
    trace = [TraceRequest(t, 10, 5) for t in (0.0, 0.1, 0.2, 5.0)]
    out = at_rate(trace, 1.0)
    assert out[-1].arrival_s == pytest.approx(3.0)
    assert out[1].arrival_s / out[-1].arrival_s == pytest.approx(0.1 / 5.0)


def test_max_sustained_rate_interpolates_between_pass_and_fail():
    pts = [{"rate": 1.0, "slo_attainment": 1.0}, {"rate": 2.0, "slo_attainment": 0.95},
           {"rate": 3.0, "slo_attainment": 0.8}, {"rate": 4.0, "slo_attainment": 0.7}]
    assert max_sustained_rate(pts, 0.9) == pytest.approx(2.0 + 0.05 / 0.15)
    assert max_sustained_rate(pts[:2], 0.9) == 2.0
    assert max_sustained_rate([{"rate": 1.0, "slo_attainment": 0.5}], 0.9) == pytest.approx(0.2)


def test_max_sustained_rate_weighs_a_dip_against_the_passes_above_it():
    """Attainment cannot rise with load: a dip followed by passes is pooled with them by their request
    counts (collm in the 2026-12-02 run: 0.872 at 0.8 x C, then 0.974 and 0.957), not a stop."""
    run = [{"rate": 0.29, "slo_attainment": 1.0, "requests": 40}, {"rate": 0.78, "slo_attainment": 0.872, "requests": 94},
           {"rate": 0.97, "slo_attainment": 0.974, "requests": 117}, {"rate": 1.17, "slo_attainment": 0.957, "requests": 140}]
    fitted = monotone_attainment(run)
    assert [a for _, a in fitted][1:] == pytest.approx([(0.872 * 94 + 0.974 * 117 + 0.957 * 140) / 351] * 3)
    assert all(a >= b for (_, a), (_, b) in zip(fitted, fitted[1:]))
    assert max_sustained_rate(run, 0.9) == 1.17  # the pooled 0.94 passes up to the last point
    # a real dip: pooled below the target, the crossing falls inside the pooled block's first segment
    dip = [{"rate": 1.0, "slo_attainment": 1.0, "requests": 50}, {"rate": 2.0, "slo_attainment": 0.6, "requests": 50},
           {"rate": 3.0, "slo_attainment": 0.9, "requests": 50}]
    assert max_sustained_rate(dip, 0.9) == pytest.approx(1.0 + 0.1 / 0.25)  # pooled 0.75 at 2 and 3


def test_intervals():
    m, lo, hi = mean_ci([1.0] * 90 + [0.0] * 10, seed=1)
    assert m == 0.9 and lo < 0.9 < hi and hi - lo < 0.15
    r, lo, hi = ratio_ci([1.0] * 50, [1.0] * 25 + [0.0] * 25, seed=1)
    assert r == 2.0 and lo < 2.0 < hi
    assert ratio_ci([1.0], [0.0]) == (None, None, None)


def test_output_folders_are_never_wiped_by_accident(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep").write_text("precious")
    with pytest.raises(UserError, match="not empty"):
        prepare_out(mine, overwrite=False)
    with pytest.raises(UserError, match="refusing"):
        prepare_out(mine, overwrite=True)  # not a folder a CoLLM run made
    assert (mine / "keep").read_text() == "precious"
    run = prepare_out(tmp_path / "run", overwrite=False)
    (run / "results.json").write_text("{}")
    with pytest.raises(UserError, match="--overwrite"):
        prepare_out(run, overwrite=False)
    prepare_out(run, overwrite=True)
    assert not (run / "results.json").exists() and (run / ".collm-run").is_file()


def test_capacity_search_reads_its_probes_as_the_load_points_are_read():
    """search_capacity grows, bisects, then takes the monotone crossing of all probes: exact on a
    linear curve, and a probe that failed below one that passed is pooled with it, not believed alone."""
    from collm.lab.bench_analysis import search_capacity
    from collm.lab.bench_config import CapacityConfig

    c = CapacityConfig(start_rate=4, growth=1.5, refine=1, max_probes=6, target_attainment=0.9, confirm=False)
    curve = lambda r: min(1.0, 1.3 - 0.05 * r)  # noqa: E731  crosses 0.9 at 8 req/s
    cap = search_capacity(lambda r: {"rate": r, "slo_attainment": curve(r), "requests": 50}, c)
    assert [p["rate"] for p in cap["probes"]] == pytest.approx([4, 6, 9, math.sqrt(54)])
    assert cap["rate"] == pytest.approx(8.0)
    # noise: the bisection probe at 7.35 fails worse (0.70) than the 9 req/s probe above it (0.89); the two
    # are pooled (0.795) instead of taking 7.35's alone as the first failure
    noisy = {round(math.sqrt(54), 6): 0.70, 9.0: 0.89}
    cap = search_capacity(lambda r: {"rate": r, "slo_attainment": noisy.get(round(r, 6), curve(r)), "requests": 50}, c)
    assert cap["rate"] == pytest.approx(6 + (math.sqrt(54) - 6) * 0.1 / 0.205)


def test_a_failed_capacity_probe_is_replayed_before_the_search_turns_back():
    """capacity.confirm: one unlucky probe (a slow minute) does not set the capacity: the same rate is
    probed again and judged on both together; a real failure fails twice and costs one probe more."""
    from collm.lab.bench_analysis import search_capacity
    from collm.lab.bench_config import CapacityConfig

    c = CapacityConfig(start_rate=4, growth=1.5, refine=1, max_probes=8, target_attainment=0.9)
    curve = lambda r: min(1.0, 1.3 - 0.05 * r)  # noqa: E731  crosses 0.9 at 8 req/s
    calls: list[float] = []

    def probe(r):
        calls.append(r)
        unlucky = r == 6 and calls.count(6) == 1  # the first try at 6 req/s ran on a slowed machine
        return {"rate": r, "slo_attainment": 0.82 if unlucky else curve(r), "requests": 50}

    cap = search_capacity(probe, c)
    assert calls == pytest.approx([4, 6, 6, 9, 9, math.sqrt(54)])  # 6 again (0.82 + 1.0 pass), 9 twice (fails)
    # the unlucky try still counts, weighed with its replay: 6 req/s at 0.91 (100 requests) pools with 7.35 at
    # 0.9325 (50) to 0.9175, and the crossing lies between 7.35 and 9 (0.85), short of the curve's 8
    pooled = (0.91 * 100 + curve(math.sqrt(54)) * 50) / 150
    assert cap["rate"] == pytest.approx(math.sqrt(54) + (9 - math.sqrt(54)) * (pooled - 0.9) / (pooled - 0.85))
    calls.clear()
    off = search_capacity(probe, c.model_copy(update={"confirm": False}))  # the unlucky probe stands alone
    assert off["rate"] < 6


# ------------------------------------------------------------------ passes and quality-weighted goodput
def _point(fraction, met, versions, window=10.0, train=50.0, tpot=0.1):
    outcomes = [{"at": float(i), "status": 200, "ttft_s": 0.5, "tpot_s": tpot, "tokens": 8, "version": v,
                 "edge": "e", "miss": None if m else "tpot", "soonest_ttft_s": None}
                for i, (m, v) in enumerate(zip(met, versions))]
    n = len(met)
    return {"fraction": fraction, "rate": n / window, "window_s": window, "requests": n, "completed": n, "failed": 0,
            "slo_met": [float(m) for m in met], "slo_attainment": sum(met) / n, "attainment_ci": [0, 1],
            "goodput_rps": sum(met) / window, "goodput_ci": [0, 1], "train_tokens": train * window,
            "train_tokens_per_s": train, "outcomes": outcomes, "ttft_p50": 0.5, "ttft_p90": 0.5, "tpot_p50": tpot,
            "tpot_p90": tpot, "started_at": 0.0}


def _mode(mode, met, versions, losses, train=50.0, rounds=2):
    served = [{"t": 10.0 * r, "round": r, "loss": loss} for r, loss in enumerate(losses)]
    return {"mode": mode, "replicas": 2, "startup_s": 1.0, "points": [_point(0.5, met, versions, train=train)],
            "max_rate": 1.0, "versions_served": sorted(set(versions)), "rounds_completed": rounds, "reloads": [],
            "wall_s": 30.0, "served_loss": served, "final_loss": losses[-1]}


def test_quality_weighted_goodput_credits_each_met_request_with_its_versions_loss_drop():
    from collm.lab.bench_analysis import add_quality

    r = _mode("collm", met=[1, 1, 0, 1], versions=[0, 1, 2, 7], losses=[2.5, 2.3, 2.1])
    add_quality(r, base_loss=2.5, resamples=200)
    p = r["points"][0]
    # version 0 (the base) gains 0, version 1 gains 0.2; the miss counts nothing; version 7 was never scored
    assert p["qw"] == pytest.approx([0.0, 0.2, 0.0, 0.0]) and p["qw_unknown_version"] == 1
    assert p["qwg"] == pytest.approx(0.2 / 10.0)
    assert p["qwg_ci"][0] <= p["qwg"] <= p["qwg_ci"][1]
    worse = _mode("x", met=[1], versions=[1], losses=[2.5, 2.7])  # a version worse than the base counts against
    add_quality(worse, base_loss=2.5, resamples=200)
    assert worse["points"][0]["qwg"] == pytest.approx(-0.2 / 10.0)


def test_counterbalanced_order_runs_every_mode_twice_mirrored():
    from collm.lab.bench import run_order

    modes = ["serve-only", "collm", "isolated"]
    assert run_order(modes, "counterbalanced", False) == modes + modes[::-1]
    assert run_order(modes, "sequential", True) == modes + ["serve-only"]
    assert run_order(modes, "sequential", False) == modes
    assert run_order(["serve-only"], "sequential", True) == ["serve-only"]


def test_pooled_passes_and_ratios_widened_to_each_passs_own():
    from collm.lab.bench_analysis import combine_passes
    from collm.lab.bench_analysis import add_quality, widened_ratio
    from collm.lab.bench_report import write_report

    # pass 1 ran on a fast machine, pass 2 on a slow one: collm met 8/8 then 4/8, serve-only 8/8 then 6/8
    passes = {"serve-only": [_mode("serve-only", [1] * 8, [0] * 8, [2.5], train=0.0, rounds=0),
                             _mode("serve-only", [1] * 6 + [0] * 2, [0] * 8, [2.5], train=0.0, rounds=0)],
              "collm": [_mode("collm", [1] * 8, [1] * 8, [2.5, 2.4], train=80.0),
                        _mode("collm", [1] * 4 + [0] * 4, [1] * 8, [2.5, 2.3], train=40.0)]}
    slow = passes["collm"][1]["points"][0]["outcomes"]  # two of pass 2's misses: one refused, one late (1 s target)
    slow[5].update(status=429, ttft_s=None, tpot_s=None, miss="failed")
    slow[6].update(ttft_s=10.0, miss="ttft")
    for rs in passes.values():
        for r in rs:
            add_quality(r, 2.5, 200)
    cfg = BenchConfig(order="counterbalanced", bootstrap=200)
    results = {"config": cfg.model_dump(mode="json"), "base_loss": 2.5, "modes": {}, "passes": passes,
               "order": ["serve-only (pass 1)", "collm (pass 1)", "collm (pass 2)", "serve-only (pass 2)"],
               "capacity": {"rate": 1.6, "note": "test", "probes": [], "target_attainment": 0.9}, "wall_s": 1.0}
    combine_passes(results, cfg)
    collm = results["modes"]["collm"]["points"][0]
    assert collm["requests"] == 16 and collm["passes"] == 2
    assert collm["slo_attainment"] == pytest.approx(12 / 16) and collm["goodput_rps"] == pytest.approx(12 / 20)
    assert collm["train_tokens_per_s"] == pytest.approx(60.0)
    assert collm["qwg"] == pytest.approx((8 * 0.1 + 4 * 0.2) / 20)  # each pass by its own version's loss
    assert results["drift"][0]["ratio"] == pytest.approx(6 / 8)  # serve-only's last pass against its first
    assert "outcomes" not in passes["collm"][0]["points"][0]  # per-request lists only in the pooled points
    w = widened_ratio(collm["slo_met"], results["modes"]["serve-only"]["points"][0]["slo_met"],
                      [([1.0] * 8, [1.0] * 8), ([1.0] * 4 + [0.0] * 4, [1.0] * 6 + [0.0] * 2)], 200)
    assert w["ratio"] == pytest.approx(12 / 14) and w["per_pass"] == pytest.approx([1.0, 4 / 6])
    assert w["ci"][0] <= 4 / 6 and w["ci"][1] >= 1.0  # the interval covers both passes' own ratios
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        paths = write_report(results, Path(d))
        report = paths["markdown"].read_text()
        assert "## Quality-weighted goodput" in report and "(passes 1.00, 0.67)" in report
        # QWG split into goodput and the mean drop of the met requests' versions: (8 x 0.1 + 4 x 0.2) / 12 met
        assert "| 0.5× | collm | 0.600 | 0.1333 | 0.0800" in report
        assert "Modes ran in this order: serve-only (pass 1), collm (pass 1)" in report
        assert "| 0.5× | collm | 0.800 | 16 | 1 / 1 |" in report  # refused / late first token, both passes
        assert "| 0.5× | serve-only | 0.800 | 16 | 0 / 0 |" in report
        assert paths["tradeoff_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = results["ratios"]["collm/serve-only"][0]
    assert row["goodput_ratio"] == pytest.approx(12 / 14) and row["ci"] == pytest.approx(w["ci"])


def test_bursts_keep_the_mean_rate_and_crowd_arrivals_into_the_on_phases():
    from collm.common.traces import bursts
    from collm.lab.bench_config import TraceConfig

    even = [TraceRequest(float(i), 10, 4) for i in range(600)]  # 1 req/s
    b = bursts(even, period_s=30.0, peak=2.5, duty=0.3)
    assert [r.prompt_tokens for r in b] == [10] * 600 and all(x.arrival_s <= y.arrival_s for x, y in zip(b, b[1:]))
    assert b[-1].arrival_s == pytest.approx(599.0, abs=30.0)  # the mean rate is kept (to within a period)
    on = sum(1 for r in b if r.arrival_s % 30.0 < 9.0)  # the first 30% of each period
    assert on / len(b) == pytest.approx(0.75, abs=0.03)  # 2.5 x 0.3 of the arrivals
    with pytest.raises(ValueError, match="peak"):
        bursts(even, 30.0, 4.0, 0.3)
    with pytest.raises(UserError, match="trace.burst.peak"):
        from collm.common.config import validate_config

        validate_config(BenchConfig, {"trace": {"burst": {"peak": 4.0, "duty": 0.3}}}, "test")
    seg = TraceConfig(burst={"period_s": 30.0, "peak": 2.5, "duty": 0.3}).segment(even, 2.0, 100.0, 10)
    assert len(seg) == 200 and seg[-1].arrival_s == pytest.approx(99.5, abs=15.0)


def test_a_collm_variant_is_named_by_config_and_compared_with_collm_and_the_baselines():
    from pydantic import ValidationError

    from collm.lab.bench_config import router_policy, variant_of
    from collm.lab.bench_report import ratio_pairs

    cfg = BenchConfig.model_validate({"modes": ["collm", "collm-noadmit", "isolated"],
                                      "variants": {"noadmit": {"router": {"routing": {"admission": False}}}}})
    assert variant_of("collm-noadmit", cfg.variants).router == {"routing": {"admission": False}}
    assert variant_of("collm", cfg.variants).router == {} and variant_of("isolated", cfg.variants).edge == {}
    assert router_policy("collm-noadmit", "slo") == "slo" and router_policy("isolated", "slo") == "round_robin"
    assert ("collm-noadmit", "collm") in ratio_pairs(["serve-only", "collm", "collm-noadmit"])
    only_variants = ratio_pairs({"serve-only": {}, "collm-new": {}, "collm-before": {}, "isolated": {}})
    assert ("collm-before", "collm-new") in only_variants and ("collm-new", "collm-new") not in only_variants
    assert ("collm-new", "isolated") in only_variants and ("collm-before", "serve-only") in only_variants
    with pytest.raises(ValidationError, match="collm-pack' is not a mode.*named: collm-noadmit"):
        BenchConfig.model_validate({"modes": ["collm-pack"], "variants": {"noadmit": {}}})


def test_a_variants_edge_settings_win_over_what_the_bench_sets(tmp_path):
    """The bench sets training.max_eval_records (and co_schedule, busy_share) on every edge; a variant that
    changes one of them must reach its edges, and only its edges (it used to be merged first and lost)."""
    from collm.lab.bench_topology import ModeRun

    cfg = BenchConfig.model_validate({"modes": ["collm", "collm-eval4"], "federation": {"eval_records": 8},
                                      "variants": {"eval4": {"edge": {"training": {"max_eval_records": 4}}}}})
    variant = ModeRun(cfg, "collm-eval4", tmp_path / "v")
    plain = ModeRun(cfg, "collm", tmp_path / "c")
    assert [e.training.max_eval_records for e in variant.edges] == [4, 4]
    assert [e.training.max_eval_records for e in plain.edges] == [8, 8]
    assert variant.edges[0].training.co_schedule == cfg.co_schedule  # the rest of what the bench sets stays


def test_a_variants_server_settings_reach_its_serverapp_only(tmp_path):
    from collm.common.config import validate_config
    from collm.lab.bench_topology import ModeRun
    from collm.server.config import ServerConfig

    cfg = BenchConfig.model_validate({"modes": ["collm", "collm-slowpoll"],
                                      "federation": {"round_deadline_s": 20, "lr": 2e-3, "lr_decay": 0.8, "lr_min": 5e-4},
                                      "variants": {"slowpoll": {"server": {"reply_poll_s": 3,
                                                                           "balancer": {"spare_use": 0.5}}}}})
    variant = validate_config(ServerConfig, ModeRun(cfg, "collm-slowpoll", tmp_path / "v").server_config("m"), "v")
    plain = validate_config(ServerConfig, ModeRun(cfg, "collm", tmp_path / "c").server_config("m"), "c")
    assert (variant.reply_poll_s, variant.balancer.spare_use) == (3, 0.5)
    assert (plain.reply_poll_s, plain.balancer.spare_use) == (ServerConfig().reply_poll_s, ServerConfig().balancer.spare_use)
    assert variant.balancer.round_deadline_s == plain.balancer.round_deadline_s == 20  # the bench's settings stay
    assert (plain.balancer.lr, plain.balancer.lr_decay, plain.balancer.lr_min) == (2e-3, 0.8, 5e-4)
    with pytest.raises(UserError, match=r"lr_min \(0.002\) is above lr \(0.001\): set federation.lr_min"):
        validate_config(BenchConfig, {"federation": {"lr": 1e-3, "lr_min": 2e-3}}, "test")
    with pytest.raises(UserError, match=r"variants.low.server.balancer: lr 0.0002 is below the floor lr_min 0.0005"):
        validate_config(BenchConfig, {"modes": ["collm", "collm-low"],
                                      "variants": {"low": {"server": {"balancer": {"lr": 2e-4}}}}}, "test")


def test_the_ceiling_is_serve_onlys_idle_time_over_the_isolated_trainers_busy_time():
    """benchmarks/timeline_report.py's last table: what a co-located deployment could train against the
    isolated trainer from serve-only's idle time alone, beside what each co-located mode spent and got."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from timeline_report import ceiling_rows

    def row(f, k, replica, step=0.0, train=0.0, eval=0.0):
        return {"fraction": f, "pass": k, "replica": replica, "step": step, "train": train, "eval": eval,
                "other": 1.0 - step - train - eval}

    by_mode = {
        "serve-only": [row(0.3, 1, "serve0", step=0.6), row(0.3, 1, "serve1", step=0.6),    # idle 0.8 ...
                       row(0.3, 2, "serve0", step=0.5), row(0.3, 2, "serve1", step=0.5),    # ... and 1.0: 0.9
                       row(0.8, 1, "serve0", step=0.97), row(0.8, 1, "serve1", step=0.97)],
        "isolated": [row(0.3, 1, "serve0", step=0.85), row(0.3, 1, "train1", train=0.8, eval=0.15),
                     row(0.8, 1, "serve0", step=0.99), row(0.8, 1, "train1", train=0.9, eval=0.05)],
        "collm": [row(0.3, 1, "serve-train0", step=0.5, train=0.35, eval=0.1),
                  row(0.3, 1, "serve-train1", step=0.5, train=0.35, eval=0.1),
                  row(0.8, 1, "serve-train0", step=0.96, train=0.02), row(0.8, 1, "serve-train1", step=0.94)],
    }
    results = {"modes": {"isolated": {"points": [{"fraction": 0.3, "train_tokens_per_s": 80.0},
                                                 {"fraction": 0.8, "train_tokens_per_s": 80.0}]},
                         "collm": {"points": [{"fraction": 0.3, "train_tokens_per_s": 70.0},
                                              {"fraction": 0.8, "train_tokens_per_s": 8.0}]}}}
    low, high = ceiling_rows(by_mode, results)
    assert (low["fraction"], low["mode"]) == (0.3, "collm")
    assert low["idle"] == pytest.approx(0.9) and low["trainer"] == pytest.approx(0.95)  # passes averaged
    assert low["ceiling"] == pytest.approx(0.9 / 0.95) and low["own"] == pytest.approx(0.9)
    assert low["measured"] == pytest.approx(70 / 80)
    assert high["ceiling"] == pytest.approx(0.06 / 0.95) and high["own"] == pytest.approx(0.02)
    assert high["measured"] == pytest.approx(0.1)
    assert ceiling_rows({"collm": by_mode["collm"], "isolated": by_mode["isolated"]}, results) == []


def test_a_run_kept_gzipped_reads_back_by_either_name(tmp_path):
    """docs/ keeps each run's results.json gzipped; the tools that read a run (estimate_report, sim_fidelity,
    timeline_report) take X.json.gz, or the X.json name it was written under, and read the same dict."""
    import gzip
    import json

    from collm.lab.bench_report import read_results

    results = {"config": {"ttft_ms": 3000}, "modes": {"collm": {"points": [{"fraction": 0.3, "goodput": 1.5}]}}}
    plain = tmp_path / "plain" / "results.json"
    plain.parent.mkdir()
    plain.write_text(json.dumps(results))
    kept = tmp_path / "kept" / "results.json"
    kept.parent.mkdir()
    with gzip.open(kept.with_name("results.json.gz"), "wt") as f:
        json.dump(results, f)
    assert read_results(plain) == read_results(kept) == read_results(f"{kept}.gz") == results
    with pytest.raises(OSError):
        read_results(tmp_path / "none" / "results.json")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a readable gzip"):
        read_results(tmp_path / "bad.json.gz")
    whole = gzip.compress(json.dumps(results).encode())
    (tmp_path / "cut.json.gz").write_bytes(whole[: len(whole) // 2])  # truncated: EOFError inside gzip
    with pytest.raises(ValueError, match="not a readable gzip"):
        read_results(tmp_path / "cut.json.gz")


def test_replot_refuses_what_it_cannot_draw_in_one_line_and_leaves_no_folder(tmp_path):
    """`collm-bench --replot`: a partial run, another JSON, a damaged gzip or a folder that holds the results
    are one-line errors naming the problem; the output folder is neither made nor touched."""
    import gzip
    import json

    from collm.lab.bench import replot

    run = tmp_path / "run"
    (run / "collm").mkdir(parents=True)
    (run / "collm" / "timeline-serve-train0.jsonl").write_text("{}\n")
    partial = run / "results.partial.json"
    partial.write_text(json.dumps({"config": {}, "modes": {}, "passes": {"collm": []}}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "damaged.json.gz").write_bytes(gzip.compress(b'{"modes": {}}')[:-12] + b"\x00" * 12)
    shaped = tmp_path / "shaped.json"
    shaped.write_text(json.dumps({"config": {}, "modes": {"collm": {"points": []}}}))
    out = tmp_path / "out"
    for path, said in [(partial, "no finished mode"), (tmp_path / "list.json", "no modes / config"),
                       (tmp_path / "damaged.json.gz", "cannot read"), (shaped, "not a finished collm-bench run"),
                       (tmp_path / "none.json", "cannot read")]:
        with pytest.raises(UserError, match=said):
            replot(str(path), str(out), overwrite=False)
        assert not out.exists()
    with pytest.raises(UserError, match="--out"):
        replot(str(partial), None, overwrite=False)
    for inside in (run, tmp_path):  # the run's own folder, or one above it: never emptied by --overwrite
        with pytest.raises(UserError, match="holds the results"):
            replot(str(partial), str(inside), overwrite=True)
    assert (run / "collm" / "timeline-serve-train0.jsonl").is_file()


def test_step_context_groups_decode_steps_by_what_ran_before_and_by_the_served_version(tmp_path, capsys):
    """benchmarks/step_context.py: a decode step is filed under what ended just before it on the same replica
    (a step, a unit by job and kind, or an idle gap over 50 ms) and under before / after the replica's first
    federated publish (its own adapter's publishes, version "local", and the initial version 0 do not count);
    prefill steps are left out; `--around` files the steps near that publish by the neighbour's state as
    interference.Busy reads it. A folder without timelines, or a non-positive --around, is a one-line error."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from interference import Busy
    from step_context import after_what, around_version, by_version, main

    def step(t, s, dec=2, pf=0):
        return {"ev": "step", "t": t, "s": s, "dec": dec, "pf": pf, "att": 100, "run": dec, "wait": 0}

    events = [{"ev": "publish", "t": 0.0, "s": 0.01, "version": 0, "source": "initial"},
              step(1.0, 0.1), step(1.1, 0.2),                                   # after a step
              {"ev": "unit", "t": 1.3, "s": 0.05, "job": "train", "unit": "backward", "tok": 50, "why": "x"},
              step(1.35, 0.3),                                                  # after a training unit
              step(2.0, 0.4),                                                   # after an idle gap
              step(2.5, 0.3, dec=0, pf=64),                                     # prefill: left out
              {"ev": "publish", "t": 3.0, "s": 0.01, "version": "local", "source": "local"},
              step(3.1, 0.5, dec=1),                                            # still before version 1
              {"ev": "publish", "t": 4.0, "s": 0.01, "version": 1, "source": "federated"},
              step(4.1, 0.6, dec=6)]
    assert dict(after_what(events)) == {("2", "step"): [0.2], ("2", "train backward"): [0.3],
                                        ("2", "idle gap"): [0.4], ("1", "idle gap"): [0.5],
                                        ("5-8", "idle gap"): [0.6]}
    assert dict(by_version(events)) == {("2", "before"): [0.1, 0.2, 0.3, 0.4], ("1", "before"): [0.5],
                                        ("5-8", "after"): [0.6]}
    # the same-load view: steps within `seconds` of version 1 (published at 4.01), by what the neighbour did
    # during the step (interference.Busy: serving or background for 90% of it, idle under 5%, else left out)
    neighbour = Busy([step(0.99, 0.13),                                           # covers 1.0-1.1, 10% of 1.1-1.3
                      {"ev": "unit", "t": 4.0, "s": 0.8, "job": "train", "unit": "forward", "tok": 64, "why": "idle"}])
    assert dict(around_version(events, neighbour, 3.5)) == {
        ("2", "before", "serve"): [0.1], ("2", "before", "idle"): [0.3, 0.4], ("1", "before", "idle"): [0.5],
        ("5-8", "after", "background"): [0.6]}  # the step beside a mix (0.2) is left out
    assert ("2", "before", "serve") not in around_version(events, neighbour, 2.0)  # 3 s before: outside
    assert dict(around_version(events, None, 3.5))[("5-8", "after", "none")] == [0.6]
    assert around_version(events[:2], neighbour, 3.5) == {}  # no federated version: nothing to split
    (tmp_path / "collm").mkdir()
    (tmp_path / "collm" / "timeline-e0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "collm" / "timeline-e1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events[1:3]))
    assert main([str(tmp_path)]) == 0
    capsys.readouterr()
    assert main([str(tmp_path), "--around", "0"]) == 2
    assert "--around must be a positive" in capsys.readouterr().err
    assert main([str(tmp_path / "collm")]) == 2
    assert "no mode folder with timeline" in capsys.readouterr().err


def test_version_steps_refuses_a_bad_plan_and_an_unreadable_checkpoint_before_loading_the_model(tmp_path, capsys):
    """benchmarks/version_steps.py: an unknown --plan action and a checkpoint that is not a safetensors file are
    one-line errors naming the option, before minutes go into loading SmolLM2."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from version_steps import main

    bad = tmp_path / "adapter_model.safetensors"
    bad.write_text("not a safetensors file")
    assert main([str(bad), "--plan", "serve,swap"]) == 2
    assert "--plan: unknown action(s) ['swap']" in capsys.readouterr().err
    assert main([str(bad), "--plan", "serve,train:once,serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("version_steps: checkpoint: cannot read") and err.count("\n") == 1


def test_a_load_fraction_must_be_positive():
    from pydantic import ValidationError

    for bad in (0, -0.5, float("nan")):
        with pytest.raises(ValidationError, match="load.fractions"):
            BenchConfig.model_validate({"load": {"fractions": [bad, 0.8]}})


def test_every_modes_configs_are_checked_before_anything_runs(tmp_path):
    """A variant's typo in its server, edge or router settings was reported only when its mode started, after
    serve-only's capacity search; now main checks every mode's configs first."""
    from collm.lab.bench_topology import check_mode_configs

    base = {"model": "tiny", "modes": ["collm", "collm-x", "isolated"], "out": str(tmp_path / "o")}
    check_mode_configs(BenchConfig.model_validate({**base, "variants": {"x": {"server": {"reply_poll_s": 0.5}}}}))
    for where, typo, said in [("server", {"reply_pol_s": 3}, "collm-x's server config: reply_pol_s: unknown key"),
                              ("edge", {"training": {"lrr": 1}}, "training.lrr: unknown key"),
                              ("router", {"routing": {"polcy": "slo"}}, "collm-x's router config: routing.polcy")]:
        with pytest.raises(UserError, match=said):
            check_mode_configs(BenchConfig.model_validate({**base, "variants": {"x": {where: typo}}}))


def test_the_lab_finds_its_configs_from_any_folder(tmp_path, monkeypatch):
    from collm.lab.topology import edge_config, repo_file

    monkeypatch.chdir(tmp_path)  # a run started outside the checkout
    assert repo_file("configs/server.yaml").is_file()
    assert edge_config("tiny", "e0", tmp_path, categories=["open_qa"]).name == "e0"
    with pytest.raises(UserError, match="run the lab tools from the CoLLM repository root"):
        repo_file("configs/none.yaml")


@pytest.mark.slow
def test_a_second_interrupt_cannot_cut_the_cleanup_short(tmp_path):
    """^C during ProcessGroup.stop() aborted the wait and left the rest of the topology running (pinned to
    cores, holding ports); now the cleanup finishes, the handlers come back, and then the ^C stops the run."""
    import os
    import signal
    import sys
    import threading
    import time

    from collm.lab.topology import ProcessGroup

    (tmp_path / "logs").mkdir()
    g = ProcessGroup(tmp_path)
    slow_exit = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: (time.sleep(3.0), sys.exit(0)))\n" \
                "print('up', flush=True)\ntime.sleep(60)\n"
    p = g.spawn("slow", [sys.executable, "-c", slow_exit])
    deadline = time.time() + 20
    while "up" not in (tmp_path / "logs" / "slow.log").read_text() and time.time() < deadline:
        time.sleep(0.05)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with ^C ignored
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # a second ^C while stop() waits
        with pytest.raises(KeyboardInterrupt):  # delivered once the cleanup is done, not lost
            g.stop(grace_s=10)
        assert p.poll() == 0  # it ended on its own, 3 s after its SIGTERM: the wait was not cut short
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
