"""Crash consistency (issue #34): generations flip whole, a torn state falls back to the one before, and a
process killed with SIGKILL at random instants while it writes every kind of state always leaves a state
that reads back consistent."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_adapter_state, tiny_config

from collm.common.adapter_io import WEIGHTS_FILE
from collm.common.config import LoraConfig
from collm.common.durable import generations, publish_generation
from collm.common.rounds import read_status
from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.state_store import read_serving, read_training, write_serving
from collm.server.checkpoints import load_latest_good, write_round

LORA = LoraConfig(r=2, alpha=4, target_modules=["q_proj"])
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def state_of(v: float) -> dict:
    return {KEY: torch.full((2, 8), float(v))}


def test_a_generation_flips_whole_and_keeps_one_before(tmp_path):
    for v in (1, 2, 3):
        write_serving(tmp_path, state_of(v), {"version": v}, LORA, "m")
    gens = generations(tmp_path, "serving")
    assert len(gens) == 2 and (tmp_path / "serving").is_symlink()
    state, meta = read_serving(tmp_path, lambda s: [])
    assert meta["version"] == 3 and float(state[KEY][0, 0]) == 3

    def broken(d: Path):
        (d / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        publish_generation(tmp_path, "serving", broken)
    assert read_serving(tmp_path, lambda s: [])[1]["version"] == 3  # a failed write leaves the current one
    assert len(generations(tmp_path, "serving")) == 2  # and no half-written folder behind


def test_a_torn_serving_state_falls_back_to_the_one_before(tmp_path):
    for v in (1, 2):
        write_serving(tmp_path, state_of(v), {"version": v}, LORA, "m")
    current = generations(tmp_path, "serving")[0]
    weights = current / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:50])  # a disk that lost the end of a write
    state, meta = read_serving(tmp_path, lambda s: [])
    assert meta["version"] == 1 and float(state[KEY][0, 0]) == 1
    (generations(tmp_path, "serving")[1] / "serving.json").write_text("{not json")
    assert read_serving(tmp_path, lambda s: []) is None  # nothing readable: the edge starts from its initial adapter


def test_the_old_layout_is_read_and_then_kept_as_the_fallback(tmp_path):
    from collm.common.adapter_io import save_adapter

    save_adapter(tmp_path / "serving", state_of(4), LORA, "m")
    (tmp_path / "serving.json").write_text(json.dumps({"version": 4}))
    assert read_serving(tmp_path, lambda s: [])[1]["version"] == 4
    write_serving(tmp_path, state_of(5), {"version": 5}, LORA, "m")
    assert read_serving(tmp_path, lambda s: [])[1]["version"] == 5
    assert [g.name for g in generations(tmp_path, "serving")][1] == "serving@0"


def test_a_restarted_edge_serves_the_last_good_version(tmp_path):
    cfg = tiny_config(state_dir=str(tmp_path / "s"))
    rt = EdgeRuntime(cfg)
    rt.load()
    try:
        for v in (1, 2):
            assert rt.publish(random_adapter_state(rt.engine, v), v, round=v)
    finally:
        rt.engine.stop()
    weights = generations(tmp_path / "s", "serving")[0] / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    again = EdgeRuntime(cfg)
    again.load()
    try:
        assert again.engine.shadow.current_version == 1  # not stuck, not the torn version 2
    finally:
        again.engine.stop()


def test_the_server_resumes_from_the_last_round_that_reads_back(tmp_path):
    for r in (1, 2):
        write_round(tmp_path, r, {KEY: np.full((2, 8), r, np.float32)}, {"round": r}, LORA, "m")
    assert load_latest_good(tmp_path).round == 2
    (tmp_path / "round-0002" / WEIGHTS_FILE).write_bytes(b"\0" * 10)
    warnings = []
    ck = load_latest_good(tmp_path, warnings.append)
    assert ck.round == 1 and float(ck.arrays[KEY][0, 0]) == 1 and "round 2" in warnings[0]


WRITER = r"""
import sys, json, torch, numpy as np
from pathlib import Path
from collm.common.config import LoraConfig
from collm.common.rounds import write_status
from collm.edge_client.state_store import write_serving, write_training
from collm.server.checkpoints import write_round
out, key = Path(sys.argv[1]), sys.argv[2]
lora = LoraConfig(r=2, alpha=4, target_modules=["q_proj"])
v = int(sys.argv[3])
print("ready", flush=True)
while True:
    v += 1
    s = {key: torch.full((2, 8), float(v))}
    write_serving(out / "edge", s, {"version": v}, lora, "m")
    write_training(out / "edge", s, {"v": v}, lora, "m")
    write_round(out / "ckpt", v, {key: np.full((2, 8), v, np.float32)}, {"v": v}, lora, "m")
    write_status(out / "ckpt", {"round": v, "phase": "complete"})
"""


@pytest.mark.slow
def test_kill_9_during_every_kind_of_write_leaves_a_consistent_state(tmp_path):
    """50 times: a writer of serving, training, round and status state killed with SIGKILL at a random instant;
    each time every state reads back whole (weights match the version they are filed under) and no
    version goes backwards."""
    rng = random.Random(0)
    last, last_train, seen_status = 0, 0, False
    for i in range(50):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), KEY, str(last)], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        found = read_serving(tmp_path / "edge", lambda s: [])
        if found is None:
            assert last == 0 and i == 0  # killed before its first write ever finished
            continue
        state, meta = found
        v = meta["version"]
        assert torch.all(state[KEY] == v) and v >= last, (v, last)
        # Training is written after serving: a writer that got through a training write leaves it at serving's
        # version or one behind. A writer killed before its first one leaves it where the last writer did, which
        # can be further behind (that writer was killed between the two, and this one starts from serving's
        # version). It never goes backwards, and is missing only before the first ever.
        found_train = read_training(tmp_path / "edge", lambda s: [])
        if found_train is None:
            assert last_train == 0
        else:
            train, opt = found_train
            assert torch.all(train[KEY] == opt["v"]), opt["v"]
            assert opt["v"] in (v, v - 1, last_train) and opt["v"] >= last_train, (opt["v"], last_train, v)
            last_train = opt["v"]
        ck = load_latest_good(tmp_path / "ckpt")
        if ck is not None:
            assert np.all(ck.arrays[KEY] == ck.round) and ck.metrics["v"] == ck.round
        status = read_status(tmp_path / "ckpt")  # None only before its first write; never torn after
        assert (status is None and not seen_status) or status["phase"] == "complete", status
        seen_status = seen_status or status is not None
        last = v
    assert last > 10  # the writer got through many writes in all


def test_a_partial_generation_never_displaces_the_fallback(tmp_path):
    for v in (1, 2):
        write_serving(tmp_path, state_of(v), {"version": v}, LORA, "m")
    (tmp_path / ".serving@9.tmp").mkdir()  # a fill a crash interrupted
    write_serving(tmp_path, state_of(3), {"version": 3}, LORA, "m")
    assert read_serving(tmp_path, lambda s: [])[1]["version"] == 3
    assert [g.name for g in generations(tmp_path, "serving")] == ["serving@3", "serving@2"]
    assert not (tmp_path / ".serving@9.tmp").exists()


def test_a_generation_without_its_version_file_is_skipped_not_paired_with_a_stale_one(tmp_path):
    (tmp_path / "serving.json").write_text(json.dumps({"version": 99}))  # left over from the old layout
    for v in (1, 2):
        write_serving(tmp_path, state_of(v), {"version": v}, LORA, "m")
    (generations(tmp_path, "serving")[0] / "serving.json").unlink()
    state, meta = read_serving(tmp_path, lambda s: [])
    assert meta["version"] == 1 and float(state[KEY][0, 0]) == 1
