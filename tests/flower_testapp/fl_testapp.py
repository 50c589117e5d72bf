"""ServerApp and ClientApp for the executor plumbing test (tests/test_flower_executor.py).

The ServerApp runs in `flwr-serverapp` (spawned by the SuperLink) and loads this file from
the FAB. The ClientApp object is handed straight to the in-process executors, so `CALLS`
fills up in the test process itself.

ServerApp, in one run:
  1. a `query` to every node; the node whose `node_config["name"]` equals run_config
     `fail-node-name` raises, so its reply must be an Error;
  2. FedAvg for `num-server-rounds` rounds of `train` (no federated evaluate) over one
     4-float array `w`; each node returns `w + 1`, so after R rounds every entry is R.
  Replies are awaited for run_config `round-timeout` seconds. It logs one line
  `COLLM_TEST_SUMMARY <json>` (query replies, run_config, final `w`, timings).
"""

import json
import os
import threading
import time
from logging import INFO

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from collm.server.polling import QuickGrid

server_app = ServerApp()
client_app = ClientApp()
CALLS: list[dict] = []  # one entry per ClientApp call, in the process that runs the ClientApp


def _record(kind: str, msg: Message, context: Context) -> None:
    CALLS.append({
        "kind": kind,
        "node-id": context.node_id,
        "name": context.node_config.get("name"),
        "round": msg.content["config"].get("server-round") if "config" in msg.content else None,
        "pid": os.getpid(),
        "thread": threading.current_thread().name,
    })  # fmt: skip


@client_app.query()
def query(msg: Message, context: Context) -> Message:
    _record("query", msg, context)
    if context.node_config.get("name") == msg.content["config"]["fail-node-name"]:
        raise RuntimeError("this node was asked to fail")
    identity = ConfigRecord({"name": str(context.node_config.get("name"))})
    report = MetricRecord({"pid": os.getpid()})
    return Message(RecordDict({"identity": identity, "report": report}), reply_to=msg)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    _record("train", msg, context)
    arrays = ArrayRecord({k: Array(v.numpy() + 1.0) for k, v in msg.content["arrays"].items()})
    metrics = MetricRecord({"num-examples": 10, "handler-pid": os.getpid()})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def _wait_for_nodes(grid: Grid, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(node_ids := sorted(grid.get_node_ids())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(node_ids)} of {n} nodes connected")
        time.sleep(0.5)
    return node_ids


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    grid = QuickGrid(grid, 0.1)  # collm-server's grid (server/polling.py): replies pulled every 0.1 s, not 3 s
    t0 = time.monotonic()
    node_ids = _wait_for_nodes(grid, 2, timeout=60)
    cfg = ConfigRecord({"fail-node-name": str(rc["fail-node-name"])})
    probes = [Message(RecordDict({"config": cfg}), dst_node_id=n, message_type=MessageType.QUERY)
              for n in node_ids]
    query_replies = {}
    for rep in grid.send_and_receive(probes, timeout=float(rc["round-timeout"])):
        if rep.has_error():
            query_replies[rep.metadata.src_node_id] = {"error-code": rep.error.code, "error": rep.error.reason}
        else:
            query_replies[rep.metadata.src_node_id] = {"name": rep.content["identity"]["name"]}
    t_query = time.monotonic() - t0

    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
        num_rounds=int(rc["num-server-rounds"]),
        timeout=float(rc["round-timeout"]),
    )
    summary = {
        "run-config": dict(rc),
        "node-ids": node_ids,
        "query": {str(k): v for k, v in query_replies.items()},
        "final-w": result.arrays["w"].numpy().tolist(),
        "query-s": round(t_query, 2),
        "rounds-s": round(time.monotonic() - t0 - t_query, 2),
    }
    log(INFO, "COLLM_TEST_SUMMARY %s", json.dumps(summary))
