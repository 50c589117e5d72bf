"""Federated rounds end to end: a real flower-superlink, the ServerApp (collm-server) and 2 collm-edge
processes on the tiny model, under request load, started and stopped by `collm-lab`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from collm.common.protocol import EVAL_KEYS, TRAIN_KEYS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab") / "run"
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "collm-lab"), "--model", "tiny", "--edges", "2", "--rounds", "2",
                           "--load", "2", "--no-router", "--round-deadline", "12", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    return proc, out


def test_lab_completes_and_stops_cleanly(lab):
    proc, out = lab
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished:completed" in proc.stdout
    leftovers = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "lab processes left running"


def test_global_adapter_changes_every_round(lab):
    _, out = lab
    r1 = load_file(out / "checkpoints" / "round-0001" / "adapter_model.safetensors")
    r2 = load_file(out / "checkpoints" / "round-0002" / "adapter_model.safetensors")
    assert r1.keys() == r2.keys() and len(r1) > 0
    assert any(not (r1[k] == r2[k]).all() for k in r1)
    b_keys = [k for k in r1 if "lora_B" in k]
    assert any(r1[k].abs().sum() > 0 for k in b_keys)  # round 1 moved away from the zero-B start


def test_serving_version_steps_up_each_round_and_no_request_failed(lab):
    _, out = lab
    report = json.loads((out / "lab.json").read_text())
    assert report["load"]["sent"] > 20 and report["load"]["failed"] == 0
    assert report["load"]["adapter_versions_seen"][0] == 0 and len(report["load"]["adapter_versions_seen"]) >= 2
    for name, view in report["edges"].items():
        assert [h["version"] for h in view["history"]] == [0, 1, 2], name
        assert view["serving_version"] == 2 and view["round"] == 2 and view["eval_loss"] is not None


def test_balancer_decisions_and_losses_are_in_the_round_metrics(lab):
    _, out = lab
    for r in (1, 2):
        m = json.loads((out / "checkpoints" / f"round-{r:04d}" / "metrics.json").read_text())
        decisions = {d["edge"]: d for d in m["balancer"]}
        assert set(decisions) == {"edge0", "edge1"}
        for d in decisions.values():
            assert d["reason"] and "report" in d and d["deadline_s"] == 12
        assert set(m["eval"]) == {"edge0", "edge1"}
        assert all(isinstance(v["eval-loss"], float) for v in m["eval"].values())
        assert m["refused_by"] == [] and all(v["canary-refused"] == 0 for v in m["eval"].values())
        # the real edges' replies carry every key the protocol names (common/protocol.py), as the server reads them
        assert all(set(TRAIN_KEYS) <= set(v) for v in m["train"].values()) and m["train"]
        assert all(set(EVAL_KEYS) <= set(v) for v in m["eval"].values()) and m["eval"]
    assert "holdout eval loss per edge" in lab[0].stdout

