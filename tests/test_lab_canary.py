"""The canary gate through a real topology: a round whose aggregate is deliberately bad is refused
on every edge, and no request is answered by it.

`collm-lab` with 2 SmolLM2 edges (the tiny model cannot be trained into a worse global: its loss
stays near log(vocab) at any learning rate) and a server config whose learning rate is 250x the
default (0.05). Every edge evaluates the round's global before it would serve it, finds it worse
than what it serves by more than `adapters.canary_margin`, keeps serving version 0 and says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from collm.common.procs import processes_mentioning

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

BAD_SERVER = """
lora: {r: 8, alpha: 16}
balancer: {lr: 0.05, round_token_budget: 600, round_deadline_s: 40}
round_timeout_s: 300
query_timeout_s: 60
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("canary")
    (tmp / "server.yaml").write_text(BAD_SERVER)
    out = tmp / "run"
    proc = subprocess.run([str(BIN / "collm-lab"), "--model", "bundled", "--edges", "2", "--rounds", "1",
                           "--load", "0.3", "--eval-records", "16", "--server-config", str(tmp / "server.yaml"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    leftovers = processes_mentioning(str(out))
    m = out / "checkpoints" / "round-0001" / "metrics.json"
    return {"rc": proc.returncode, "stdout": proc.stdout + proc.stderr, "leftovers": leftovers,
            "metrics": json.loads(m.read_text()) if m.is_file() else None,
            "report": json.loads((out / "lab.json").read_text()) if (out / "lab.json").is_file() else {}}


def test_every_edge_refuses_the_bad_global_and_no_request_is_answered_by_it(lab):
    assert lab["rc"] == 0, lab["stdout"][-4000:]
    m = lab["metrics"]
    assert m["kept"], m["dropped"]                                  # the round did aggregate something
    assert sorted(m["refused_by"]) == ["edge0", "edge1"], m["eval"]
    assert all(v["canary-refused"] == 1 and v["adapter-version"] == 0 for v in m["eval"].values())
    load = lab["report"]["load"]
    assert load["sent"] > 5 and load["failed"] == 0
    assert load["adapter_versions_seen"] == [0]                     # nobody was served round 1's global
    for name, view in lab["report"]["edges"].items():
        assert view["serving_version"] == 0, name
    assert "refused to serve this round's global" in lab["stdout"]
    assert lab["leftovers"] == []
