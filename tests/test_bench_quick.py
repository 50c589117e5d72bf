"""`collm-bench` quick preset end to end: four modes on real processes, report, JSON and plots."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODES = ["collm", "isolated", "colocated-naive", "serve-only"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick"
    proc = subprocess.run([str(BIN / "collm-bench"), "--config", "configs/bench-quick.yaml", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes of the benchmark still running: {leftovers}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_report_json_and_plots_are_written(bench):
    out, results = bench
    for name in ["report.md", "goodput.png", "attainment_vs_rate.png", "served_loss.png"]:
        assert (out / name).stat().st_size > 0, name
    assert (out / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for mode in MODES:
        assert f"| {mode} |" in report
    assert set(results["modes"]) == set(MODES)


@pytest.mark.slow
def test_numbers_are_sane(bench):
    _, results = bench
    base = results["base_loss"]
    assert math.isfinite(base) and base > 0
    for mode, m in results["modes"].items():
        w = m["window"]
        assert w["requests"] > 0 and w["failed"] == 0, mode
        assert 0.0 <= w["slo_attainment"] <= 1.0
        assert 0.0 < w["goodput_rps"] <= w["throughput_rps"] + 1e-9
        assert w["ttft_p50"] <= w["ttft_p99"] and w["tpot_p50"] <= w["tpot_p99"]
        assert m["sweep"] and m["max_rate"] >= 0
        assert all(math.isfinite(p["loss"]) for p in m["served_loss"])
    # the training modes completed a round and served its adapter; serve-only never trained
    for mode in ["collm", "isolated", "colocated-naive"]:
        m = results["modes"][mode]
        assert m["rounds_completed"] >= 1 and m["train"]["tokens"] > 0, mode
        assert m["served_loss"][-1]["round"] >= 1 and m["final_loss"] != base, mode
    so = results["modes"]["serve-only"]
    assert so["rounds_completed"] == 0 and so["train"]["tokens"] == 0 and so["final_loss"] == base
    assert set(results["ratios"]) >= {"collm/isolated", "collm/colocated-naive"}
