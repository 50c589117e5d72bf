"""The CoLLM strategy end to end against fake edges, through a serverless in-process Grid.

The fake edges are real `ClientApp`s that follow the message protocol in
`collm.common.protocol`; `LocalGrid` delivers each Message synchronously (no SuperLink, no Ray).
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field
from uuid import uuid4

import numpy as np
import pytest
from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord,
                      RecordDict)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import strategy_utils
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from collm.common import protocol as P
from collm.common import wire
from collm.common.config import deep_merge, validate_config
from collm.server.app import app as server_app
from collm.server.app import run, summary_table
from collm.common.rounds import latest_complete_round
from collm.server.checkpoints import load_all_metrics, load_round
from collm.server.config import ServerConfig
from collm.server.node_snapshot import NodeSnapshot
from collm.server.strategies import CollmFedAdam, CollmFedProx, build_strategy
from collm.common.lora_rank import fit_rank
from collm.common.protocol import LoadReport

KEYS = {f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{w}.weight": shape
        for i in range(2) for m in ("q", "v") for w, shape in (("A", (4, 16)), ("B", (16, 4)))}


def seeded_initial_adapter(rank: int = 4) -> dict[str, np.ndarray]:
    """What every edge starts from in round 1 (identical seed on all edges; `rank`: a mixed-rank edge's)."""
    rng = np.random.default_rng(1234)
    shapes = {k: ((rank, s[1]) if "lora_A" in k else (s[0], rank)) for k, s in KEYS.items()}
    return {k: (rng.standard_normal(s) * 0.1 if "lora_A" in k else np.zeros(s)).astype(np.float32)
            for k, s in shapes.items()}


# ------------------------------------------------------------------------------ fake edges
@dataclass
class FakeEdge:
    name: str
    index: int
    spare: float = 0.9
    attainment: float = 0.99
    nan_update: bool = False
    scale_from_round: int | None = None  # from this round on, send 100x the honest update
    query_fails: bool = False
    extra_metric: bool = False
    hostile_metrics: bool = False  # lists for its losses and huge finite numbers in its load report (an edge's word)
    train_configs: list[dict] = field(default_factory=list)
    train_arrays: list[dict] = field(default_factory=list)
    keyed_reply: bool = False  # reply with one Array per tensor (an older edge) instead of packed
    refuses: bool = False  # its canary gate refuses every new global (it keeps serving the old one)
    honours_freeze: bool = True  # under "lora-freeze-a" it leaves A as it was sent
    clips: bool = True  # under "clipping_norm" it clips its update (DP), as the real edge does
    gone_for: tuple = ()  # message types the SuperLink answers for it with Node Unavailable (it left)
    malformed: str | None = None  # its TRAIN reply's arrays: one of MALFORMED (a malicious or broken edge)
    claims: float | None = None  # the num-examples it reports, whatever it trained on
    rank: int = 4  # under "lora-alpha" (lora_aggregation product) it fits each global to this rank, as the real edge
    alpha: float = 8.0
    sends_alpha: bool = True
    trains: bool = True  # False: under "lora-alpha" it sends back the start it was given
    queries: int = 0
    evals: list[int] = field(default_factory=list)

    def report(self) -> MetricRecord:
        record = LoadReport(
            name=self.name, request_rate=2.0, slo_attainment=self.attainment, spare_capacity=self.spare,
            queue_depth=0.0, running=1.0, train_examples=100, gain_per_ktok=None, train_tokens_per_s=1000.0,
            goodput=1.5, adapter_version=len(self.train_configs)).to_record()
        if self.hostile_metrics:
            record |= {"gain-per-ktok": 1e300, "train-examples": 1e10, "train-tokens-per-s": 1e308}
        return MetricRecord(record)

    def loss(self, value: float) -> float | list[float]:
        return [value, value, value] if self.hostile_metrics else value

    def delta(self) -> float:
        return 0.01 * (self.index + 1)


def _manifest(text: bytes) -> Array:
    return Array(np.frombuffer(text, np.uint8).copy())


MALFORMED = {  # what a malicious edge can put in its TRAIN reply's ArrayRecord (issue #34)
    "nested manifest": lambda: ArrayRecord({wire.PACKED: Array(np.zeros(3, np.float32)),
                                            wire.MANIFEST: _manifest(b"[" * 100_000 + b"]" * 100_000)}),
    "strings": lambda: ArrayRecord({wire.PACKED: Array(np.array(["x", "y", "z"])),
                                    wire.MANIFEST: _manifest(b'[["a", [3]]]')}),
    "keyed strings": lambda: ArrayRecord({k: Array(np.array(["a"] * int(np.prod(s)))) for k, s in KEYS.items()}),
    "huge shape": lambda: ArrayRecord({wire.PACKED: Array(np.zeros(3, np.float32)),
                                       wire.MANIFEST: _manifest(b'[["a", [1e30, 1]]]')}),
    "wrong sizes": lambda: ArrayRecord({wire.PACKED: Array(np.zeros(3, np.float32)),
                                        wire.MANIFEST: _manifest(b'[["a", [2, 2]]]')}),
    "not a list": lambda: ArrayRecord({wire.PACKED: Array(np.zeros(3, np.float32)), wire.MANIFEST: _manifest(b"7")}),
}
EDGES: dict[str, FakeEdge] = {}
client_app = ClientApp()


def _identity(edge: FakeEdge) -> ConfigRecord:
    return ConfigRecord({P.EDGE_NAME: edge.name})


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    edge = EDGES[context.node_config["name"]]
    edge.queries += 1
    if edge.query_fails:
        raise RuntimeError("engine not ready")
    return Message(RecordDict({P.REPORT: edge.report(), P.IDENTITY: _identity(edge)}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    edge = EDGES[context.node_config["name"]]
    cfg = dict(msg.content[P.CONFIG])
    rec = msg.content[P.ARRAYS]
    start = wire.unpack(rec) or seeded_initial_adapter(edge.rank)  # what the server sends is packed, as an edge reads it
    if P.LORA_ALPHA in cfg and wire.unpack(rec):
        start, _ = fit_rank(start, cfg[P.LORA_ALPHA], edge.rank, edge.alpha, seeded_initial_adapter(edge.rank))
    edge.train_configs.append(cfg)
    edge.train_arrays.append({k: v.copy() for k, v in start.items()})
    scale = 100.0 if edge.scale_from_round and cfg[P.SERVER_ROUND] >= edge.scale_from_round else 1.0
    frozen = cfg.get(P.FREEZE_A) and edge.honours_freeze
    local = {k: (v if frozen and "lora_A" in k else v + scale * edge.delta()).astype(np.float32)
             for k, v in start.items()}
    if P.LORA_ALPHA in cfg:  # mixed ranks: a full-rank step, so the products' sum has more than the server's rank
        local = product_step(start, edge, cfg[P.SERVER_ROUND]) if edge.trains else dict(start)
    if P.CLIPPING_NORM in cfg and edge.clips:
        from flwr.supercore.differential_privacy import compute_clip_model_update

        keys = sorted(local)
        mine = [local[k] for k in keys]
        compute_clip_model_update(mine, [start[k] for k in keys], cfg[P.CLIPPING_NORM])
        local = {k: np.asarray(v, np.float32) for k, v in zip(keys, mine)}
    if edge.nan_update:
        first = next(iter(local))
        local[first][0, 0] = np.nan
    examples = cfg[P.BUDGET_TOKENS] // 100 if edge.claims is None else edge.claims
    metrics = MetricRecord({P.NUM_EXAMPLES: examples, P.TRAIN_LOSS: edge.loss(2.0 - edge.delta()),
                            P.TRAIN_TOKENS: cfg[P.BUDGET_TOKENS], P.TRAIN_STEPS: 3, P.DEADLINE_HIT: 0,
                            P.SECONDS: 1.0, **({"extra": 1.0} if edge.extra_metric else {}),
                            **({P.LORA_ALPHA: edge.alpha} if P.LORA_ALPHA in cfg and edge.sends_alpha else {})})
    arrays = ArrayRecord({k: Array(v) for k, v in local.items()}) if edge.keyed_reply else wire.pack(local)
    if edge.malformed:
        arrays = MALFORMED[edge.malformed]()
    return Message(RecordDict({P.ARRAYS: arrays, P.METRICS: metrics, P.IDENTITY: _identity(edge)}), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    edge = EDGES[context.node_config["name"]]
    rnd = int(msg.content[P.CONFIG][P.SERVER_ROUND])
    edge.evals.append(rnd)
    arrays = wire.unpack(msg.content[P.ARRAYS])
    mean_abs = float(np.mean([np.abs(v).mean() for v in arrays.values()])) if arrays else 0.0
    metrics = MetricRecord({P.NUM_EXAMPLES: 16, P.EVAL_LOSS: edge.loss(3.0 - mean_abs - 0.1 * edge.index),
                            P.EVAL_ACCURACY: 0.5, P.ADAPTER_VERSION: float(0 if edge.refuses else rnd),
                            P.CANARY_REFUSED: int(edge.refuses)})
    return Message(RecordDict({P.METRICS: metrics, P.IDENTITY: _identity(edge)}), reply_to=msg)


class LocalGrid(Grid):
    """Synchronous in-process Grid: every pushed Message is handled at once by the node's ClientApp."""

    def __init__(self, edges: dict[int, FakeEdge]):
        self._run = Run.create_empty(run_id=1)
        self.edges = edges
        self.contexts = {nid: Context(run_id=1, node_id=nid, node_config={"name": e.name}, state=RecordDict(),
                                      run_config={}) for nid, e in edges.items()}
        self.sent: list[Message] = []
        self._replies: dict[str, Message] = {}

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.edges)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = str(uuid4())
            m.metadata.__dict__["_message_id"] = mid
            self.sent.append(m)
            if m.metadata.message_type in self.edges[m.metadata.dst_node_id].gone_for:
                # what the SuperLink sends when the node stopped heartbeating: from the SuperLink (node 1)
                reply = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=m)
                reply.metadata.__dict__["_src_node_id"] = 1
                self._replies[mid] = reply
                ids.append(mid)
                continue
            try:
                self._replies[mid] = client_app(m, self.contexts[m.metadata.dst_node_id])
            except Exception as e:  # what a SuperNode sends back when the ClientApp raises
                self._replies[mid] = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=m)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))

    def sent_of(self, message_type: str, round_: int | None = None) -> list[Message]:
        return [m for m in self.sent if m.metadata.message_type == message_type
                and (round_ is None or m.content["config"]["server-round"] == round_)]


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(autouse=True)
def _task_identity():
    # Flower 1.42: Message(...) reads the process-global task identity (set by the runtime)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def make_grid(**specials) -> LocalGrid:
    """Three edges: idle (node 101), busy (202: low spare), slow (303: below its SLO target)."""
    EDGES.clear()
    edges = {101: FakeEdge("idle", 0), 202: FakeEdge("busy", 1, spare=0.1), 303: FakeEdge("slow", 2, attainment=0.9)}
    for e in edges.values():
        for k, v in specials.get(e.name, {}).items():
            setattr(e, k, v)
        EDGES[e.name] = e
    return LocalGrid(edges)


def server_cfg(tmp_path, **overrides) -> ServerConfig:
    base = {"rounds": 2, "min_nodes": 3, "checkpoint_dir": str(tmp_path / "ckpt"),
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "balancer": {"round_deadline_s": 10, "target_attainment": 0.95}, "round_timeout_s": 30,
            "query_timeout_s": 5}
    return validate_config(ServerConfig, deep_merge(base, overrides), "test")


def fedavg(states: list[dict], weights: list[float]) -> dict:
    total = float(sum(weights))
    return {k: sum(w / total * s[k].astype(np.float64) for s, w in zip(states, weights)) for k in states[0]}


# ------------------------------------------------------------------------------ tests
def test_two_rounds_balancer_budgets_and_checkpoints(tmp_path):
    grid = make_grid(busy={"keyed_reply": True})  # one edge replies keyed by tensor: both forms aggregate
    cfg = server_cfg(tmp_path)
    result = build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=cfg.round_timeout_s)

    idle, busy, slow = EDGES["idle"], EDGES["busy"], EDGES["slow"]
    assert idle.queries == busy.queries == slow.queries == 2
    # one TRAIN message per taking-part edge, each with its own budget: cap = c·s·u·D plus a share of what is left
    for r in (1, 2):
        trains = {m.metadata.dst_node_id: dict(m.content["config"]) for m in grid.sent_of(MessageType.TRAIN, r)}
        assert set(trains) == {101, 202}                       # slow (303) got no TRAIN message
        assert trains[101] == {"server-round": r, "budget-tokens": 14000, "deadline-s": 10.0, "lr": 2e-4}
        # caps c·s·u·D = 9000 and 1000, plus half each of the 10000 the caps leave of B (equal weights)
        assert trains[202]["budget-tokens"] == 6000
    assert slow.train_configs == [] and slow.evals == [1, 2]   # it is still evaluated

    # round 1 starts from the empty global (edges use their seeded adapter); round 2 from the FedAvg
    assert all(len(m.content["arrays"]) == 0 for m in grid.sent_of(MessageType.TRAIN, 1))
    init = seeded_initial_adapter()
    want1 = fedavg([{k: v + idle.delta() for k, v in init.items()},
                    {k: v + busy.delta() for k, v in init.items()}], [140, 60])
    for k in KEYS:
        np.testing.assert_allclose(idle.train_arrays[1][k], want1[k], rtol=1e-5, atol=1e-7)
        assert result.arrays[k].numpy().dtype == np.float32

    # a checkpoint per round; metrics.json carries the decisions and per-edge metrics
    assert latest_complete_round(cfg.checkpoint_dir) == 2
    from collm.common.rounds import read_status

    status = read_status(cfg.checkpoint_dir)
    assert status["round"] == 2 and status["phase"] == "complete"
    ck1 = load_round(cfg.checkpoint_dir, 1)
    for k in KEYS:
        np.testing.assert_allclose(ck1.arrays[k], want1[k], rtol=1e-5, atol=1e-7)
    m1 = ck1.metrics
    decisions = {d["edge"]: d for d in m1["balancer"]}
    assert decisions["slow"]["take_part"] is False
    assert decisions["slow"]["reason"] == "below SLO target: attainment 0.90 < 0.95"
    assert decisions["busy"]["budget_tokens"] == 6000 and "spare 0.10" in decisions["busy"]["reason"]
    assert m1["kept"] == ["idle", "busy"] or m1["kept"] == ["busy", "idle"]
    assert set(m1["train"]) == {"idle", "busy"} and m1["train"]["idle"]["num-examples"] == 140
    assert set(m1["eval"]) == {"idle", "busy", "slow"} and 0 < m1["wall_s"] < cfg.round_timeout_s
    table = summary_table(load_all_metrics(cfg.checkpoint_dir))
    assert "slow" in table and len(table.splitlines()) == 4


def test_an_edge_that_refuses_the_new_global_is_recorded_and_logged(tmp_path):
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(handler)
    grid = make_grid(busy={"refuses": True})
    cfg = server_cfg(tmp_path, rounds=1)
    try:
        build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    finally:
        flwr_logger.removeHandler(handler)
    m = load_round(cfg.checkpoint_dir, 1).metrics
    assert m["refused_by"] == ["busy"] and m["eval"]["busy"]["canary-refused"] == 1
    assert m["eval"]["idle"]["canary-refused"] == 0
    assert any("busy refused to serve this round's global" in r for r in records)


def test_nan_update_is_dropped_and_the_round_completes(tmp_path):
    grid = make_grid(busy={"nan_update": True})
    cfg = server_cfg(tmp_path, rounds=1)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)

    m = load_round(cfg.checkpoint_dir, 1)
    assert m.metrics["kept"] == ["idle"]
    assert m.metrics["dropped"]["busy"].startswith("non-finite values in base_model.model.model.layers.0")
    want = {k: v + EDGES["idle"].delta() for k, v in seeded_initial_adapter().items()}
    for k in KEYS:
        np.testing.assert_allclose(m.arrays[k], want[k], rtol=1e-6)


def test_with_two_training_edges_a_100x_update_is_dropped_from_round_2_on(tmp_path):
    grid = make_grid(busy={"scale_from_round": 2})  # slow sits out: idle and busy are the round's two updates
    cfg = server_cfg(tmp_path, rounds=2)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    m1, m2 = load_round(cfg.checkpoint_dir, 1).metrics, load_round(cfg.checkpoint_dir, 2).metrics
    assert sorted(m1["kept"]) == ["busy", "idle"]  # round 1: two norms, no reference yet
    assert m2["kept"] == ["idle"] and "median" in m2["dropped"]["busy"]


def test_all_updates_dropped_keeps_previous_global(tmp_path):
    grid = make_grid(idle={"nan_update": True}, busy={"nan_update": True})
    cfg = server_cfg(tmp_path, rounds=1)
    result = build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    assert len(result.arrays) == 0
    ck = load_round(cfg.checkpoint_dir, 1)
    assert ck.arrays == {} and set(ck.metrics["dropped"]) == {"idle", "busy"}


def test_no_edge_takes_part_skips_training(tmp_path):
    grid = make_grid(idle={"attainment": 0.5}, busy={"attainment": 0.5})
    cfg = server_cfg(tmp_path, rounds=1)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    assert grid.sent_of(MessageType.TRAIN) == []
    assert grid.sent_of(MessageType.EVALUATE) == []  # nothing changed: the edges are not asked to evaluate
    ck = load_round(cfg.checkpoint_dir, 1)
    assert ck.metrics["training_skipped"] and ck.arrays == {}
    assert all(not d["take_part"] for d in ck.metrics["balancer"])


def test_after_a_round_that_changed_nothing_the_next_waits_idle_wait_s(tmp_path):
    grid = make_grid(idle={"attainment": 0.5}, busy={"attainment": 0.5})
    cfg = server_cfg(tmp_path, rounds=2, balancer={"round_deadline_s": 10, "idle_wait_s": 1.0})
    t0 = time.monotonic()
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert time.monotonic() - t0 >= 1.0
    assert grid.sent_of(MessageType.TRAIN) == [] and grid.sent_of(MessageType.EVALUATE) == []
    assert len(grid.sent_of(MessageType.QUERY)) == 6  # both rounds still asked every edge for a report


def test_resume_continues_from_last_complete_round(tmp_path):
    cfg_path = tmp_path / "server.yaml"
    cfg_path.write_text(f"""
rounds: 2
min_nodes: 3
checkpoint_dir: {tmp_path / 'ckpt'}
lora: {{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
balancer: {{round_deadline_s: 10}}
round_timeout_s: 30
""")

    def ctx(**rc):
        return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                       run_config={"config": str(cfg_path), **rc})

    server_app(make_grid(), ctx())                       # rounds 1-2 through the ServerApp
    ck2 = load_round(tmp_path / "ckpt", 2)

    grid = make_grid()                                   # a restarted server, asked for 3 rounds
    server_app(grid, ctx(**{"num-server-rounds": 3}))
    assert latest_complete_round(tmp_path / "ckpt") == 3
    trains = grid.sent_of(MessageType.TRAIN)
    assert {m.content["config"]["server-round"] for m in trains} == {3}     # only round 3 ran
    for k in KEYS:                                                          # from round 2's global
        np.testing.assert_array_equal(EDGES["idle"].train_arrays[0][k], ck2.arrays[k])
    assert EDGES["idle"].evals == [3]

    grid = make_grid()                                   # nothing left to do
    server_app(grid, ctx(**{"num-server-rounds": 3}))
    assert grid.sent == []


def test_the_learning_rate_sent_decays_each_round_down_to_its_floor(tmp_path):
    """balancer.lr_decay / lr_min: round 1 trains at lr, each later round at the last one's times the decay,
    never below the floor; each round's metrics.json says which rate it sent."""
    grid = make_grid()
    cfg = server_cfg(tmp_path, rounds=3, balancer={"lr": 4e-4, "lr_decay": 0.5, "lr_min": 1.5e-4})
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=3, timeout=cfg.round_timeout_s)
    for r, want in ((1, 4e-4), (2, 2e-4), (3, 1.5e-4)):
        sent = [dict(m.content["config"])["lr"] for m in grid.sent_of(MessageType.TRAIN, r)]
        assert len(sent) == 2 and sent == pytest.approx([want] * 2), (r, sent)
        assert load_round(cfg.checkpoint_dir, r).metrics["lr"] == pytest.approx(want)


def test_a_resumed_run_continues_the_lr_schedule_and_an_empty_round_does_not_decay_it(tmp_path):
    """Three rounds done, the second with nothing kept (every edge busy): round 4 is the schedule's third step."""
    cfg = server_cfg(tmp_path, rounds=4, balancer={"lr": 4e-4, "lr_decay": 0.5, "lr_min": 1e-5})
    strategy = build_strategy(cfg, round_offset=3)
    strategy.restore_history({1: {"kept": ["idle"]}, 2: {"kept": []}, 3: {"kept": ["idle", "busy"]}})
    grid = make_grid()
    strategy.start(grid, ArrayRecord(), num_rounds=1, timeout=cfg.round_timeout_s)
    sent = [dict(m.content["config"])["lr"] for m in grid.sent_of(MessageType.TRAIN, 4)]
    assert len(sent) == 2 and sent == pytest.approx([1e-4] * 2)  # 4e-4 x 0.5^2, not 0.5^3
    assert load_round(cfg.checkpoint_dir, 4).metrics["lr"] == pytest.approx(1e-4)


def test_fedprox_puts_proximal_mu_in_the_config(tmp_path):
    grid = make_grid()
    cfg = server_cfg(tmp_path, strategy="fedprox", proximal_mu=0.05, rounds=1)
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CollmFedProx)
    strategy.start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    configs = [dict(m.content["config"]) for m in grid.sent_of(MessageType.TRAIN)]
    assert len(configs) == 2 and all(c["proximal-mu"] == 0.05 for c in configs)
    assert all({"budget-tokens", "deadline-s", "lr", "server-round"} <= set(c) for c in configs)


def test_fedadam_runs_and_resumes_its_moments(tmp_path):
    grid = make_grid()
    cfg = server_cfg(tmp_path, strategy="fedadam", rounds=2, fedadam={"eta": 0.01})
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CollmFedAdam)
    result = strategy.start(grid, ArrayRecord(), num_rounds=2, timeout=30)

    # round 1: empty global, so the FedAvg of the updates becomes the first global
    ck1, ck2 = load_round(cfg.checkpoint_dir, 1), load_round(cfg.checkpoint_dir, 2)
    init = seeded_initial_adapter()
    want1 = fedavg([{k: v + EDGES["idle"].delta() for k, v in init.items()},
                    {k: v + EDGES["busy"].delta() for k, v in init.items()}], [140, 60])
    for k in KEYS:
        np.testing.assert_allclose(ck1.arrays[k], want1[k], rtol=1e-5, atol=1e-7)
    # round 2: a server Adam step of size ≈ eta per coordinate (not the plain FedAvg)
    step = {k: ck2.arrays[k] - ck1.arrays[k] for k in KEYS}
    assert all(np.isfinite(v).all() and result.arrays[k].numpy().dtype == np.float32 for k, v in step.items())
    assert all(0 < np.abs(v).max() <= 0.011 for v in step.values())
    assert set(ck2.server_state) == {"m_t", "v_t"}

    # resume: moments come back from the checkpoint
    resumed = build_strategy(cfg.model_copy(update={"rounds": 3}), round_offset=2, server_state=ck2.server_state)
    for k in KEYS:
        np.testing.assert_array_equal(resumed.m_t[k], ck2.server_state["m_t"][k])
    run(make_grid(), cfg.model_copy(update={"rounds": 3}))
    assert latest_complete_round(cfg.checkpoint_dir) == 3


def test_failed_load_report_and_differing_metric_keys(tmp_path):
    grid = make_grid(busy={"query_fails": True}, slow={"attainment": 0.99, "extra_metric": True})
    cfg = server_cfg(tmp_path, rounds=1)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    ck = load_round(cfg.checkpoint_dir, 1)
    decisions = {d["node_id"]: d for d in ck.metrics["balancer"]}
    assert decisions[202]["take_part"] is False
    assert decisions[202]["reason"] == "load report failed: RuntimeError: engine not ready"
    assert {m.metadata.dst_node_id for m in grid.sent_of(MessageType.TRAIN)} == {101, 303}
    # slow's extra metric key would make flwr's FedAvg reject the round; only common keys are averaged
    assert sorted(ck.metrics["kept"]) == ["idle", "slow"] and "extra" not in ck.metrics["train_aggregate"]
    assert ck.metrics["train"]["slow"]["extra"] == 1.0


def test_an_edge_with_list_metrics_and_a_huge_load_report_cannot_end_the_run(tmp_path):
    """flwr's metric average raised on a list beside a number (train-loss, eval-loss), and a load report's
    finite 1e300 overflowed the balancer to NaN: either ended the ServerApp. Now the round goes on, the edge's
    update is kept, only its lists are left out of the averages, and its report is read clamped."""
    grid = make_grid(slow={"attainment": 0.99, "hostile_metrics": True})
    cfg = server_cfg(tmp_path, rounds=2)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert latest_complete_round(cfg.checkpoint_dir) == 2
    ck = load_round(cfg.checkpoint_dir, 2)
    assert "slow" in ck.metrics["kept"] and P.TRAIN_LOSS not in ck.metrics["train_aggregate"]
    assert P.EVAL_LOSS not in ck.metrics["eval_aggregate"] and P.EVAL_ACCURACY in ck.metrics["eval_aggregate"]
    decisions = {d["edge"]: d for d in ck.metrics["balancer"]}
    assert all(d["budget_tokens"] >= 0 for d in decisions.values()) and decisions["slow"]["take_part"]


def test_load_report_roundtrips_and_unknowns_parse_as_none():
    r = LoadReport("e", 2.0, None, 0.5, 1.0, 3.0, 12, -0.2, 900.0, 1.5, 4)
    assert LoadReport.from_record("e", r.to_record()) == r
    assert tuple(r.to_record()) == LoadReport.keys()
    u = LoadReport.from_record("e", {"slo-attainment": -1.0, "gain-per-ktok": -1.0, "spare-capacity": float("nan"),
                                     "train-examples": 12.0})
    assert u.slo_attainment is None and u.gain_per_ktok is None and u.spare_capacity == 0.0
    assert u.train_examples == 12 and u.train_tokens_per_s == 0.0


# ------------------------------------------------------------------------------ federation options
def test_fraction_train_rotates_participation_and_every_edge_still_evaluates(tmp_path):
    grid = make_grid()
    cfg = server_cfg(tmp_path, rounds=3, fraction_train=0.34, balancer={"target_attainment": None})
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=3, timeout=30)
    trained = [[m.metadata.dst_node_id for m in grid.sent_of(MessageType.TRAIN, r)] for r in (1, 2, 3)]
    # k = max(int(3 x 0.34), 1) = 1: never-trained edges first, the most spare capacity among them first
    assert trained == [[101], [303], [202]]
    assert all(e.evals == [1, 2, 3] for e in EDGES.values())  # fraction_evaluate 1: every edge serves each global
    m2 = load_round(cfg.checkpoint_dir, 2).metrics
    reasons = {d["edge"]: d["reason"] for d in m2["balancer"]}
    assert reasons["idle"].startswith("not chosen: 1 of 3 edges train this round") and "in round 1" in reasons["idle"]
    assert "trained last never" in reasons["busy"] and m2["kept"] == ["slow"]


def test_fraction_evaluate_sends_each_global_to_that_share(tmp_path):
    grid = make_grid()
    cfg = server_cfg(tmp_path, rounds=2, fraction_evaluate=0.34)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert sorted(r for e in EDGES.values() for r in e.evals) == [1, 2]  # one edge per round evaluates
    assert len(grid.sent_of(MessageType.TRAIN, 2)) == 2  # training is not reduced by it


def test_ffa_lora_keeps_a_at_the_seeded_init_and_drops_an_update_that_moved_it(tmp_path):
    grid = make_grid(slow={"attainment": 0.99, "honours_freeze": False})
    cfg = server_cfg(tmp_path, rounds=2, lora_aggregation="ffa")
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert all(m.content["config"]["lora-freeze-a"] == 1 for m in grid.sent_of(MessageType.TRAIN))
    init = seeded_initial_adapter()
    for r in (1, 2):
        m = load_round(cfg.checkpoint_dir, r)
        assert sorted(m.metrics["kept"]) == ["busy", "idle"]
        assert "lora_aggregation ffa: the update changed" in m.metrics["dropped"]["slow"]
        for k in KEYS:
            if "lora_A" in k:
                np.testing.assert_array_equal(m.arrays[k], init[k])  # A never moves: B·A averages exactly
    b = next(k for k in KEYS if "lora_B" in k)
    ck1 = load_round(cfg.checkpoint_dir, 1)
    n = [ck1.metrics["train"][e]["num-examples"] for e in ("idle", "busy")]
    want = fedavg([{b: init[b] + EDGES["idle"].delta()}, {b: init[b] + EDGES["busy"].delta()}], n)
    np.testing.assert_allclose(ck1.arrays[b], want[b], rtol=1e-5, atol=1e-7)


def product_step(start: dict, edge: FakeEdge, rnd: int) -> dict:
    rng = np.random.default_rng(100 * edge.index + rnd)
    return {k: (v + edge.delta() * rng.standard_normal(v.shape)).astype(np.float32) for k, v in sorted(start.items())}


def dense(state: dict, alpha: float) -> dict[str, np.ndarray]:
    """Module -> alpha/r · B·A, the weight change an adapter makes."""
    return {k: alpha / state[k].shape[0] * state[k.replace("lora_A", "lora_B")].astype(np.float64)
            @ state[k].astype(np.float64) for k in state if "lora_A" in k}


def test_product_aggregation_mixes_ranks_exactly_and_truncates_to_the_server_rank(tmp_path):
    """Edges of ranks 1, 2 and 3 (alpha 8, 4, 6) under a server of rank 4: the new global is the best rank-4
    approximation of the old one plus the example-weighted mean of each edge's change from its own start
    (the old global cut to its rank), as products."""
    grid = make_grid(idle={"rank": 1, "alpha": 8.0}, busy={"rank": 2, "alpha": 4.0},
                     slow={"rank": 3, "alpha": 6.0, "attainment": 0.99})
    cfg = server_cfg(tmp_path, rounds=2, lora_aggregation="product")
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert all(m.content["config"]["lora-alpha"] == 8 for m in grid.sent_of(MessageType.TRAIN))
    assert all(m.content["config"]["lora-alpha"] == 8 for m in grid.sent_of(MessageType.EVALUATE))
    for r in (1, 2):
        m = load_round(cfg.checkpoint_dir, r)
        assert sorted(m.metrics["kept"]) == ["busy", "idle", "slow"] and not m.metrics["dropped"]
        assert {k: v.shape for k, v in m.arrays.items()} == KEYS  # the server's rank, what PEFT loads
        assert 0.9 < m.metrics["rank_energy"] <= 1.0
    # round 2 by hand: each edge's start is the round-1 global at its rank, its update adds its delta
    g1, g2 = load_round(cfg.checkpoint_dir, 1), load_round(cfg.checkpoint_dir, 2)
    changes, weights = [], []
    for e in (EDGES["idle"], EDGES["busy"], EDGES["slow"]):
        start, _ = fit_rank(g1.arrays, 8.0, e.rank, e.alpha, seeded_initial_adapter(e.rank))
        assert e.train_arrays[1].keys() == start.keys()
        for k in start:
            np.testing.assert_allclose(e.train_arrays[1][k], start[k], atol=1e-6)  # the start it was sent
        local, begin = dense(product_step(start, e, 2), e.alpha), dense(start, e.alpha)
        changes.append({m: local[m] - begin[m] for m in local})
        weights.append(g2.metrics["train"][e.name]["num-examples"])
    got, old = dense(g2.arrays, 8.0), dense(g1.arrays, 8.0)
    for mod in got:
        new = old[mod] + sum(w * d[mod] for w, d in zip(weights, changes)) / sum(weights)
        u, sv, vt = np.linalg.svd(new)
        np.testing.assert_allclose(got[mod], (u[:, :4] * sv[:4]) @ vt[:4], atol=1e-5)
        assert np.linalg.matrix_rank(new) > 4  # the truncation did something


def test_product_aggregation_leaves_the_global_as_it_is_when_nobody_trains(tmp_path):
    """Rank-1 and rank-2 edges start from the rank-4 global cut to their rank; if they send that start back
    unchanged, the global must not move (averaging the locals would pull it to their cut-down copies)."""
    grid = make_grid(idle={"rank": 1}, busy={"rank": 2}, slow={"attainment": 0.99})
    cfg = server_cfg(tmp_path, rounds=2, lora_aggregation="product")
    strategy = build_strategy(cfg)
    strategy.start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    for e in EDGES.values():
        e.trains = False
    build_strategy(cfg, round_offset=1).start(grid, ArrayRecord({k: Array(v) for k, v in
                                                                 load_round(cfg.checkpoint_dir, 1).arrays.items()}),
                                              num_rounds=1, timeout=30)
    g1, g2 = dense(load_round(cfg.checkpoint_dir, 1).arrays, 8.0), dense(load_round(cfg.checkpoint_dir, 2).arrays, 8.0)
    assert sorted(load_round(cfg.checkpoint_dir, 2).metrics["kept"]) == ["busy", "idle", "slow"]
    for mod in g1:
        assert np.linalg.matrix_rank(g1[mod]) > 2  # the low-rank edges were sent a cut-down copy
        np.testing.assert_allclose(g2[mod], g1[mod], atol=1e-5)


def test_product_aggregation_leaves_out_a_rank_above_the_server_and_a_reply_without_alpha(tmp_path):
    grid = make_grid(busy={"rank": 6}, slow={"sends_alpha": False, "attainment": 0.99})
    cfg = server_cfg(tmp_path, rounds=1, lora_aggregation="product")
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    m = load_round(cfg.checkpoint_dir, 1).metrics
    assert m["kept"] == ["idle"]
    assert m["dropped"]["busy"] == "rank 6 is above the server's lora.r 4"
    assert "no numeric 'lora-alpha'" in m["dropped"]["slow"]


def test_dp_clips_averages_equally_adds_calibrated_noise_and_accounts_epsilon(tmp_path):
    from collm.server.privacy import PrivacyLedger, Release

    grid = make_grid(busy={"clips": False})  # clips nothing: caught from round 2 (round 1 has no global to measure)
    cfg = server_cfg(tmp_path, rounds=2, dp={"clipping_norm": 0.1, "noise_multiplier": 1.0})
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=30)
    assert all(m.content["config"]["clipping_norm"] == 0.1 for m in grid.sent_of(MessageType.TRAIN))
    ck1, ck2 = load_round(cfg.checkpoint_dir, 1), load_round(cfg.checkpoint_dir, 2)
    # round 1: idle's update is clipped to 0.1 (each of the d coordinates moves 0.1 / sqrt(d)); busy's is not
    init = seeded_initial_adapter()
    d = sum(v.size for v in init.values())
    mean_delta = (0.1 / np.sqrt(d) + EDGES["busy"].delta()) / 2  # equal weights, not 140 : 60
    residual = np.concatenate([(ck1.arrays[k] - init[k] - mean_delta).ravel() for k in KEYS])
    p1 = ck1.metrics["privacy"]
    assert p1["noise_std"] == pytest.approx(1.0 * 0.1 / 2) and p1["updates"] == 2
    assert abs(residual.mean()) < 0.01 and 0.85 * 0.05 < residual.std() < 1.15 * 0.05
    assert p1["epsilon"] == pytest.approx(PrivacyLedger(1e-5, [Release(1.0, 2)]).spent().epsilon)
    # round 2: the unclipped update is dropped; one more release composes
    assert ck2.metrics["kept"] == ["idle"] and "above clipping_norm 0.1" in ck2.metrics["dropped"]["busy"]
    p2 = ck2.metrics["privacy"]
    assert p2["noise_std"] == pytest.approx(0.1) and p2["releases"] == 2 and p2["epsilon"] > p1["epsilon"]
    assert ck1.metrics["train"]["idle"]["num-examples"] == 140  # the edges' metrics are kept as reported


def test_dp_stops_training_at_max_epsilon_and_a_resumed_run_continues_the_ledger(tmp_path):
    from collm.server.privacy import PrivacyLedger, Release

    one = PrivacyLedger(1e-5, [Release(1.0, 2)]).spent().epsilon
    two = PrivacyLedger(1e-5, [Release(1.0, 2)] * 2).spent().epsilon
    dp = {"clipping_norm": 0.1, "noise_multiplier": 1.0, "max_epsilon": (one + two) / 2}
    cfg = server_cfg(tmp_path, rounds=1, dp=dp)
    run(make_grid(), cfg)
    assert load_round(cfg.checkpoint_dir, 1).metrics["privacy"]["epsilon"] == pytest.approx(one)
    grid = make_grid()
    run(grid, cfg.model_copy(update={"rounds": 2}))  # resumed: round 2 would pass max_epsilon
    m2 = load_round(cfg.checkpoint_dir, 2).metrics
    assert grid.sent_of(MessageType.TRAIN) == [] and m2["training_skipped"]
    assert all(d["reason"].startswith("privacy budget: this round would bring epsilon to") for d in m2["balancer"])


def test_an_edge_that_left_is_named_in_the_round_and_the_round_completes(tmp_path):
    grid = make_grid(busy={"gone_for": (MessageType.TRAIN, MessageType.EVALUATE)})
    cfg = server_cfg(tmp_path, rounds=1)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    m = load_round(cfg.checkpoint_dir, 1).metrics
    assert m["kept"] == ["idle"]
    assert m["dropped"]["busy"] == "error reply: Error: Node Unavailable"     # not "node-1"
    assert m["eval"]["busy"] == {"error": "Error: Node Unavailable"} and set(m["eval"]) == {"idle", "busy", "slow"}


class LeavingGrid(LocalGrid):
    """An edge that dies right after flwr counted it: every count after the first of a sampling lacks it."""

    def __init__(self, edges, leaver: int):
        super().__init__(edges)
        self.leaver, self.calls = leaver, 0

    def get_node_ids(self):
        self.calls += 1
        if self.calls > 200:
            raise RuntimeError("the strategy keeps waiting for an edge that left")
        return list(self.edges) if self.calls == 1 else [n for n in self.edges if n != self.leaver]


def test_a_round_does_not_wait_for_an_edge_that_left_after_it_was_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(strategy_utils, "sleep", lambda s: None)  # flwr's wait, were it reached, fails at once
    grid = make_grid(busy={"gone_for": (MessageType.TRAIN, MessageType.EVALUATE)})
    grid = LeavingGrid(grid.edges, leaver=202)
    cfg = server_cfg(tmp_path, rounds=1, min_nodes=2)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    m = load_round(cfg.checkpoint_dir, 1).metrics
    assert m["kept"] == ["idle"] and m["dropped"]["busy"] == "error reply: Error: Node Unavailable"


def test_the_snapshot_answers_afresh_below_the_minimum_then_keeps_its_one_list():
    counts = iter([1, 2, 3, 2, 1])
    grid = LocalGrid({})
    grid.get_node_ids = lambda: list(range(next(counts)))
    snap = NodeSnapshot(grid, 3)
    assert [len(snap.get_node_ids()) for _ in range(4)] == [1, 2, 3, 3]  # flwr waits on the first two


def test_the_first_round_still_waits_for_every_edge_to_connect(tmp_path, monkeypatch):
    slept: list[float] = []

    def nap(s):  # flwr's wait between counts; a snapshot stuck below the minimum would wait forever
        slept.append(s)
        assert len(slept) < 50, "still waiting for edges that are all connected"

    monkeypatch.setattr(strategy_utils, "sleep", nap)
    grid = make_grid()
    connected = iter([1, 2] + [3] * 100)  # the edges connect one by one
    grid.get_node_ids = lambda: list(grid.edges)[:next(connected)]
    build_strategy(server_cfg(tmp_path, rounds=1)).start(grid, ArrayRecord(), num_rounds=1, timeout=30)
    assert slept == [1]  # counted 1 (flwr sizes its sample), then waited once at 2
    assert {m.metadata.dst_node_id for m in grid.sent_of(MessageType.QUERY)} == set(grid.edges)


# ------------------------------------------------------------------------------ config
def test_shipped_server_config_loads_and_builds():
    from collm.server.config import load_server_config

    cfg = load_server_config({})                                   # configs/server.yaml
    assert cfg.strategy == "fedavg" and cfg.round_timeout_s > cfg.balancer.round_deadline_s
    assert load_server_config({"rounds": 7, "strategy": "fedadam"}).rounds == 7
    assert isinstance(build_strategy(load_server_config({"strategy": "fedadam"})), CollmFedAdam)


def test_the_commented_dp_example_in_the_shipped_config_is_valid(tmp_path):
    import re

    from collm.server.config import load_server_config

    text = (Path(__file__).resolve().parents[1] / "configs" / "server.yaml").read_text()
    uncommented = re.sub(r"^# ((?:dp|min_round_nodes):|  \w+:)", r"\1", text, flags=re.M)
    assert uncommented != text
    (tmp_path / "dp.yaml").write_text(uncommented)
    cfg = load_server_config({"config": str(tmp_path / "dp.yaml")})
    assert cfg.dp is not None and cfg.dp.clipping_norm == 1.0 and cfg.dp.max_epsilon == 10
    assert cfg.min_round_nodes == 1


@pytest.mark.parametrize("text, message", [
    ("balancer: {spare_use: 2}", "x.yaml: balancer.spare_use: expected less than or equal to 1, got 2"),
    ("strategy: fedsgd", "x.yaml: strategy: expected 'fedavg', 'fedprox', 'fedadam', 'fedmedian', 'fedtrimmedavg' or 'krum', got 'fedsgd'"),
    ("robust: {norm: 3}", "x.yaml: robust.norm: unknown key (allowed here: max_weight_ratio, norm_k, weighting)"),
    ("round_timeout_s: 60", "round_timeout_s (60) must be larger than balancer.round_deadline_s (120)"),
    ("fraction_train: 0", "x.yaml: fraction_train: expected greater than 0, got 0"),
    ("balancer: {lr_decay: 1.5}", "x.yaml: balancer.lr_decay: expected less than or equal to 1, got 1.5"),
    ("balancer: {lr: 1.0e-4, lr_min: 2.0e-4}", "lr_min (0.0002) is above lr (0.0001): set balancer.lr_min to at most "
     "balancer.lr"),
    ("lora_aggregation: fedex", "x.yaml: lora_aggregation: expected 'separate', 'ffa' or 'product', got 'fedex'"),
    ("dp: {noise_multiplier: 1.0}", "x.yaml: dp.clipping_norm: "),
    ("{strategy: fedadam, dp: {clipping_norm: 1}}", "dp: works with strategy fedavg or fedprox"),
    ("{lora_aggregation: product, strategy: fedadam}", "lora_aggregation: product averages the products B.A itself; "
     "it works with strategy fedavg or fedprox and without dp (got strategy fedadam)"),
    ("{lora_aggregation: product, dp: {clipping_norm: 1}}", "(got strategy fedavg, dp on)"),
])
def test_bad_server_config_is_a_one_line_user_error(tmp_path, monkeypatch, text, message):
    from collm.common.errors import UserError
    from collm.server.config import load_server_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.yaml").write_text(text)
    with pytest.raises(UserError) as e:
        load_server_config({"config": "x.yaml"})
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_reply_is_left_out_and_the_run_goes_on(tmp_path, kind):
    """Whatever a malicious edge's reply holds, its update is dropped with the reason and every round completes
    with the honest edge's update as the aggregate."""
    grid = make_grid(busy={"malformed": kind})
    cfg = server_cfg(tmp_path)
    result = build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=cfg.round_timeout_s)
    assert latest_complete_round(cfg.checkpoint_dir) == 2
    for r in (1, 2):
        m = load_round(cfg.checkpoint_dir, r).metrics
        assert m["kept"] == ["idle"] and m["dropped"]["busy"].startswith("malformed reply"), m["dropped"]
    idle = EDGES["idle"]
    for k in KEYS:  # round 2's global is idle's round-2 update on top of round 1's (its own)
        np.testing.assert_allclose(result.arrays[k].numpy(), idle.train_arrays[1][k] + idle.delta(), rtol=1e-5)


@pytest.mark.parametrize("weighting,ratio,want", [("examples", 4.0, [140, 560]), ("equal", 4.0, [1, 1]),
                                                  ("examples", None, [140, 1e30])])
def test_an_edge_claiming_1e30_examples_weighs_at_most_ratio_times_the_others(tmp_path, weighting, ratio, want):
    grid = make_grid(busy={"claims": 1e30})
    cfg = server_cfg(tmp_path, robust={"weighting": weighting, "max_weight_ratio": ratio})
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=cfg.round_timeout_s)
    idle, busy = EDGES["idle"], EDGES["busy"]
    init = seeded_initial_adapter()
    expected = fedavg([{k: v + idle.delta() for k, v in init.items()}, {k: v + busy.delta() for k, v in init.items()}],
                      want)
    ck = load_round(cfg.checkpoint_dir, 1)
    for k in KEYS:
        np.testing.assert_allclose(ck.arrays[k], expected[k], rtol=1e-5, atol=1e-7)
    assert ck.metrics["capped"] == ({"busy": 560.0} if weighting == "examples" and ratio else {})


def test_capped_weights():
    from collm.server.robust import capped_weights

    assert capped_weights([100, 1e30], 4) == [100, 400]
    assert capped_weights([100, 120, 1e9], 2) == [100, 120, 220]  # 2 x the median of (100, 120)
    out = capped_weights([100, float("nan"), 0, 1e9], 3)
    assert out[0] == 100 and np.isnan(out[1]) and out[2] == 0 and out[3] == 300  # bad claims stay for the screen
    assert capped_weights([5e9], 2) == [5e9] and capped_weights([100, 1e30], None) == [100, 1e30]



@pytest.mark.parametrize("strategy", ["fedmedian", "fedtrimmedavg", "krum"])
def test_a_robust_aggregation_keeps_a_poisoned_update_from_moving_the_global(tmp_path, strategy):
    """Three training edges, one sending 100x its update, the norm screen off: FedAvg would follow it; the
    median, the trimmed mean (beta 0.34: one of three cut at each end) and Krum stay with the honest two."""
    grid = make_grid(busy={"scale_from_round": 1}, slow={"attainment": 0.99})
    cfg = server_cfg(tmp_path, strategy=strategy, trim_beta=0.34, krum_malicious=1, robust={"norm_k": 1e9})
    result = build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=1, timeout=cfg.round_timeout_s)
    init = seeded_initial_adapter()
    honest = sorted(EDGES[n].delta() for n in ("idle", "slow"))
    for k in KEYS:
        moved = result.arrays[k].numpy() - init[k]
        assert np.all(moved >= honest[0] - 1e-6) and np.all(moved <= honest[1] + 1e-6), (strategy, k)
    from collm.server.strategies import STRATEGIES

    assert load_round(cfg.checkpoint_dir, 1).metrics["strategy"] == STRATEGIES[strategy][0].__name__


def test_collm_server_status_prints_the_rounds_from_the_checkpoints(tmp_path, capsys):
    from collm.server.cli import main

    grid = make_grid(busy={"malformed": "strings"})
    cfg = server_cfg(tmp_path)
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=cfg.round_timeout_s)
    with pytest.raises(SystemExit) as done:
        main(["status", cfg.checkpoint_dir])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "holdout eval loss per edge" in out and "round 2: busy: malformed reply" in out
    assert out.strip().endswith("now: round 2, complete")
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path / "nope")])
    assert e.value.code == 2 and "no such folder" in capsys.readouterr().err
