"""collm-bench's pure parts: the workload at a rate, capacity interpolation, intervals, the output folder."""

import pytest

from collm.common.errors import UserError
from collm.common.stats import mean_ci, ratio_ci
from collm.common.traces import TraceRequest, at_rate
from collm.lab.bench import Workload, max_sustained_rate, window_of
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
           {"rate": 3.0, "slo_attainment": 0.85}, {"rate": 4.0, "slo_attainment": 0.95}]
    assert max_sustained_rate(pts, 0.9) == pytest.approx(2.5)  # later points do not count after a miss
    assert max_sustained_rate(pts[:2], 0.9) == 2.0
    assert max_sustained_rate([{"rate": 1.0, "slo_attainment": 0.5}], 0.9) == pytest.approx(0.2)


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
