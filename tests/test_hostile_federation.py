"""Hostile Flower peers on a real SuperLink (issue #34): a real CoLLM edge (tiny model, `federation.run_key`)
and a malicious edge behind two in-process executors. First a foreign run (the plumbing test app) is
submitted beside them: the CoLLM edge refuses every message of it and changes nothing. Then the CoLLM
ServerApp runs two rounds while the malicious edge answers every TRAIN with a malformed reply: the run
completes every round, the malicious update is left out with its reason, the honest update is the
aggregate, and the honest edge serves each round's global."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import LiveEdge, tiny_config

from collm.common import protocol as P
from collm.common import wire
from collm.common.procs import end_stragglers
from collm.common.protocol import LoadReport
from collm.edge_client.federation.client import FederatedEdge
from collm.edge_client.federation.executor import SuperNodeExecutor
from collm.lab.topology import free_port
from collm.server.checkpoints import load_round

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TESTAPP = Path(__file__).with_name("flower_testapp")
BIN = Path(sys.executable).parent
KEY = "federation-key-for-this-test"
MALFORMED = [  # what the malicious edge answers TRAIN with, round after round
    lambda: ArrayRecord({wire.PACKED: Array(np.zeros(3, np.float32)),
                         wire.MANIFEST: Array(np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8).copy())}),
    lambda: ArrayRecord({wire.PACKED: Array(np.array(["x", "y", "z"])),
                         wire.MANIFEST: Array(np.frombuffer(b'[["a", [3]]]', np.uint8).copy())}),
]


def mallory_app() -> ClientApp:
    app = ClientApp()
    identity = ConfigRecord({P.EDGE_NAME: "mallory", "name": "mallory"})  # "name": the foreign test app reads it

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        report = LoadReport(name="mallory", request_rate=1.0, slo_attainment=1.0, spare_capacity=0.95,
                            queue_depth=0.0, running=0.0, train_examples=100, gain_per_ktok=None,
                            train_tokens_per_s=1000.0, goodput=1.0, adapter_version=0)
        return Message(RecordDict({P.REPORT: MetricRecord(report.to_record()), P.IDENTITY: identity}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        if "w" in arrays:  # the foreign test app's round: answer it as it expects
            out = ArrayRecord({"w": Array(arrays["w"].numpy() + 1.0)})
            return Message(RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)
        rnd = int(msg.content[P.CONFIG][P.SERVER_ROUND])
        metrics = MetricRecord({P.NUM_EXAMPLES: 1e30, P.TRAIN_LOSS: 0.1})
        return Message(RecordDict({P.ARRAYS: MALFORMED[(rnd - 1) % len(MALFORMED)](), P.METRICS: metrics,
                                   P.IDENTITY: identity}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({P.NUM_EXAMPLES: 16, P.EVAL_LOSS: 3.0, P.EVAL_ACCURACY: 0.5, P.ADAPTER_VERSION: 0.0,
                                P.CANARY_REFUSED: 0})
        return Message(RecordDict({P.METRICS: metrics, P.IDENTITY: identity}), reply_to=msg)

    return app


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_foreign_run_and_a_malicious_edge_on_a_real_superlink(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "flwr"), FLWR_TELEMETRY_ENABLED="0",
               FLWR_DISABLE_UPDATE_CHECK="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    cfg = tiny_config(name="honest", state_dir=str(tmp_path / "state"), adapters={"canary_margin": None},
                      federation={"run_key": {"keys": [KEY]}}, engine={"shed_late": False})
    edge = LiveEdge(cfg)
    honest = FederatedEdge(edge.runtime)
    executors = []
    log = (tmp_path / "superlink.log").open("w")
    superlink = subprocess.Popen([BIN / "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port",
                                  address.split(":")[1], "--disable-runtime-dependency-installation"],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not _healthy(f"http://{address}/health") and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, app in (("honest", honest.client_app()), ("mallory", mallory_app())):
            executors.append(SuperNodeExecutor(app, superlink=address, runtime_port=free_port(),
                                               node_config={"name": name}, poll_interval=0.1).start())

        # 1. a foreign run: any ServerApp someone submits to the same SuperLink
        foreign = subprocess.run([BIN / "collm-server", "--app", TESTAPP, "--superlink", address, "--insecure",
                                  "-c", 'num-server-rounds=1 fail-node-name=""'], env=env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=240)
        out = foreign.stdout + foreign.stderr
        assert re.search(r"collm-server: run \d+ finished", out), out[-3000:]
        assert honest.foreign_refused >= 2, out[-3000:]  # its query and its train
        assert edge.engine.shadow.current_version == 0 and edge.runtime.latest_round == -1
        refused_before = honest.foreign_refused

        # 2. the federation's own run, signed with the key, with a malicious edge in it
        ckpt = tmp_path / "ckpt"
        (tmp_path / "server.yaml").write_text(yaml.safe_dump({
            "rounds": 2, "min_nodes": 2, "checkpoint_dir": str(ckpt), "base_model_name": "collm-tiny",
            "lora": cfg.lora.model_dump(), "federation_key": {"keys": [KEY]}, "round_timeout_s": 150,
            "query_timeout_s": 20, "balancer": {"round_deadline_s": 20, "round_token_budget": 3000}}))
        run = subprocess.run([BIN / "collm-server", "--superlink", address, "--insecure", "-c",
                              f'config="{tmp_path / "server.yaml"}"'], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=400)
        output = run.stdout + run.stderr
        assert run.returncode == 0 and "finished:completed" in output, output[-4000:]
        for r in (1, 2):
            m = load_round(ckpt, r).metrics
            assert m["kept"] == ["honest"], m["dropped"]
            assert m["dropped"].get("mallory", "").startswith("malformed reply"), (m["dropped"], [(b["edge"], b["reason"]) for b in m["balancer"]])
        assert edge.runtime.latest_round == 2 and edge.engine.shadow.current_info().round == 2
        assert honest.foreign_refused == refused_before  # every message of its own run was obeyed
    finally:
        for e in executors:
            e.stop(timeout=15)
        superlink.terminate()
        end_stragglers(address, 10)
        superlink.wait(10)
        log.close()
        edge.close()
