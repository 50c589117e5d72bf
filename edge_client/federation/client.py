"""The edge's side of a federated round, as a Flower ClientApp running on the resident engine.

* query:    the load report the balancer decides from (`LoadReport`, from the engine's snapshot);
* train:    serve the global adapter it carries if this edge does not yet, load it into the training
            adapter, train the assigned budget through the engine's co-execution rule (serving never
            waits for it), return the local adapter;
* evaluate: evaluate the new global on the holdout slice, serve it (shadow swap, no restart) if the
            canary gate passes it (`canary.py`, `adapters.canary_margin`; off: swap first, then
            evaluate), and report its holdout loss and whether it was refused.

Both handlers swap through the canary gate (`evaluate_global`, `adopt_global`); a global the gate
refused is never served, not even when a later TRAIN message carries it again, and one that first
arrives in a TRAIN message is gated there.
`service.EdgeFederation(runtime)` is the service `collm-edge` attaches to its runtime: these handlers
plus a `SuperNodeExecutor` that runs them in-process. The module's `app` exists so the Flower app bundle
names a ClientApp; it runs on whichever edge `bind` chose.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.clientapp import ClientApp

from collm.common import protocol as P
from collm.common.run_proof import PROOF_KEY
from collm.common.run_proof import refusal as run_refusal
from collm.edge_client.federation.canary import canary_verdict
from collm.edge_client.federation.records import clipped_update, fit_to_rank, product_rebase, to_arrays, to_state
from collm.edge_client.training.jobs import TrainBudget

if TYPE_CHECKING:
    from concurrent.futures import Future

    from collm.edge_client.runtime import EdgeRuntime

log = logging.getLogger("collm.federation")


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
        self.refused: dict[int, str] = {}  # global version -> why the canary gate refused it
        self.budget_fill: float | None = None  # tokens trained / budget in the last round (the load report's)
        self.rank_energy = 1.0  # mixed ranks: the share of the last global's energy this edge's rank kept
        self.run_keys = runtime.cfg.federation.run_key.resolve("federation.run_key")
        self.foreign_refused = 0  # messages refused as not from this federation's ServerApp
        self._reference: tuple[int, Future] | None = None  # (version, its evaluation) queued at start

    def measure_reference(self) -> None:
        """Queue the evaluation of the version served at start, the canary's first reference, so that it
        runs when the edge joins (in the idle time before traffic, where there is some) instead of inside
        round 1's evaluation (where a busy replica can hold it up for minutes and the swap, and every edge's
        round, wait on it). It is background work like any evaluation: a round's job queued after it waits."""
        eng = self.rt.engine
        version = eng.shadow.current_version
        info = eng.shadow.info_of(version)
        if self.rt.cfg.adapters.canary_margin is None or not eng.holdout or (info and info.eval_loss is not None):
            return
        self._reference = (version, eng.evaluate(version=version))

    # ------------------------------------------------------------------ handlers
    def client_app(self) -> ClientApp:
        app = ClientApp()
        app.query()(self.bound(self.query))
        app.train()(self.bound(self.train))
        app.evaluate()(self.bound(self.evaluate))
        return app

    def bound(self, handler):
        """`handler`, for messages of this federation's ServerApp only (federation.run_key): any other run on the
        SuperLink gets an error reply and changes nothing here."""
        def checked(msg: Message, context: Context) -> Message:
            cfg = msg.content.config_records.get(P.CONFIG) if msg.has_content() else None
            rnd = cfg.get(P.SERVER_ROUND, 0) if cfg is not None else 0
            why = run_refusal(self.run_keys, msg.metadata.run_id, int(rnd) if isinstance(rnd, int) else 0,
                              cfg.get(PROOF_KEY) if cfg is not None else None)
            if why is None:
                return handler(msg, context)
            self.foreign_refused += 1
            log.warning("edge %s: refused a %s message: %s", self.rt.cfg.name, msg.metadata.message_type, why)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=why), reply_to=msg)

        return checked

    def _identity(self) -> ConfigRecord:
        return ConfigRecord({P.EDGE_NAME: self.rt.cfg.name})

    def query(self, msg: Message, context: Context) -> Message:
        report = MetricRecord(self.report())
        return Message(RecordDict({P.REPORT: report, P.IDENTITY: self._identity()}), reply_to=msg)

    def report(self) -> dict[str, float]:
        return self.load_report().to_record()

    def load_report(self) -> P.LoadReport:
        snap = self.rt.engine.snapshot()
        w = snap.window
        return P.LoadReport(
            name=self.rt.cfg.name, request_rate=w.request_rate, slo_attainment=w.slo_attainment,
            spare_capacity=w.spare_capacity, queue_depth=snap.waiting, running=snap.running,
            train_examples=snap.train_examples, gain_per_ktok=self.gain_per_ktok(),
            train_tokens_per_s=snap.idle_train_tokens_per_s, goodput=w.goodput,
            adapter_version=snap.adapter_version, refused_version=max(self.refused, default=-1),
            carried_tokens=self.rt.engine.carried_tokens(), train_share=snap.train_share,
            budget_fill=self.budget_fill)

    def own_rank(self, state: dict, cfg) -> dict:
        """Under lora_aggregation product (the config carries the global's LoRA alpha): the global fitted to
        this edge's own `lora.r` (truncated SVD; the energy it keeps is reported with the evaluation)."""
        if P.LORA_ALPHA not in cfg:
            return state
        lora = self.rt.cfg.lora
        state, energy = fit_to_rank(state, float(cfg[P.LORA_ALPHA]), lora.r, lora.alpha, self.rt.engine.initial_state)
        self.rank_energy = energy
        return state

    def adopt_global(self, arrays: ArrayRecord, version: int, cfg=None) -> dict | None:
        """Serve the global adapter of round `version` unless this edge already serves it (or newer)
        or the canary gate refuses it; returns its state (None for an empty record: round 1 starts
        from the seeded initial adapter). A TRAIN message carries a global this edge has not seen
        when it missed that round's evaluation (`fraction_evaluate` < 1, or it joined or restarted):
        it is gated here as it would have been there."""
        if not len(arrays):
            return None
        state = self.own_rank(to_state(arrays), cfg or {})
        margin = self.rt.cfg.adapters.canary_margin
        if version > 0 and version not in self.refused and version > self.rt.latest_round:
            if margin is None:
                self.rt.publish_global(state, version)  # the shadow swap: new requests get it
            else:
                self._canary(state, version, margin)  # serves it only if it passes
        return state

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
        # the global after round rnd-1: served from now on if this edge missed that round's evaluate
        state = self.adopt_global(msg.content[P.ARRAYS], rnd - 1, cfg)
        product = P.LORA_ALPHA in cfg  # mixed ranks: this edge trains its own lora.r (common/lora_rank.py)
        if product and self.rt.cfg.lora.r > int(cfg.get(P.LORA_MAX_RANK, self.rt.cfg.lora.r)):
            why = (f"lora.r {self.rt.cfg.lora.r} is above the server's lora.r {int(cfg[P.LORA_MAX_RANK])}: set lora.r "
                   f"to at most {int(cfg[P.LORA_MAX_RANK])} in {self.rt.cfg.name}'s config")
            log.error("edge %s: round %d: %s", self.rt.cfg.name, rnd, why)
            raise ValueError(why)
        if state is None:
            state = eng.initial_state
        tokens = int(cfg.get(P.BUDGET_TOKENS, 0)) or eng.cfg.training.default_round_tokens
        budget = TrainBudget(tokens=tokens, deadline_s=float(cfg.get(P.DEADLINE_S, 0)) or None)
        t0 = time.time()
        log.info("edge %s: round %d: training up to %d tokens within %s s", self.rt.cfg.name, rnd, tokens,
                 budget.deadline_s)
        # a global the canary refused is trained from (the federation's round) but not served, not even as :local
        report = eng.train(budget, global_state=state, proximal_mu=float(cfg.get(P.PROXIMAL_MU, 0.0)),
                           lr=float(cfg[P.LR]) if P.LR in cfg else None,
                           serve_local=(rnd - 1) not in self.refused, carry=True,
                           freeze_a=bool(cfg.get(P.FREEZE_A, 0)),
                           rebase=product_rebase(self.rt.cfg.lora.r, self.rt.cfg.lora.alpha, eng.initial_state)
                           if product else None).result()
        with self.lock:
            self.rounds_trained += 1
            self.last_round = rnd
            self._tokens_by_round[rnd] = report.tokens
            own = report.tokens - int(report.extra.get("carried_tokens", 0))  # this round's, not the carry's
            self.budget_fill = min(1.0, max(own, 0) / tokens)
            self.last_train = {"round": rnd, **report.as_dict()}
        log.info("edge %s: round %d: trained %d steps, %d tokens, loss %s, %.1f s%s", self.rt.cfg.name, rnd,
                 report.steps, report.tokens, None if report.loss is None else round(report.loss, 4),
                 time.time() - t0, " (deadline hit)" if report.deadline_hit else "")
        update, extra = report.adapter_state, {}
        if P.CLIPPING_NORM in cfg:  # DP: the update leaves this edge clipped (collm.server.privacy)
            update, norm = clipped_update(update, state, float(cfg[P.CLIPPING_NORM]))
            extra[P.UPDATE_NORM] = norm
        if product:
            extra[P.LORA_ALPHA] = float(self.rt.cfg.lora.alpha)
        metrics = MetricRecord({
            P.NUM_EXAMPLES: int(report.sequences),
            P.TRAIN_LOSS: _num(report.loss),
            P.TRAIN_TOKENS: int(report.tokens),
            P.TRAIN_STEPS: int(report.steps),
            P.DEADLINE_HIT: int(report.deadline_hit),
            P.SECONDS: float(report.seconds),
            P.CARRIED_TOKENS: int(report.extra.get("carried_tokens", 0)),
            **extra,
        })
        content = RecordDict({P.ARRAYS: to_arrays(update), P.METRICS: metrics,
                              P.IDENTITY: self._identity()})
        return Message(content, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        cfg = msg.content[P.CONFIG]
        rnd = int(cfg.get(P.SERVER_ROUND, 0))
        arrays = msg.content[P.ARRAYS]
        report, refused = self.evaluate_global(self.own_rank(to_state(arrays), cfg) if len(arrays) else None, rnd)
        version = self.rt.engine.shadow.current_version
        metrics = MetricRecord({P.NUM_EXAMPLES: int(report.sequences), P.EVAL_LOSS: float(report.loss),
                                P.EVAL_ACCURACY: _num(report.accuracy), P.ADAPTER_VERSION: float(version),
                                P.CANARY_REFUSED: int(refused is not None),
                                **({P.RANK_ENERGY: float(self.rank_energy)} if P.LORA_ALPHA in cfg else {})})
        return Message(RecordDict({P.METRICS: metrics, P.IDENTITY: self._identity()}), reply_to=msg)

    def evaluate_global(self, state: dict | None, rnd: int):
        """Round `rnd`'s global (`state`; None: nothing new): serve it unless the canary gate refuses it,
        and evaluate it. Returns its evaluation and, if it was refused, why."""
        eng = self.rt.engine
        margin = self.rt.cfg.adapters.canary_margin
        refused = None
        if margin is None or state is None or rnd <= self.rt.latest_round:
            if state is not None and rnd > 0 and rnd not in self.refused:
                self.rt.publish_global(state, rnd)  # no gate: swap first, then evaluate what is served
            report = self._evaluate_serving(eng.shadow.current_version)
        else:
            report, refused = self._canary(state, rnd, margin)
        with self.lock:
            self._eval_history[rnd] = report.loss
            self.last_eval = {"round": rnd, "version": eng.shadow.current_version, "loss": report.loss,
                              "accuracy": report.accuracy, "refused": refused}
        log.info("edge %s: round %d: serving version %d, holdout loss of the round's global %.4f%s",
                 self.rt.cfg.name, rnd, eng.shadow.current_version, report.loss,
                 f" (refused: {refused})" if refused else "")
        return report, refused

    def _canary(self, state: dict, version: int, margin: float):
        """Evaluate the new global before it is served; serve it only if the gate passes it.
        Returns the candidate's evaluation and, if refused, why."""
        eng = self.rt.engine
        shadow = eng.shadow
        serving = shadow.current_version
        info = shadow.info_of(serving)
        serving_loss = info.eval_loss if info else None
        if serving_loss is None:  # e.g. the initial adapter: measure it once, so the gate has a reference
            serving_loss = self._evaluate_serving(serving).loss
        report = _evaluated(eng.evaluate(state=state).result(), self.rt.cfg.name)
        verdict = canary_verdict(report.loss, serving_loss, margin)
        if verdict.accept:
            self.rt.publish_global(state, version, eval_loss=report.loss)
            return report, None
        with self.lock:
            self.refused[version] = verdict.reason
        log.warning("edge %s: refused to serve global version %d, kept version %d: %s", self.rt.cfg.name,
                    version, serving, verdict.reason)
        return report, verdict.reason

    def _evaluate_serving(self, version: int):
        """Evaluate the served `version` and record its loss on it: the canary's reference and
        /v1/models' eval_loss. The evaluation queued at start (`measure_reference`) is taken if it is of
        this version and did not fail (waiting for it if it still runs)."""
        ref, self._reference = self._reference, None
        if ref is not None and ref[0] == version:
            try:
                report = _evaluated(ref[1].result(), self.rt.cfg.name)
                self.rt.engine.shadow.set_eval_loss(version, report.loss)
                return report
            except Exception as e:  # noqa: BLE001 - measured again below
                log.warning("edge %s: the reference evaluation queued at start failed (%s); measuring again",
                            self.rt.cfg.name, e)
        report = _evaluated(self.rt.engine.evaluate(version=version).result(), self.rt.cfg.name)
        self.rt.engine.shadow.set_eval_loss(version, report.loss)
        return report

    def status(self) -> dict:
        with self.lock:
            return {"rounds_trained": self.rounds_trained, "last_round": self.last_round,
                    "last_train": self.last_train, "last_eval": self.last_eval,
                    "refused": {str(k): v for k, v in sorted(self.refused.items())},
                    "foreign_refused": self.foreign_refused}


def _evaluated(report, edge: str):
    if report.loss is None:  # the engine stopped before evaluating anything
        raise RuntimeError(f"edge {edge}: evaluation did not run")
    return report


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
