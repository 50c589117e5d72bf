"""A mixed fleet through a real topology (`collm-lab --ranks 4,8,16 --quantization none,nf4,none`: a real
flower-superlink on loopback, 3 tiny edges training LoRA ranks 4, 8 and 16, the rank-8 one on an nf4 base
(bitsandbytes, QLoRA), the router, requests under load).

Every round must aggregate every edge's update (none left out for its shape), the global must be
written at the server's rank (16, what PEFT loads) with the energy that rank keeps, every edge must
evaluate and serve each new global at its own rank (it reports the energy its rank keeps), and no
request may fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from collm.common.procs import processes_mentioning

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ROUNDS = 2
RANKS = {"edge0": 4, "edge1": 8, "edge2": 16}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "run"
    proc = subprocess.run([str(BIN / "collm-lab"), "--model", "tiny", "--edges", "3", "--rounds", str(ROUNDS),
                           "--ranks", ",".join(map(str, RANKS.values())), "--quantization", "none,nf4,none",
                           "--load", "1", "--round-deadline", "4",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    ckpt = out / "checkpoints"
    metrics = {r: json.loads((ckpt / f"round-{r:04d}" / "metrics.json").read_text())
               for r in range(1, ROUNDS + 1) if (ckpt / f"round-{r:04d}" / "metrics.json").is_file()}
    return {"proc": proc, "out": out, "metrics": metrics, "leftovers": processes_mentioning(str(out)),
            "report": json.loads((out / "lab.json").read_text()) if (out / "lab.json").is_file() else {}}


@pytest.mark.slow
def test_every_rank_is_aggregated_in_every_round(lab):
    assert lab["proc"].returncode == 0, lab["proc"].stdout[-3000:] + lab["proc"].stderr[-3000:]
    assert sorted(lab["metrics"]) == list(range(1, ROUNDS + 1))
    for r, m in lab["metrics"].items():
        assert sorted(m["kept"]) == sorted(RANKS) and not m["dropped"], (r, m["dropped"])
        assert 0 < m["rank_energy"] <= 1.0
        # each edge trained its own rank: the server saw 4, 8 and 16 (recorded via the norms of all three)
        assert sorted(m["norms"]) == sorted(RANKS)
    adapter = load_file(str(lab["out"] / "checkpoints" / f"round-{ROUNDS:04d}" / "adapter_model.safetensors"))
    assert {v.shape[0] for k, v in adapter.items() if "lora_A" in k} == {16}  # the server's rank
    edge1 = (lab["out"] / "logs" / "edge1.log").read_text()
    assert "quantization=nf4" in edge1  # the nf4 edge trained on its 4-bit base, and its update was aggregated


@pytest.mark.slow
def test_every_edge_serves_each_new_global_at_its_own_rank(lab):
    for r, m in lab["metrics"].items():
        for edge, rank in RANKS.items():
            e = m["eval"][edge]
            assert e["adapter-version"] == r and e["canary-refused"] == 0, (r, edge, e)
            # rank 16 keeps everything of a rank-16 global; the smaller ranks keep a share of it
            assert (e["rank-energy"] == pytest.approx(1.0)) if rank == 16 else (0 < e["rank-energy"] <= 1.0)
    for edge, view in lab["report"]["edges"].items():
        assert view["serving_version"] == ROUNDS, (edge, view)
    load = lab["report"]["load"]
    assert load["sent"] > 0 and load["failed"] == 0, load["failures"]
    assert not lab["leftovers"]
