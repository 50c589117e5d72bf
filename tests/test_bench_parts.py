"""collm-bench's pure parts: the workload at a rate, capacity interpolation, intervals, the output folder."""

import math

import pytest

from collm.common.errors import UserError
from collm.common.stats import mean_ci, ratio_ci
from collm.common.traces import TraceRequest, at_rate
from collm.lab.bench import Workload, max_sustained_rate, monotone_attainment, window_of
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
    from collm.lab.bench import search_capacity
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
    from collm.lab.bench import search_capacity
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
