"""The Flower plumbing on loopback: a real SuperLink, two in-process executors, `collm-server`.

One module-scoped federation is run once (about 25 s on 2 cores, mostly the start-up of five Python
processes; its exchanges poll as collm's do: the edges' `fleet_poll_s`, the server's `QuickGrid`) and the
tests below check what it recorded. It uses its own tiny
app (tests/flower_testapp), so CoLLM's real strategy and handlers can change freely.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from flwr.common.config import parse_config_args
from flwr.common.constant import ErrorCode

from collm.common.procs import end_stragglers, processes_mentioning
from collm.edge_client.federation.executor import SuperNodeExecutor, format_node_config
from collm.lab.topology import free_port

REPO = Path(__file__).resolve().parents[1]
TESTAPP = Path(__file__).with_name("flower_testapp")
BIN = Path(sys.executable).parent  # flower-superlink, collm-server, ... of this environment
NODES = ("edge-a", "edge-b")
FAILING = "edge-a"  # its ClientApp raises on the query, then must still train


# ---------------------------------------------------------------------------- fast checks
def test_node_config_is_quoted_so_flwr_parses_it_back():
    cfg = {"name": "edge 0", "partition-id": 0, "lr": 0.1, "train": True, "path": "C:\\x"}
    text = format_node_config(cfg)
    assert 'name="edge 0"' in text and "train=true" in text
    assert parse_config_args([text]) == cfg
    for bad in ({"name": "say \"hi\" it's"}, {"bad key": 1}, {"x": None}, {"x": float("nan")}):
        with pytest.raises(ValueError):
            format_node_config(bad)


def test_tls_options_need_tls():
    with pytest.raises(ValueError, match="insecure=False"):
        SuperNodeExecutor(None, superlink="x:1", runtime_port=1, node_config={}, root_certificates="ca.crt")


def test_repo_flower_app_bundles_only_its_config():
    """The FAB of this repo holds pyproject.toml alone: the ServerApp imports the installed collm."""
    from collm.server.cli import build_fab

    fab = build_fab(REPO)  # what `collm-server` submits; validates that both components exist
    assert zipfile.ZipFile(io.BytesIO(fab.content)).namelist() == ["pyproject.toml", ".info/CONTENT"]


# ---------------------------------------------------------------------------- supervision
@pytest.mark.slow
def test_a_supernode_that_dies_is_restarted_and_stop_ends_it():
    """No SuperLink needed: the SuperNode keeps retrying to connect and stays up."""
    executor = SuperNodeExecutor(None, superlink=f"127.0.0.1:{free_port()}", runtime_port=free_port(),
                                 node_config={"name": "lonely"})
    try:
        executor.start()
        first = _wait_for(lambda: executor.supernode_pid, timeout=30)
        os.kill(first, signal.SIGKILL)
        second = _wait_for(lambda: executor.supernode_pid not in (None, first) and executor.supernode_pid, 30)
        assert executor.supernode_restarts == 1 and "exited with code -9" in executor.last_error
        assert executor.running
    finally:
        assert executor.stop(timeout=15)
    assert not _alive(second) and not executor.running


_HOST = """\
import sys, time
from collm.edge_client.federation.executor import SuperNodeExecutor
executor = SuperNodeExecutor(None, superlink=sys.argv[1], runtime_port=int(sys.argv[2]), node_config={}).start()
while executor.supernode_pid is None:
    time.sleep(0.05)
print(executor.supernode_pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_the_supernode_ends_when_its_host_process_is_killed():
    host = subprocess.Popen([sys.executable, "-c", _HOST, f"127.0.0.1:{free_port()}", str(free_port())],
                            stdout=subprocess.PIPE, text=True)
    supernode = None
    try:
        supernode = int(host.stdout.readline())
        time.sleep(1.0)  # let it get going
        host.kill()
        host.wait()
        _wait_for(lambda: not _alive(supernode), timeout=20)
    finally:
        host.kill()
        if _alive(supernode):
            os.kill(supernode, signal.SIGKILL)


# A host that starts a child whose graceful shutdown stalls: its SIGTERM handler never returns, as a flwr
# shutdown stuck on a lock or a gRPC call would. Only the guard's exit after its grace can end it.
_STALLING_CHILD = """\
import signal, sys, time
from collm.edge_client.federation.orphan_guard import guard
signal.signal(signal.SIGTERM, lambda *_: time.sleep(3600))
guard(int(sys.argv[1]), grace_s=float(sys.argv[2]), period_s=0.05)
print("ready", flush=True)
time.sleep(3600)
"""
_STALLING_HOST = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]],
                         stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("grace_s", [1.0, 3.0])
def test_an_orphan_whose_shutdown_stalls_exits_after_the_grace(grace_s):
    host = subprocess.Popen([sys.executable, "-c", _STALLING_HOST, _STALLING_CHILD, str(grace_s)],
                            stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(host.stdout.readline())
        killed = time.monotonic()  # before the kill: the child may see its parent gone before wait() returns
        host.kill()
        host.wait()
        time.sleep(grace_s * 0.5)
        assert _alive(child), "the stalled handler holds the orphan until the grace is over"
        _wait_for(lambda: not _alive(child), timeout=grace_s + 5)
        assert time.monotonic() - killed >= grace_s
    finally:
        host.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


# ---------------------------------------------------------------------------- helpers
def _wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)
    return value


def _load_testapp():
    spec = importlib.util.spec_from_file_location("fl_testapp", TESTAPP / "fl_testapp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_until_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def _proc_stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: state, ppid, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    return pid is not None and (stat := _proc_stat(pid)) is not None and stat[0] != "Z"


def _stop_superlink(proc: subprocess.Popen, address: str, grace: float = 10.0) -> list[int]:
    """SIGTERM the SuperLink and wait for it and what it detached (the address is ours alone);
    SIGKILL any that stay. Returns the processes that were still there after `grace` seconds."""
    proc.terminate()
    left = end_stragglers(address, grace)
    proc.wait(5)
    return left


# ---------------------------------------------------------------------------- the federation
@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """The whole topology, run once and torn down: what happened, for the tests below."""
    return _run_federation(tmp_path_factory.mktemp("flwr_home"))


def _run_federation(home: Path) -> SimpleNamespace:
    """SuperLink + two executors (child SuperNodes) + `collm-server` running the test app."""
    address = f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ,
        FLWR_HOME=str(home),  # the ServerApp process installs the FAB there
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the SuperLink starts flwr-* by name
    )
    app = _load_testapp()
    executors: list[SuperNodeExecutor] = []
    t0 = time.monotonic()
    with (home / "superlink.log").open("w") as superlink_log:
        superlink = subprocess.Popen(
            [BIN / "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", address.split(":")[1],
             "--disable-runtime-dependency-installation"],
            stdout=superlink_log, stderr=subprocess.STDOUT, env=env, cwd=home,
        )  # fmt: skip
    try:
        _wait_until_healthy(f"http://{address}/health", superlink, timeout=60)
        t_superlink = time.monotonic() - t0
        for i, name in enumerate(NODES):
            executor = SuperNodeExecutor(app.client_app, superlink=address, runtime_port=free_port(),
                                         node_config={"name": name, "partition-id": i}, poll_interval=0.1,
                                         fleet_poll_s=0.2)
            executors.append(executor.start())
        t1 = time.monotonic()
        overrides = f'num-server-rounds=2 fail-node-name="{FAILING}"'
        run = subprocess.run([BIN / "collm-server", "--app", TESTAPP, "--superlink", address, "--insecure",
                              "-c", overrides], env=env, cwd=home, capture_output=True, text=True, timeout=240)
        t_run = time.monotonic() - t1
        output = run.stdout + run.stderr
        status = re.search(r"collm-server: run \d+ (\S+)", output)
        summary = re.search(r"COLLM_TEST_SUMMARY (.*)", output)
        assert run.returncode == 0 and status and summary, f"collm-server failed:\n{output[-4000:]}"
        status_before_stop = {n: (e.running, e.tasks_done, e.tasks_failed, e.last_error, e.last_task_seconds)
                              for n, e in zip(NODES, executors)}  # fmt: skip
        supernode_pids = [e.supernode_pid for e in executors]
        t2 = time.monotonic()
        stopped = [e.stop(timeout=15) for e in executors]
        t_stop = time.monotonic() - t2
        leftovers = _stop_superlink(superlink, address)
    except BaseException:
        print((home / "superlink.log").read_text()[-4000:])
        raise
    finally:
        for executor in executors:
            executor.stop(timeout=5)
        if superlink.poll() is None or processes_mentioning(address):
            _stop_superlink(superlink, address, grace=5.0)
    summary = json.loads(summary.group(1))
    timings = {"superlink-up-s": round(t_superlink, 1), "collm-server-wall-s": round(t_run, 1),
               "serverapp-query-s": summary["query-s"], "serverapp-2-rounds-s": summary["rounds-s"],
               "stop-2-executors-s": round(t_stop, 1), "total-s": round(time.monotonic() - t0, 1)}
    print("timings", timings)
    return SimpleNamespace(
        summary=summary, status=status.group(1), calls=list(app.CALLS),
        executors=dict(zip(NODES, executors)), status_before_stop=status_before_stop,
        supernode_pids=supernode_pids, stopped=stopped, superlink_leftovers=leftovers, timings=timings,
    )  # fmt: skip


def _node_id(federation, name: str) -> str:
    return next(str(c["node-id"]) for c in federation.calls if c["name"] == name)


def test_the_fleet_loops_idle_wait_is_capped_where_flwr_has_it():
    """fleet_wait.shorten_fleet_wait caps the SuperNode Fleet loop's hard-coded 3 s idle wait (flwr 1.42's
    `start_client_internal`); the rest of the `time` module stays as it is."""
    import inspect

    import flwr.supernode.start_client_internal as fleet_loop

    assert "time.sleep(3)" in inspect.getsource(fleet_loop)  # the wait it caps is still there
    code = ("import time; from collm.edge_client.federation.fleet_wait import shorten_fleet_wait; "
            "shorten_fleet_wait(0.05); import flwr.supernode.start_client_internal as m; "
            "t = time.monotonic(); m.time.sleep(3); print(time.monotonic() - t, m.time.time() > 1e9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    waited, clock_ok = out.stdout.split()
    assert float(waited) < 1.0 and clock_ok == "True", out.stderr[-2000:]
    with pytest.raises(ValueError, match="fleet_poll_s"):
        SuperNodeExecutor(None, superlink="x:1", runtime_port=1, node_config={}, fleet_poll_s=0)


@pytest.mark.slow
def test_an_exchange_ends_within_a_fraction_of_a_second_of_its_reply(federation):
    """Two rounds of one train exchange each: with flwr's 3 s waits on both sides they took about 6 s (each side
    waits 0-3 s per exchange); with the edges' fleet_poll_s and the server's QuickGrid, well under 4 s."""
    assert federation.summary["rounds-s"] < 4.0, federation.timings


@pytest.mark.slow
def test_the_run_completes_and_fedavg_aggregates_both_nodes(federation):
    assert federation.status == "finished:completed"
    assert federation.summary["final-w"] == [2.0] * 4  # each round every node returns w + 1
    # run_config = [tool.flwr.app.config] of tests/flower_testapp + the `-c` overrides
    expected = {"num-server-rounds": 2, "fail-node-name": FAILING, "round-timeout": 60.0}
    assert federation.summary["run-config"] == expected


@pytest.mark.slow
def test_train_ran_in_this_process_for_both_nodes_in_both_rounds(federation):
    trains = [c for c in federation.calls if c["kind"] == "train"]
    assert sorted((c["name"], c["round"]) for c in trains) == [(n, r) for n in NODES for r in (1, 2)]
    assert {c["pid"] for c in federation.calls} == {os.getpid()}
    assert {c["thread"] for c in trains} == {f"executor[{n}]" for n in NODES}


@pytest.mark.slow
def test_query_messages_reach_the_clientapp_and_come_back(federation):
    assert sorted(c["name"] for c in federation.calls if c["kind"] == "query") == sorted(NODES)
    assert federation.summary["query"][_node_id(federation, "edge-b")] == {"name": "edge-b"}


@pytest.mark.slow
def test_a_raising_clientapp_gets_an_error_reply_and_the_executor_carries_on(federation):
    reply = federation.summary["query"][_node_id(federation, FAILING)]
    assert reply["error-code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "asked to fail" in reply["error"]
    running, done, failed, last_error, last_task_s = federation.status_before_stop[FAILING]
    assert running and (done, failed) == (3, 1)  # query (error reply) + 2 trains
    assert "asked to fail" in last_error and last_task_s is not None
    assert federation.status_before_stop["edge-b"][1:4] == (3, 0, None)


@pytest.mark.slow
def test_stop_ends_the_child_supernodes_and_nothing_is_left(federation):
    assert all(pid is not None for pid in federation.supernode_pids)
    assert federation.stopped == [True, True]
    assert not any(_alive(pid) for pid in federation.supernode_pids)
    assert not any(e.running for e in federation.executors.values())
    assert federation.superlink_leftovers == []
