"""CoLLM's round logic, mixed into flwr's strategies (`server/strategies.py`: FedAvg, FedProx, FedAdam, ...).

`CollmRounds` overrides only what changes; the averaging and FedAdam's server step stay flwr's.
Each hook reads top to bottom and hands the decisions to pure helpers:

* `configure_train`  asks every available edge for a load report (a QUERY message), plans the round
  (`balancer.plan_round` over `_decide`: `fraction_train` of the edges, `balancer.choose_participants`,
  the balancer, the DP budget) and sends a TRAIN message only to the edges that take part, each with
  its own ConfigRecord: flwr's base config ("server-round", "proximal-mu" for FedProx) plus
  "budget-tokens", "deadline-s", "lr" and what the aggregation rules need. No edge taking part
  means no training this round.
* `aggregate_train`  reads each edge's reply (`server/replies.py`), leaves bad updates out
  (`server/robust.py`, then the rules: `server/rules.py`, FFA-LoRA and DP as objects the config
  chooses), hands the rest to flwr and lets the rules make the aggregate final. Nothing left: the
  global stays as it was.
* `configure_evaluate`  sends the new global to `fraction_evaluate` of the edges, which serve it.
* `aggregate_evaluate` records each edge's holdout metrics and whether its canary gate refused the
  new global (`server/replies.py`).
* `start`  checkpoints the round (adapter + metrics.json, the round's `RoundRecord`) after its
  evaluation; only then is the round complete.

Rounds are numbered from `round_offset + 1` (resume): flwr's loop counts 1..n, the messages,
logs and checkpoints use the real round number.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from collm.common import protocol as P
from collm.common import wire

from collm.common.protocol import LoadReport
from collm.server.balancer import (BALANCERS, Decision, PlannedEdge, balancer_params, choose_participants,
                                   participants_wanted, plan_round)
from collm.common.rounds import write_status
from collm.common.run_proof import PROOF_KEY, proof
from collm.server.checkpoints import write_round
from collm.server.config import ServerConfig
from collm.server.privacy import PrivacyLedger, Release
from collm.server.intake import prepare_updates, screen_round
from collm.server.lr_schedule import round_lr
from collm.server.node_snapshot import NodeSnapshot
from collm.server.replies import (common_metric_keys, edge_name, read_eval_replies, read_train_replies,
                                  unique_names, with_weight)
from collm.server.robust import Update
from collm.server.round_record import RoundRecord
from collm.server.rules import rules_for


class CollmRounds:
    """Mixin for a flwr FedAvg-family strategy: balancer, robust filtering, aggregation rules, checkpoints.

    Parameters
    ----------
    server_cfg : ServerConfig
        Balancer and robustness settings, LoRA settings and base model name (written to
        adapter_config.json), checkpoint_dir and query_timeout_s.
    round_offset : int (default: 0)
        Rounds already complete in checkpoint_dir; flwr's round n is round n + round_offset.
    **kwargs
        Passed on to the flwr strategy (FedAvg, FedProx or FedAdam).
    """

    def __init__(self, *, server_cfg: ServerConfig, round_offset: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.server_cfg = server_cfg
        self.round_offset = round_offset
        self.balancer_params = balancer_params(server_cfg.balancer)
        self.balance = BALANCERS[server_cfg.balancer.mode]  # the rule, or the uniform baseline
        self.history: dict[int, RoundRecord] = {}  # real round -> what happened (metrics.json)
        self._restored_updates = 0  # rounds before a resume that changed the global (the lr schedule's steps)
        self._global: dict[str, np.ndarray] = {}  # the adapter sent out this round
        self._started: dict[int, float] = {}
        self._node_names: dict[int, str] = {}     # last name each node reported
        self._norm_history: deque[float] = deque(maxlen=8)  # update norms the last rounds kept
        self._last_trained: dict[str, int] = {}   # edge -> last round it was sent a TRAIN message
        self._outbox: list[Message] = []          # the instructions of the current phase (`_node_of`)
        self._sent_to: dict[str, int] = {}        # their message id -> destination node, once pushed
        dp = server_cfg.dp
        self.privacy = PrivacyLedger(dp.target_delta) if dp is not None else None
        self.rules = rules_for(server_cfg, self.privacy, population=lambda: len(self._node_names))
        keys = server_cfg.federation_key.resolve("federation_key")
        self._run_key = keys[0] if keys else None

    def _signed(self, r: int, grid: Grid) -> dict:
        """The proof an edge with `federation.run_key` asks of every instruction (common/run_proof.py)."""
        return {} if self._run_key is None else {PROOF_KEY: proof(self._run_key, grid.run.run_id, r)}

    # ------------------------------------------------------------------------------ rounds
    def real_round(self, server_round: int) -> int:
        return server_round + self.round_offset

    def _record(self, r: int) -> RoundRecord:
        if r not in self.history:
            self._started[r] = time.time()
            self.history[r] = RoundRecord(r, type(self).__name__,
                                          datetime.now(timezone.utc).isoformat(timespec="seconds"))
        return self.history[r]

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """flwr's round loop; each round ends by writing its checkpoint (via evaluate_fn)."""

        def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays) if evaluate_fn else None
            if server_round > 0:
                self.finish_round(server_round, arrays)
            return res

        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout,
                             train_config=train_config, evaluate_config=evaluate_config,
                             evaluate_fn=end_of_round)

    def finish_round(self, server_round: int, arrays: ArrayRecord) -> None:
        r = self.real_round(server_round)
        rec = self._record(r)
        rec.wall_s = round(time.time() - self._started[r], 3)
        rec.global_keys = len(arrays)
        d = write_round(self.server_cfg.checkpoint_dir, r, {k: v.numpy() for k, v in arrays.items()},
                        rec.as_dict(), self.server_cfg.lora, self.server_cfg.base_model_name, self.server_state())
        write_status(self.server_cfg.checkpoint_dir, {"round": r, "phase": "complete", "at": time.time(),
                                                      "round_timeout_s": self.server_cfg.round_timeout_s})
        log(INFO, "round %d complete in %.1f s: checkpoint %s", r, rec.wall_s, d)

    def server_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Server optimizer state to checkpoint (FedAdam's moments; none for FedAvg/FedProx)."""
        return {}

    def restore_server_state(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        """A resumed run's server optimizer state (FedAdam's)."""

    def restore_history(self, metrics_by_round: dict[int, dict]) -> None:
        """A resumed run continues the privacy ledger, the participation order and the lr schedule of the rounds done."""
        if self.server_cfg.dp is not None:
            self.privacy = PrivacyLedger.from_history(self.server_cfg.dp.target_delta, metrics_by_round)
            self.rules = rules_for(self.server_cfg, self.privacy, population=lambda: len(self._node_names))
        self._restored_updates = sum(1 for m in metrics_by_round.values() if m.get("kept"))
        for r in sorted(metrics_by_round):
            for d in metrics_by_round[r].get("balancer", []):
                if d.get("take_part"):
                    self._last_trained[d["edge"]] = r

    def name_of(self, node_id: int) -> str:
        """The edge name a node last reported (`node-<id>` before it reported one)."""
        return self._node_names.get(node_id, f"node-{node_id}")

    def _names_of(self, replies: list[Message]) -> dict[int, str]:
        """Edge name per replying node: the reported one, else the last one known, else node-<id>."""
        names = {}
        for m in replies:
            nid = self._node_of(m)
            names[nid] = edge_name(m) or self._node_names.get(nid) or f"node-{nid}"
        self._node_names.update(names)
        return unique_names(names)

    def _node_of(self, m: Message) -> int:
        """The node a reply is about: its sender, or, for an error the SuperLink answers on a node's
        behalf (Node Unavailable: an edge that left), the node the instruction went to."""
        reply_to = m.metadata.reply_to_message_id
        if not reply_to:
            return m.metadata.src_node_id
        if reply_to not in self._sent_to:  # ids are set once the grid has pushed them
            self._sent_to = {sent.metadata.message_id: sent.metadata.dst_node_id
                             for sent in self._outbox if sent.metadata.message_id}
        return self._sent_to.get(reply_to, m.metadata.src_node_id)

    # ------------------------------------------------------------------------------ train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Ask every available edge for a load report, plan the round (`plan_round`: who trains how
        much), and send a TRAIN message to each edge that takes part, with its own budget."""
        r = self.real_round(server_round)
        self._after_round_one(server_round)
        self._pause_after_an_empty_round(r)
        rec = self._record(r)
        self._global = {k: v.numpy() for k, v in arrays.items()}
        base = list(super().configure_train(r, arrays, config, NodeSnapshot(grid, self.min_available_nodes)))
        if not base:
            return []
        node_ids = [m.metadata.dst_node_id for m in base]
        reports, no_report = self._query_reports(r, node_ids, grid)
        plan = plan_round(node_ids, reports, no_report, self._decide(list(reports.values())), self._node_names)
        common = {**dict(base[0].content[self.configrecord_key]), P.LR: self._round_lr(r),
                  **{k: v for rule in self.rules for k, v in rule.train_config().items()}, **self._signed(r, grid)}
        packed = wire.pack_record(arrays)  # one Array on the wire, not one per tensor (common/wire.py)
        messages = [self._train_message(r, rec, edge, packed, common) for edge in plan]
        messages = [m for m in messages if m is not None]
        rec.lr = common[P.LR] if messages else None
        write_status(self.server_cfg.checkpoint_dir, {"round": r, "phase": "train", "at": time.time(),
                                                      "round_timeout_s": self.server_cfg.round_timeout_s,
                                                      "training": [d["edge"] for d in rec.balancer if d["take_part"]]})
        if not messages:
            rec.training_skipped = "no edge takes part (see balancer reasons)"
            log(WARNING, "round %d: no edge takes part, so no training this round; the global adapter "
                "stays as it is", r)
        self._outbox = messages
        return messages

    def _round_lr(self, r: int) -> float:
        """This round's learning rate (`server/lr_schedule.py`): one step per earlier round that changed the global."""
        b = self.server_cfg.balancer
        updated = self._restored_updates + sum(1 for q, rr in self.history.items() if q < r and rr.kept)
        return round_lr(b.lr, b.lr_decay, b.lr_min, 1 + updated)

    def _after_round_one(self, server_round: int) -> None:
        """After the first round, continue with the edges that remain (`min_round_nodes`)."""
        if server_round > 1:
            n = self.server_cfg.nodes_after_first_round
            self.min_available_nodes = self.min_train_nodes = n
            self.min_evaluate_nodes = n if self.server_cfg.fraction_evaluate >= 1 else 1

    def _pause_after_an_empty_round(self, r: int) -> None:
        """The last round changed nothing (every edge busy): give the edges a while before asking again."""
        if r - 1 in self.history and not self.history[r - 1].kept:
            time.sleep(self.server_cfg.balancer.idle_wait_s)

    def _train_message(self, r: int, rec: RoundRecord, edge: PlannedEdge, packed: ArrayRecord,
                       common: dict) -> Message | None:
        """Record the edge's decision; its TRAIN message if it takes part."""
        d = edge.decision
        rec.balancer.append({"edge": d.name, "node_id": edge.node_id, "take_part": d.take_part,
                             "budget_tokens": d.budget_tokens, "deadline_s": d.deadline_s, "reason": d.reason,
                             "cap_tokens": d.cap_tokens, "weight": d.weight,
                             "report": None if edge.report is None else vars(edge.report)})
        log(INFO, "round %d: %s %s: %s", r, d.name, "trains" if d.take_part else "sits out", d.reason)
        if not d.take_part:
            return None
        self._last_trained[d.name] = r
        cfg = ConfigRecord({**common, P.BUDGET_TOKENS: d.budget_tokens, P.DEADLINE_S: d.deadline_s})
        content = RecordDict({self.arrayrecord_key: packed, self.configrecord_key: cfg})
        return Message(content, dst_node_id=edge.node_id, message_type=MessageType.TRAIN)

    def _decide(self, reports: list[LoadReport]) -> dict[str, Decision]:
        """Who trains how much: `fraction_train` of the edges (least recently trained first), then the
        balancer; nobody if the round would spend more privacy than `dp.max_epsilon` allows."""
        cfg = self.server_cfg
        k = participants_wanted(len(reports), cfg.fraction_train, cfg.min_train_nodes)
        chosen, left_out = choose_participants(reports, self.balancer_params, k, self._last_trained)
        decisions = {d.name: d for d in self.balance(chosen, self.balancer_params)}
        decisions.update({name: Decision(name, False, 0, 0.0, why) for name, why in left_out.items()})
        if why := self._privacy_exhausted(sum(d.take_part for d in decisions.values())):
            decisions = {n: Decision(n, False, 0, 0.0, why) for n in decisions}
        return decisions

    def _privacy_exhausted(self, n: int) -> str | None:
        """Why no edge may train this round under DP's max_epsilon, or None."""
        dp = self.server_cfg.dp
        if self.privacy is None or dp.max_epsilon is None or dp.noise_multiplier <= 0 or n == 0:
            return None
        spent = self.privacy.spent(Release(dp.noise_multiplier, n), len(self._node_names))
        if spent.epsilon <= dp.max_epsilon:
            return None
        return (f"privacy budget: this round would bring epsilon to {spent.epsilon:.3g} at delta "
                f"{dp.target_delta:g}, past dp.max_epsilon {dp.max_epsilon:g}")

    def _query_reports(self, r: int, node_ids: list[int],
                       grid: Grid) -> tuple[dict[int, LoadReport], dict[int, str]]:
        """Fresh load reports by node id, and why the nodes without one have none."""
        queries = [Message(RecordDict({P.CONFIG: ConfigRecord({P.SERVER_ROUND: r, **self._signed(r, grid)})}),
                           dst_node_id=nid, message_type=MessageType.QUERY) for nid in node_ids]
        self._outbox = queries
        replies = list(grid.send_and_receive(queries, timeout=self.server_cfg.query_timeout_s))
        names = self._names_of(replies)
        reports: dict[int, LoadReport] = {}
        missing = {nid: f"no load report within {self.server_cfg.query_timeout_s:g} s" for nid in node_ids}
        for rep in replies:
            nid = self._node_of(rep)
            if rep.has_error():
                missing[nid] = f"load report failed: {rep.error.reason}"
            elif P.REPORT not in rep.content.metric_records:
                missing[nid] = "QUERY reply has no 'report' MetricRecord"
            else:
                reports[nid] = LoadReport.from_record(names[nid], dict(rep.content[P.REPORT]))
                missing.pop(nid, None)
        return reports, missing

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read the updates, leave the bad ones out (robust screen, then the rules), average the rest
        with flwr's strategy, and let the rules make the aggregate final (FFA-LoRA's A, DP's noise)."""
        r = self.real_round(server_round)
        rec = self._record(r)
        replies = list(replies)
        if not replies:
            if rec.training_skipped is None:
                rec.training_skipped = "no TRAIN replies"
                log(WARNING, "round %d: no TRAIN replies; the global adapter stays as it is", r)
            return None, None
        updates, candidates = prepare_updates(*self._read_updates(replies, rec), self.rules, self._global, rec)
        kept = self._screen(r, updates, rec)
        if not kept:
            log(WARNING, "round %d: all %d updates were left out; the global adapter stays as it is", r, len(replies))
            return None, None
        log(INFO, "round %d: aggregating %d update(s) from %s", r, len(kept), ", ".join(rec.kept))
        weight = next((w for rule in self.rules if (w := rule.weight()) is not None), None)
        messages = [with_weight(candidates[i], updates[i].num_examples if weight is None else weight) for i in kept]
        arrays, metrics = self._average(r, common_metric_keys(messages, r))
        if arrays is not None:
            state = {k: a.numpy() for k, a in arrays.items()}
            for rule in self.rules:
                state = rule.after(state, [updates[i] for i in kept], rec)
            if bad := next((k for k, v in state.items() if not np.isfinite(v).all()), None):
                rec.training_skipped = f"the aggregate has non-finite values in {bad}"
                log(WARNING, "round %d: the aggregate has non-finite values in %s; the global adapter stays as "
                    "it is", r, bad)
                return None, None
            arrays = ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in state.items()})
            self._log_privacy(r, rec)
        rec.train_aggregate = None if metrics is None else dict(metrics)
        return arrays, metrics

    def _average(self, r: int, kept: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The flwr strategy's own aggregation of the kept replies."""
        return super().aggregate_train(r, kept)

    def _read_updates(self, replies: list[Message], rec: RoundRecord) -> tuple[list[Update], list[Message]]:
        """Each usable TRAIN reply as an Update with the weight it will carry (and its reply keyed by tensor);
        the others are recorded as dropped, with why (`server/replies.py`)."""
        names = self._names_of(replies)
        return read_train_replies(replies, [names[self._node_of(m)] for m in replies], self.server_cfg.robust, rec)

    def _screen(self, r: int, updates: list[Update], rec: RoundRecord) -> list[int]:
        """The updates kept (indices), `server/intake.py`; the norms of the kept ones join the screen's history."""
        kept = screen_round(updates, self.rules, self._global, self.server_cfg.robust.norm_k, self._norm_history, rec)
        self._norm_history.extend(rec.norms[updates[i].name] for i in kept)
        for name, why in rec.dropped.items():
            log(WARNING, "round %d: update from %s left out: %s", r, name, why)
        return kept

    def _log_privacy(self, r: int, rec: RoundRecord) -> None:
        info = rec.privacy
        if info is None:
            return
        if info["release"] is not None:
            log(INFO, "round %d: DP: %d updates clipped to %g, noise std %.3g; privacy spent epsilon %.3f at "
                "delta %g after %d release(s)", r, info["updates"], info["clipping_norm"], info["noise_std"],
                info["epsilon"], info["delta"], info["releases"])
        else:
            log(WARNING, "round %d: DP noise_multiplier is 0: updates clipped to %g, no privacy claimed",
                r, info["clipping_norm"])

    # ------------------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        r = self.real_round(server_round)
        if not self._record(r).kept:
            # Nothing was aggregated: the global adapter is the one the edges already serve, so an
            # evaluation would only take CPU from busy edges.
            log(INFO, "round %d: the global adapter did not change; no evaluation, the edges keep "
                "serving what they serve", r)
            return []
        config = ConfigRecord({**dict(config), **{k: v for rule in self.rules for k, v in rule.evaluate_config().items()},
                               **self._signed(r, grid)})
        self._outbox = list(super().configure_evaluate(r, wire.pack_record(arrays), config,
                                                       NodeSnapshot(grid, self.min_available_nodes)))
        return self._outbox

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Record each edge's holdout metrics and canary refusals (`server/replies.py`); flwr averages the
        replies that carry a weight."""
        r = self.real_round(server_round)
        rec = self._record(r)
        replies = list(replies)
        names = self._names_of(replies)
        usable = read_eval_replies(replies, [names[self._node_of(m)] for m in replies], self.weighted_by_key, r, rec)
        if not usable:
            return None
        metrics = super().aggregate_evaluate(r, common_metric_keys(usable, r))
        rec.eval_aggregate = None if metrics is None else dict(metrics)
        return metrics
