"""Faults in a real topology: an edge killed with SIGKILL in the middle of a round.

`collm-lab` (3 tiny edges, 3 rounds, router, --restart-edges) must report the death, restart the
edge, complete every round and answer every request through the router; the restarted edge
catches up to the global adapter before it serves and takes part in the later rounds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from collm.common.procs import processes_mentioning
from collm.common.rounds import read_status

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "run"
    lines: list[str] = []
    proc = subprocess.Popen([str(BIN / "collm-lab"), "--model", "tiny", "--edges", "3", "--rounds", "3", "--load", "3",
                             "--round-deadline", "6", "--restart-edges", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    killed = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            st = read_status(out / "checkpoints") or {}
            if st.get("round") == 2 and st.get("phase") == "train":
                pids = processes_mentioning(str(out / "edge1.yaml"))
                edge_pids = [p for p in pids if "collm-edge" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
                if edge_pids:
                    os.kill(edge_pids[0], signal.SIGKILL)
                    killed = edge_pids[0]
                    break
            time.sleep(0.1)
        try:
            rc = proc.wait(600)
        except subprocess.TimeoutExpired:
            rc = "hung for 600 s"  # the tests below fail and show the lab's own output
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        reader.join(10)
    leftovers = processes_mentioning(str(out))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    return {"rc": rc, "out": out, "stdout": "".join(lines), "killed": killed, "leftovers": leftovers}


def test_the_run_survives_the_edge_and_completes_every_round(lab):
    assert lab["killed"], "edge1 was never killed: round 2 did not start"
    assert lab["rc"] == 0, lab["stdout"][-4000:]
    assert "edge1 exited with status -9" in lab["stdout"] and "edge1 restarted" in lab["stdout"]
    for r in (1, 2, 3):
        assert (lab["out"] / "checkpoints" / f"round-{r:04d}" / "metrics.json").is_file(), r
    assert lab["leftovers"] == []


def lab_report(lab) -> dict:
    """The lab's report; a lab that hung or failed before writing it fails the test with its own output."""
    path = lab["out"] / "lab.json"
    if not path.is_file():
        pytest.fail(f"no lab.json (lab exit: {lab['rc']}); its output ends:\n{lab['stdout'][-4000:]}")
    return json.loads(path.read_text())


def test_every_request_is_answered_through_the_router(lab):
    report = lab_report(lab)
    load = report["load"]
    assert load["sent"] > 30 and load["failed"] == 0, load["failures"]
    assert "edge1" in load["edges_seen"]


def test_the_restarted_edge_caught_up_and_took_part_again(lab):
    report = lab_report(lab)
    edge1 = report["edges"]["edge1"]
    sources = [h["source"] for h in edge1["history"]]
    # the restarted process restored its own last version, then caught up from the checkpoints or a round
    assert sources[0] == "initial" and "restored" in sources
    assert edge1["serving_version"] == 3
    m3 = json.loads((lab["out"] / "checkpoints" / "round-0003" / "metrics.json").read_text())
    assert "edge1" in m3["eval"]  # it rejoined and evaluated the last global adapter


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is on `pid`'s parent chain. The ServerApp's command line names neither the
    lab nor its folder: lab -> flower-superlink -> flower-superexec -> flwr-serverapp."""
    while pid > 1:
        pid = parent_of(pid)
        if pid == ancestor:
            return True
    return False


@pytest.fixture(scope="module")
def serverapp_killed(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults-server") / "run"
    proc = subprocess.Popen([str(BIN / "collm-lab"), "--model", "tiny", "--edges", "2", "--rounds", "4", "--load", "1",
                             "--round-deadline", "5", "--no-router", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    killed_at = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and killed_at is None:
            if (read_status(out / "checkpoints") or {}).get("round") == 2:
                for pid in processes_mentioning("flwr-serverapp"):
                    if descends_from(pid, proc.pid):  # this lab's, not another run's on the machine
                        os.kill(pid, signal.SIGKILL)
                        killed_at = time.time()
            time.sleep(0.1)
        rc = proc.wait(300)
        waited = time.time() - killed_at if killed_at else None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(90)
        reader.join(10)
    leftovers = processes_mentioning(str(out))
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    return {"rc": rc, "waited": waited, "stdout": "".join(lines), "out": out, "leftovers": leftovers}


def test_a_killed_serverapp_ends_the_run_with_an_error_not_a_hang(serverapp_killed):
    r = serverapp_killed
    assert r["waited"] is not None, "the ServerApp was never killed"
    assert r["rc"] not in (0, None), r["stdout"][-3000:]
    assert r["waited"] < 240, r["waited"]  # Flower notices the lost ServerApp by its heartbeat (60 s)
    assert "collm-server: run" in r["stdout"] and "finished:failed" in r["stdout"]
    assert (r["out"] / "checkpoints" / "round-0001" / "metrics.json").is_file()  # what was done is kept
    assert r["leftovers"] == []
