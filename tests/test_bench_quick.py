"""`collm-bench` quick preset end to end: capacity search, four modes on real processes, report, JSON, plots."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from collm.lab.bench_analysis import max_sustained_rate

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODES = ["collm", "isolated", "colocated-naive", "serve-only"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick"
    proc = subprocess.run([str(BIN / "collm-bench"), "--config", "configs/bench-quick.yaml", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes of the benchmark still running: {leftovers}"
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_report_json_and_plots_are_written(bench):
    out, results = bench
    for name in ["report.md", "goodput.png", "attainment_vs_load.png", "training_vs_load.png", "served_loss.png"]:
        assert (out / name).stat().st_size > 0, name
    assert (out / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for mode in MODES:
        assert f"| {mode} |" in report
    assert set(results["modes"]) == set(MODES)
    assert "Serve-only capacity" in report and "paired 95% CI" in report
    # drift check: serve-only ran again last, on the same points, and the report says how far it moved
    drift = results["drift"]
    assert [d["fraction"] for d in drift] == results["config"]["load"]["fractions"]
    for d in drift:
        assert d["goodput_first"] >= 0 and d["goodput_again"] >= 0
        if d["ratio"] is not None:
            assert d["ci"][0] <= d["ratio"] <= d["ci"][1]
            assert abs(d["ratio"] - d["goodput_again"] / d["goodput_first"]) < 1e-9
    # and every other mode is read against that second pass too, paired over the same requests
    drift_rows = [line for line in report.split("## Drift check")[1].split("\n## ")[0].splitlines()
                  if line.startswith("| ") and "×" in line]
    assert len(drift_rows) == len(drift)
    checked = 0
    for i, d in enumerate(drift):
        assert set(d["vs_again"]) == set(MODES) - {"serve-only"}
        cells = [c.strip() for c in drift_rows[i].strip("|").split("|")]
        for j, (mode, v) in enumerate(d["vs_again"].items()):
            if v["ratio"] is not None:
                assert abs(v["ratio"] - results["modes"][mode]["points"][i]["goodput_rps"] / d["goodput_again"]) < 1e-9
                assert v["ci"][0] <= v["ratio"] <= v["ci"][1]
                assert cells[5 + j] == f"{v['ratio']:.2f} [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]"  # its own column
                checked += 1
    assert checked, "no mode had a ratio against the second pass"
    assert "## Drift check" in report
    for r in results["modes"].values():  # each request's miss reason agrees with its SLO verdict
        for p in r["points"]:
            assert [o["miss"] is None for o in p["outcomes"]] == [m == 1.0 for m in p["slo_met"]]
    # the slo router says what TTFT it estimated (X-CoLLM-Soonest-TTFT); round robin estimates nothing
    collm = [o for p in results["modes"]["collm"]["points"] for o in p["outcomes"] if o["status"] == 200]
    assert collm and all(o["soonest_ttft_s"] > 0 for o in collm)
    assert all(o["soonest_ttft_s"] is None for p in results["modes"]["serve-only"]["points"] for o in p["outcomes"])


@pytest.mark.slow
def test_every_mode_replays_the_same_points_and_the_numbers_hold_together(bench):
    _, results = bench
    cap = results["capacity"]
    assert cap["rate"] > 0 and cap["probes"] and all(0 <= p["slo_attainment"] <= 1 for p in cap["probes"])
    fractions = results["config"]["load"]["fractions"]
    requests = {m: [p["requests"] for p in r["points"]] for m, r in results["modes"].items()}
    assert len({tuple(v) for v in requests.values()}) == 1  # the same plans in every mode
    for mode, m in results["modes"].items():
        pts = m["points"]
        assert [p["fraction"] for p in pts] == fractions
        assert [p["rate"] for p in pts] == sorted(p["rate"] for p in pts)
        for p, f in zip(pts, fractions):
            assert p["rate"] == pytest.approx(f * cap["rate"], rel=1e-6)
            # nothing fails but what an edge sheds as too late (429): the naive baseline, which trains flat out,
            # may make requests wait past their TTFT target
            failures = [o["status"] for o in p["outcomes"] if o["status"] != 200]
            assert failures == [] or (mode == "colocated-naive" and set(failures) == {429}), (mode, p["fraction"], failures)
            lo, hi = p["attainment_ci"]
            assert lo <= p["slo_attainment"] <= hi
            assert p["goodput_rps"] <= p["rate"] + 1e-9 and len(p["slo_met"]) == p["requests"]
            assert p["ttft_p50"] <= p["ttft_p99"] and p["tpot_p50"] <= p["tpot_p99"]
        assert m["max_rate"] == pytest.approx(max_sustained_rate(pts, cap["target_attainment"]))
        assert all(math.isfinite(p["loss"]) for p in m["served_loss"])
    for ratio, rows in results["ratios"].items():
        for row in rows:
            lo, hi = row["ci"]
            assert lo <= row["goodput_ratio"] <= hi, ratio


@pytest.mark.slow
def test_training_modes_train_and_serve_only_does_not(bench):
    _, results = bench
    base = results["base_loss"]
    for mode in ["collm", "isolated"]:
        assert results["modes"][mode]["rounds_completed"] >= 1, mode
    m = results["modes"]["collm"]  # its edges serve each global adapter as soon as they evaluate it
    assert m["served_loss"][-1]["round"] >= 1 and m["final_loss"] != base
    naive = results["modes"]["colocated-naive"]  # trains flat out: its rounds may not finish in a short window
    assert naive["rounds_completed"] >= 1 or sum(p["train_tokens"] for p in naive["points"]) > 0
    iso = results["modes"]["isolated"]  # its serving replica serves a round only once it has reloaded it
    assert [p["round"] for p in iso["served_loss"][1:]] == sorted({x["round"] for x in iso["reloads"]
                                                                    if x["status"] == 200})
    so = results["modes"]["serve-only"]
    assert so["rounds_completed"] == 0 and so["final_loss"] == base
    assert all(p["train_tokens"] == 0 for p in so["points"])


@pytest.mark.slow
def test_every_replica_writes_a_timeline_that_accounts_for_its_requests(bench):
    """timeline: true: one timeline per replica, named by its edge, and timeline_report splits every
    served request's life into shares of what its replica did (steps, training, evaluation, neither)."""
    out, results = bench
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timeline_report import KINDS, load_mode, point_rows, replica_rows

    for mode, r in results["modes"].items():
        loaded = load_mode(results, out, mode)
        assert len(loaded) == 1, mode  # a sequential run: one pass of every mode it reports
        points, timelines = loaded[0]
        assert set(timelines) == set(r["roles"]), mode  # the edges' names
        rows = point_rows(loaded)
        served = sum(1 for p in points for o in p["outcomes"] if o["ttft_s"] is not None)
        assert sum(row["n"] for row in rows) == served, mode
        for row in rows:  # every served request overlaps its own prefill and decode steps on its replica
            assert 0 < row["step"] <= 1 and all(row[k] >= 0 for k in KINDS), (mode, row)
            if mode == "serve-only":
                assert row["train"] == row["eval"] == 0, row
        shares = replica_rows(loaded)  # each replica's whole window: every point, every replica
        assert len(shares) == len(points) * len(timelines), mode
        for row in shares:
            assert sum(row[k] for k in KINDS) == pytest.approx(1.0), (mode, row)
            assert "serve" in r["roles"][row["replica"]] or row["step"] == 0, (mode, row)  # a trainer never steps
            assert mode != "serve-only" or row["train"] == row["eval"] == 0, row
        for p in points:  # someone served each point
            assert max(x["step"] for x in shares if x["fraction"] == p["fraction"]) > 0, (mode, p["fraction"])

    def train_units(mode):
        return sum(1 for _, tls in load_mode(results, out, mode) for tl in tls.values()
                   for *_, kind, _ in tl.spans if kind == "train")

    assert train_units("collm") > 0 and train_units("isolated") > 0 and train_units("serve-only") == 0


@pytest.mark.slow
def test_a_kept_run_replots_to_the_same_report(bench, tmp_path):
    """docs/ keeps a run's results gzipped and few of its plots: `collm-bench --replot` draws the report and
    plots again from the results alone, and the report says what the run's own said."""
    import gzip
    import shutil

    out, _ = bench
    kept = tmp_path / "kept" / "results.json.gz"
    kept.parent.mkdir()
    with open(out / "results.json", "rb") as src, gzip.open(kept, "wb") as dst:
        shutil.copyfileobj(src, dst)
    again = tmp_path / "again"
    proc = subprocess.run([str(BIN / "collm-bench"), "--replot", str(kept.with_suffix("")), "--out", str(again)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (again / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
    proc = subprocess.run([str(BIN / "collm-bench"), "--replot", str(kept)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--replot: give --out" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_an_interrupted_run_keeps_what_finished_and_replots_its_finished_modes(bench, tmp_path):
    """The run keeps results.partial.json after its capacity, every point and every mode; an interrupted run's
    file (here: the last mode in progress, two of its points done) draws its finished modes with --replot."""
    out, results = bench
    partial = json.loads((out / "results.partial.json").read_text())
    assert "in_progress" not in partial and set(partial["passes"]) == set(MODES)  # the last write: every mode
    last = partial["order"][-1].split(" (pass")[0]
    cut = dict(partial, order=partial["order"][:-1], in_progress={"mode": last, "points": [{}, {}]},
               passes={m: rs[:-1] if m == last else rs for m, rs in partial["passes"].items()})
    (tmp_path / "results.partial.json").write_text(json.dumps(cut))
    again = tmp_path / "again"
    proc = subprocess.run([str(BIN / "collm-bench"), "--replot", str(tmp_path / "results.partial.json"), "--out",
                           str(again)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = (again / "report.md").read_text()
    drawn = {m for m, rs in cut["passes"].items() if rs}
    assert "interrupted run" in proc.stdout and all(f"| {m} |" in report for m in drawn)
    # stopped after serve-only's second pass but (say) before its report: passes of unequal count, first ones drawn
    (tmp_path / "uneven.json").write_text(json.dumps(partial))
    proc = subprocess.run([str(BIN / "collm-bench"), "--replot", str(tmp_path / "uneven.json"), "--out",
                           str(tmp_path / "uneven")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "drawing each mode's first" in proc.stdout, proc.stdout + proc.stderr[-2000:]
