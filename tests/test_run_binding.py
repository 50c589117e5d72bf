"""Edges bound to their federation (issue #34): a run on the same SuperLink without the federation key cannot
make an edge serve its adapter, and the CoLLM ServerApp signs every instruction it sends."""

from uuid import uuid4

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from helpers import LiveEdge, random_adapter_state, tiny_config
from test_strategy import LocalGrid, _task_identity, make_grid, server_cfg  # noqa: F401 - its autouse fixture

from collm.common import protocol as P
from collm.common import wire
from collm.common.run_proof import PROOF_KEY, proof, refusal
from collm.edge_client.federation.client import FederatedEdge
from collm.server.strategies import build_strategy

KEY = "federation-secret"


def test_the_proof_binds_key_run_and_round():
    good = proof(KEY, 7, 3)
    assert refusal((), 7, 3, None) is None  # no key configured: every run is obeyed, as before
    assert refusal((KEY,), 7, 3, good) is None and refusal(("old", KEY), 7, 3, good) is None
    assert "carries no" in refusal((KEY,), 7, 3, None)
    for run, rnd, key in ((8, 3, KEY), (7, 4, KEY), (7, 3, "other")):  # another run, round or key
        assert "another key" in refusal((KEY,), 7, 3, proof(key, run, rnd))


def evaluate_message(run_id: int, rnd: int, state: dict, signed_with: str | None) -> Message:
    TaskIdentity.run_id = run_id
    cfg = {P.SERVER_ROUND: rnd, **({PROOF_KEY: proof(signed_with, run_id, rnd)} if signed_with else {})}
    arrays = wire.pack({k: v.numpy() for k, v in state.items()})
    m = Message(RecordDict({P.ARRAYS: arrays, P.CONFIG: ConfigRecord(cfg)}), dst_node_id=5,
                message_type=MessageType.EVALUATE)
    m.metadata.__dict__["_message_id"] = str(uuid4())
    return m


def test_an_edge_with_a_run_key_ignores_a_foreign_run(tmp_path):
    e = LiveEdge(tiny_config(state_dir=str(tmp_path / "s"), adapters={"canary_margin": None},
                             federation={"run_key": {"keys": [KEY]}}))
    try:
        fed = FederatedEdge(e.runtime)
        app = fed.client_app()
        ctx = Context(run_id=99, node_id=5, node_config={}, state=RecordDict(), run_config={})
        foreign = random_adapter_state(e.engine, 66)
        for signed in (None, "guessed-key"):  # a foreign run: unsigned, or signed with another key
            reply = app(evaluate_message(99, 10**6, foreign, signed), ctx)
            assert reply.has_error() and "federation.run_key" in reply.error.reason
        assert e.engine.shadow.current_version == 0 and e.runtime.latest_round == -1 and fed.foreign_refused == 2
        reply = app(evaluate_message(1, 1, random_adapter_state(e.engine, 1), KEY), ctx)  # the real run
        assert not reply.has_error() and e.engine.shadow.current_version == 1 and e.runtime.latest_round == 1
    finally:
        e.close()


def test_the_server_signs_every_instruction(tmp_path):
    grid: LocalGrid = make_grid()
    cfg = server_cfg(tmp_path, federation_key={"keys": [KEY]})
    build_strategy(cfg).start(grid, ArrayRecord(), num_rounds=2, timeout=cfg.round_timeout_s)
    kinds = set()
    for m in grid.sent:
        c = m.content["config"]
        kinds.add(m.metadata.message_type)
        assert refusal((KEY,), grid.run.run_id, int(c[P.SERVER_ROUND]), c.get(PROOF_KEY)) is None
    assert kinds == {MessageType.QUERY, MessageType.TRAIN, MessageType.EVALUATE}
    assert len(grid.sent) >= 6  # two rounds: queries, trains and evaluations
