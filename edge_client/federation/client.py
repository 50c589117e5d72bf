"""The edge's side of a federated round, as a Flower ClientApp running on the resident engine.

* query:    the load report the balancer decides from;
* train:    load the global adapter into the training adapter, train the assigned budget through
            the engine's co-scheduler (serving never waits for it), return the local adapter;
* evaluate: serve the new global adapter (shadow swap, no restart) and report its holdout loss.

`FederatedEdge(runtime).client_app()` is what `SuperNodeExecutor` runs in-process. The module's
`app` exists so the Flower app bundle names a ClientApp; it runs on whichever edge `bind` chose.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from collm.common import protocol as P

from collm.edge_client.runtime import EdgeRuntime
from collm.edge_client.training.trainer import TrainBudget

log = logging.getLogger("collm.federation")


def to_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(arrays[k].numpy(), dtype=np.float32)) for k in arrays.keys()}


def to_arrays(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """float32 on the wire (bf16 cannot go into an ArrayRecord)."""
    return ArrayRecord({k: Array(v.detach().to("cpu", torch.float32).numpy()) for k, v in state.items()})


def _num(v) -> float:
    return P.UNKNOWN if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)


class FederatedEdge:
    def __init__(self, runtime: EdgeRuntime):
        self.rt = runtime
        self.lock = threading.Lock()
        self.rounds_trained = 0
        self.last_round: int | None = None
        self.last_train: dict | None = None
        self.last_eval: dict | None = None
        self._eval_history: dict[int, float] = {}  # global version -> holdout loss on this edge
        self._tokens_by_round: dict[int, int] = {}

    # ------------------------------------------------------------------ handlers
    def client_app(self) -> ClientApp:
        app = ClientApp()
        app.query()(self.query)
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        return app

    def _identity(self) -> ConfigRecord:
        return ConfigRecord({P.EDGE_NAME: self.rt.cfg.name})

    def query(self, msg: Message, context: Context) -> Message:
        report = MetricRecord(self.report())
        return Message(RecordDict({P.REPORT: report, P.IDENTITY: self._identity()}), reply_to=msg)

    def report(self) -> dict[str, float]:
        eng = self.rt.engine
        snap = eng.snapshot()
        ref_tokens = max(1, eng.cfg.training.micro_batch_size * eng.cfg.training.max_seq_len // 2)
        return {
            "request-rate": float(snap["request_rate"]),
            "slo-attainment": _num(snap["slo_attainment"]),
            "spare-capacity": float(snap["spare_capacity"]),
            "queue-depth": float(snap["waiting"]),
            "running": float(snap["running"]),
            "train-examples": float(len(eng.trainer.stream.examples) if eng.trainer else 0),
            "gain-per-ktok": _num(self.gain_per_ktok()),
            "train-tokens-per-s": ref_tokens / max(eng.costs.microbatch_time("train", ref_tokens), 1e-6),
            "goodput": float(snap["goodput"]),
            "adapter-version": float(snap["adapter_version"]),
        }

    def gain_per_ktok(self) -> float | None:
        """Holdout-loss drop per 1k tokens this edge trained, over its last evaluated round."""
        with self.lock:
            rounds = sorted(self._eval_history)
            if len(rounds) < 2:
                return None
            r, prev = rounds[-1], rounds[-2]
            tokens = self._tokens_by_round.get(r, 0)
            if tokens <= 0:
                return None
            return (self._eval_history[prev] - self._eval_history[r]) / (tokens / 1000)

    def train(self, msg: Message, context: Context) -> Message:
        eng = self.rt.engine
        cfg = msg.content[P.CONFIG]
        rnd = int(cfg.get(P.SERVER_ROUND, 0))
        arrays = msg.content[P.ARRAYS]
        state = to_state(arrays) if len(arrays) else eng.initial_state
        if len(arrays) and rnd > 1:  # the global of round rnd-1; serve it if this edge missed its evaluate
            self.rt.publish(state, rnd - 1, round=rnd - 1)
        tokens = int(cfg.get(P.BUDGET_TOKENS, 0)) or eng.cfg.training.default_round_tokens
        budget = TrainBudget(tokens=tokens, deadline_s=float(cfg.get(P.DEADLINE_S, 0)) or None)
        t0 = time.time()
        log.info("edge %s: round %d: training up to %d tokens within %s s", self.rt.cfg.name, rnd, tokens,
                 budget.deadline_s)
        report = eng.train(budget, global_state=state, proximal_mu=float(cfg.get(P.PROXIMAL_MU, 0.0)),
                           lr=float(cfg[P.LR]) if P.LR in cfg else None).result()
        with self.lock:
            self.rounds_trained += 1
            self.last_round = rnd
            self._tokens_by_round[rnd] = report.tokens
            self.last_train = {"round": rnd, **report.as_dict()}
        log.info("edge %s: round %d: trained %d steps, %d tokens, loss %s, %.1f s%s", self.rt.cfg.name, rnd,
                 report.steps, report.tokens, None if report.loss is None else round(report.loss, 4),
                 time.time() - t0, " (deadline hit)" if report.deadline_hit else "")
        metrics = MetricRecord({
            P.NUM_EXAMPLES: int(report.sequences),
            "train-loss": _num(report.loss),
            "train-tokens": int(report.tokens),
            "train-steps": int(report.steps),
            "deadline-hit": int(report.deadline_hit),
            "seconds": float(report.seconds),
        })
        content = RecordDict({P.ARRAYS: to_arrays(eng.trainer.adapter.state_dict_peft()), P.METRICS: metrics,
                              P.IDENTITY: self._identity()})
        return Message(content, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        eng = self.rt.engine
        rnd = int(msg.content[P.CONFIG].get(P.SERVER_ROUND, 0))
        arrays = msg.content[P.ARRAYS]
        if len(arrays):
            self.rt.publish(to_state(arrays), rnd, round=rnd)  # the shadow swap: new requests get round rnd
        report = eng.evaluate(version=eng.shadow.current_version).result()
        if report.loss is None:  # the engine stopped before evaluating anything
            raise RuntimeError(f"edge {self.rt.cfg.name}: evaluation did not run")
        version = int(report.extra.get("version", eng.shadow.current_version))
        eng.shadow.set_eval_loss(version, report.loss)
        with self.lock:
            self._eval_history[rnd] = report.loss
            self.last_eval = {"round": rnd, "version": version, "loss": report.loss, "accuracy": report.accuracy}
        log.info("edge %s: round %d: serving version %d, holdout loss %.4f", self.rt.cfg.name, rnd, version,
                 report.loss)
        metrics = MetricRecord({P.NUM_EXAMPLES: int(report.sequences), "eval-loss": float(report.loss),
                                "eval-accuracy": _num(report.accuracy), "adapter-version": float(version)})
        return Message(RecordDict({P.METRICS: metrics, P.IDENTITY: self._identity()}), reply_to=msg)

    def status(self) -> dict:
        with self.lock:
            return {"rounds_trained": self.rounds_trained, "last_round": self.last_round,
                    "last_train": self.last_train, "last_eval": self.last_eval}


# The ClientApp named in the app bundle (pyproject [tool.flwr.app.components]).
_bound: FederatedEdge | None = None


def bind(edge: FederatedEdge) -> None:
    global _bound
    _bound = edge


def _require() -> FederatedEdge:
    if _bound is None:
        raise RuntimeError("the CoLLM ClientApp runs inside collm-edge (no edge is bound in this process)")
    return _bound


app = ClientApp()
app.query()(lambda msg, ctx: _require().query(msg, ctx))
app.train()(lambda msg, ctx: _require().train(msg, ctx))
app.evaluate()(lambda msg, ctx: _require().evaluate(msg, ctx))
