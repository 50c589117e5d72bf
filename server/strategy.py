"""flwr's FedAvg / FedProx / FedAdam with CoLLM's round logic mixed in.

`CollmRounds` overrides only what changes; the averaging and FedAdam's server step stay flwr's:

* `configure_train`  asks every available edge for a load report (a QUERY message), keeps
  `fraction_train` of them (`balancer.choose_participants`), runs the balancer and sends a TRAIN
  message only to the edges that take part, each with its own ConfigRecord: flwr's base config
  ("server-round", "proximal-mu" for FedProx) plus "budget-tokens", "deadline-s" and "lr"
  ("lora-freeze-a" under FFA-LoRA, "clipping_norm" under DP). No edge taking part means no
  training this round.
* `aggregate_train`  records each edge's train metrics, leaves bad updates out
  (`collm.server.robust`; under FFA-LoRA also one that changed A, under DP one not clipped) and
  hands the rest to flwr (under DP with equal weights, then noised: `collm.server.privacy`).
  Nothing left: the global stays as it was.
* `configure_evaluate`  sends the new global to `fraction_evaluate` of the edges, which serve it.
* `aggregate_evaluate` records each edge's holdout metrics.
* `start`  checkpoints the round (adapter + metrics.json) after its evaluation; only then is the
  round complete.

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
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Result
from flwr.serverapp.strategy.fedopt import FedOpt
from flwr.supercore import log

from collm.common import protocol as P
from collm.common import wire

from collm.common.protocol import LoadReport
from collm.server.balancer import BALANCERS, BalancerParams, Decision, choose_participants, participants_wanted
from collm.common.rounds import write_status
from collm.server.checkpoints import write_round
from collm.server.config import ServerConfig
from collm.server.privacy import PrivacyLedger, Release, noised
from collm.server.replies import edge_name
from collm.server.robust import Update, screen_updates, update_norm


class CollmRounds:
    """Mixin for a flwr FedAvg-family strategy: balancer, robust filtering, checkpoints.

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
        self.balancer_params = BalancerParams(
            target_attainment=server_cfg.balancer.target_attainment,
            round_deadline_s=server_cfg.balancer.round_deadline_s,
            round_token_budget=server_cfg.balancer.round_token_budget,
            min_edge_tokens=server_cfg.balancer.min_edge_tokens,
            spare_use=server_cfg.balancer.spare_use,
            fill_budget=server_cfg.balancer.fill_budget,
        )
        self.balance = BALANCERS[server_cfg.balancer.mode]  # the rule, or the uniform baseline
        self.history: dict[int, dict] = {}        # real round -> what happened (metrics.json)
        self._global: dict[str, np.ndarray] = {}  # the adapter sent out this round
        self._started: dict[int, float] = {}
        self._node_names: dict[int, str] = {}     # last name each node reported
        self._norm_history: deque[float] = deque(maxlen=8)  # update norms the last rounds kept
        self._last_trained: dict[str, int] = {}   # edge -> last round it was sent a TRAIN message
        self._outbox: list[Message] = []          # the instructions of the current phase (`_node_of`)
        self._sent_to: dict[str, int] = {}        # their message id -> destination node, once pushed
        dp = server_cfg.dp
        self.privacy = PrivacyLedger(dp.target_delta) if dp is not None else None

    # ------------------------------------------------------------------------------ rounds
    def real_round(self, server_round: int) -> int:
        return server_round + self.round_offset

    def _record(self, r: int) -> dict:
        if r not in self.history:
            self._started[r] = time.time()
            self.history[r] = {
                "round": r, "strategy": type(self).__name__,
                "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "balancer": [], "training_skipped": None,
                "train": {}, "dropped": {}, "kept": [], "train_aggregate": None,
                "eval": {}, "eval_aggregate": None, "refused_by": [], "privacy": None,
            }
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
        rec["wall_s"] = round(time.time() - self._started[r], 3)
        rec["global_keys"] = len(arrays)
        d = write_round(self.server_cfg.checkpoint_dir, r, {k: v.numpy() for k, v in arrays.items()}, rec,
                        self.server_cfg.lora, self.server_cfg.base_model_name, self.server_state())
        write_status(self.server_cfg.checkpoint_dir, {"round": r, "phase": "complete", "at": time.time()})
        log(INFO, "round %d complete in %.1f s: checkpoint %s", r, rec["wall_s"], d)

    def server_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Server optimizer state to checkpoint (FedAdam's moments), empty for FedAvg/FedProx."""
        if not isinstance(self, FedOpt):
            return {}
        return {k: v for k, v in (("m_t", self.m_t), ("v_t", self.v_t)) if v}

    def restore_server_state(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        if isinstance(self, FedOpt):
            self.m_t = state.get("m_t") or None
            self.v_t = state.get("v_t") or None

    def restore_history(self, metrics_by_round: dict[int, dict]) -> None:
        """A resumed run continues the privacy ledger and the participation order of the rounds done."""
        if self.server_cfg.dp is not None:
            self.privacy = PrivacyLedger.from_history(self.server_cfg.dp.target_delta, metrics_by_round)
        for r in sorted(metrics_by_round):
            for d in metrics_by_round[r].get("balancer", []):
                if d.get("take_part"):
                    self._last_trained[d["edge"]] = r

    def _names_of(self, replies: list[Message]) -> dict[int, str]:
        """Edge name per replying node: the reported one, else the last one known, else node-<id>."""
        names = {}
        for m in replies:
            nid = self._node_of(m)
            names[nid] = edge_name(m) or self._node_names.get(nid) or f"node-{nid}"
        self._node_names.update(names)
        return _unique_names(names)

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
        r = self.real_round(server_round)
        if server_round > 1:  # after the first round, continue with the edges that remain
            n = self.server_cfg.nodes_after_first_round
            self.min_available_nodes = self.min_train_nodes = n
            self.min_evaluate_nodes = n if self.server_cfg.fraction_evaluate >= 1 else 1
        if r - 1 in self.history and not self.history[r - 1]["kept"]:
            # the last round changed nothing (every edge busy): give the edges a while before asking again
            time.sleep(self.server_cfg.balancer.idle_wait_s)
        rec = self._record(r)
        self._global = {k: v.numpy() for k, v in arrays.items()}
        base = list(super().configure_train(r, arrays, config, grid))
        if not base:
            return []
        base_config = dict(base[0].content[self.configrecord_key])
        node_ids = [m.metadata.dst_node_id for m in base]

        reports, no_report = self._query_reports(r, node_ids, grid)
        decisions = self._decide(list(reports.values()))
        if why := self._privacy_exhausted(sum(d.take_part for d in decisions.values())):
            decisions = {n: Decision(n, False, 0, 0.0, why) for n in decisions}
        extra_config = {}
        if self.server_cfg.lora_aggregation == "ffa":
            extra_config[P.FREEZE_A] = 1
        if self.server_cfg.dp is not None:
            extra_config[P.CLIPPING_NORM] = self.server_cfg.dp.clipping_norm
        messages = []
        packed = wire.pack_record(arrays)  # one Array on the wire, not one per tensor (common/wire.py)
        for nid in node_ids:
            if nid in no_report:
                d = Decision(self._node_names.get(nid, f"node-{nid}"), False, 0, 0.0, no_report[nid])
                report = None
            else:
                report = reports[nid]
                d = decisions[report.name]
            rec["balancer"].append({"edge": d.name, "node_id": nid, "take_part": d.take_part,
                                    "budget_tokens": d.budget_tokens, "deadline_s": d.deadline_s,
                                    "reason": d.reason, "cap_tokens": d.cap_tokens, "weight": d.weight,
                                    "report": None if report is None else vars(report)})
            log(INFO, "round %d: %s %s: %s", r, d.name, "trains" if d.take_part else "sits out", d.reason)
            if d.take_part:
                self._last_trained[d.name] = r
                cfg = ConfigRecord({**base_config, P.BUDGET_TOKENS: d.budget_tokens,
                                    P.DEADLINE_S: d.deadline_s, P.LR: self.server_cfg.balancer.lr, **extra_config})
                content = RecordDict({self.arrayrecord_key: packed, self.configrecord_key: cfg})
                messages.append(Message(content, dst_node_id=nid, message_type=MessageType.TRAIN))
        write_status(self.server_cfg.checkpoint_dir, {
            "round": r, "phase": "train", "at": time.time(),
            "training": [d["edge"] for d in rec["balancer"] if d["take_part"]]})
        if not messages:
            rec["training_skipped"] = "no edge takes part (see balancer reasons)"
            log(WARNING, "round %d: no edge takes part, so no training this round; the global adapter "
                "stays as it is", r)
        self._outbox = messages
        return messages

    def _decide(self, reports: list[LoadReport]) -> dict[str, Decision]:
        """Who trains how much: `fraction_train` of the edges (least recently trained first), then the balancer."""
        cfg = self.server_cfg
        k = participants_wanted(len(reports), cfg.fraction_train, cfg.min_train_nodes)
        chosen, left_out = choose_participants(reports, self.balancer_params, k, self._last_trained)
        decisions = {d.name: d for d in self.balance(chosen, self.balancer_params)}
        decisions.update({name: Decision(name, False, 0, 0.0, why) for name, why in left_out.items()})
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
        queries = [Message(RecordDict({P.CONFIG: ConfigRecord({P.SERVER_ROUND: r})}),
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
        r = self.real_round(server_round)
        rec = self._record(r)
        replies = list(replies)
        if not replies:
            if rec["training_skipped"] is None:
                rec["training_skipped"] = "no TRAIN replies"
                log(WARNING, "round %d: no TRAIN replies; the global adapter stays as it is", r)
            return None, None

        names = self._names_of(replies)
        updates, candidates = [], []
        for m in replies:
            name = names[self._node_of(m)]
            if m.has_error():
                rec["train"][name] = {"error": m.error.reason}
                rec["dropped"][name] = f"error reply: {m.error.reason}"
                continue
            metrics = m.content.metric_records
            rec["train"][name] = dict(next(iter(metrics.values()))) if len(metrics) == 1 else {}
            if problem := _train_reply_problem(m.content):
                rec["dropped"][name] = problem
                continue
            try:
                arrays = wire.unpack(next(iter(m.content.array_records.values())))
            except ValueError as e:
                rec["dropped"][name] = str(e)
                continue
            updates.append(Update(name, float(rec["train"][name][P.NUM_EXAMPLES]), arrays))
            candidates.append(_keyed(m, arrays))

        dp = self.server_cfg.dp
        # under DP clipping bounds each update; comparing norms across edges would be outside its analysis
        norm_k = float("inf") if dp is not None else self.server_cfg.robust.norm_k
        screening = screen_updates(updates, self._global, norm_k, list(self._norm_history))
        ref_a = self._reference_a([updates[i] for i in screening.kept])
        for i in list(screening.kept):
            if why := self._breaks_the_rule(updates[i], ref_a):
                screening.dropped[i] = why
                screening.kept.remove(i)
        self._norm_history.extend(screening.norms[i] for i in screening.kept)
        for i, why in screening.dropped.items():
            rec["dropped"][updates[i].name] = why
        for name, why in rec["dropped"].items():
            log(WARNING, "round %d: update from %s left out: %s", r, name, why)
        kept = [candidates[i] for i in screening.kept]
        if dp is not None:  # equal weights: one edge moves the mean by at most clipping_norm / n
            kept = [_with_weight(m, 1.0) for m in kept]
        rec["kept"] = [updates[i].name for i in screening.kept]
        if not kept:
            log(WARNING, "round %d: all %d updates were left out; the global adapter stays as it is",
                r, len(replies))
            return None, None
        log(INFO, "round %d: aggregating %d update(s) from %s", r, len(kept), ", ".join(rec["kept"]))

        kept = _common_metric_keys(kept, r)
        if isinstance(self, FedOpt) and not self._global:
            # FedAdam's step needs a previous global; in round 1 there is none (edges started from
            # their seeded adapter), so the round's FedAvg becomes the first global.
            log(INFO, "round %d: global was empty; using the FedAvg of the updates, the server "
                "optimizer starts next round", r)
            arrays, metrics = FedAvg.aggregate_train(self, r, kept)
        else:
            arrays, metrics = super().aggregate_train(r, kept)
        if arrays is not None and self.server_cfg.lora_aggregation == "ffa":
            # every kept update carries the same A: keep it bit for bit (an average of equal
            # floats can differ from them in the last bit, and would drift over rounds)
            same_a = updates[screening.kept[0]].arrays
            arrays = ArrayRecord({k: Array(np.asarray(same_a[k])) if "lora_A" in k else v for k, v in arrays.items()})
        if arrays is not None and dp is not None:
            arrays = self._privatize(r, arrays, len(kept))
        if arrays is not None and any(a.numpy().dtype != np.float32 for a in arrays.values()):
            arrays = ArrayRecord({k: Array(a.numpy().astype(np.float32)) for k, a in arrays.items()})
        rec["train_aggregate"] = None if metrics is None else dict(metrics)
        return arrays, metrics

    def _reference_a(self, updates: list[Update]) -> dict[str, np.ndarray]:
        """Under FFA-LoRA, the A every update must carry: the global's, or in round 1 (empty global,
        edges start from their identical seeded adapter) the A most updates agree on."""
        if self.server_cfg.lora_aggregation != "ffa" or not updates:
            return {}
        if self._global:
            return {k: v for k, v in self._global.items() if "lora_A" in k}
        groups: dict[bytes, list[Update]] = {}
        for u in updates:
            digest = b"".join(np.ascontiguousarray(u.arrays[k]).tobytes() for k in sorted(u.arrays) if "lora_A" in k)
            groups.setdefault(digest, []).append(u)
        most = max(groups.values(), key=lambda g: (len(g), sum(u.num_examples for u in g)))
        return {k: v for k, v in most[0].arrays.items() if "lora_A" in k}

    def _breaks_the_rule(self, u: Update, ref_a: dict[str, np.ndarray]) -> str | None:
        """Why an update that passed the robust screen does not follow this run's aggregation rule."""
        cfg = self.server_cfg
        if cfg.lora_aggregation == "ffa":
            if changed := next((k for k in sorted(ref_a) if k in u.arrays
                                and not np.array_equal(u.arrays[k], ref_a[k])), None):
                return f"lora_aggregation ffa: the update changed {changed} (A must stay frozen)"
        if cfg.dp is not None and self._global:
            norm = update_norm(u.arrays, self._global)
            if norm > cfg.dp.clipping_norm * (1 + 1e-4) + 1e-6:
                return f"dp: update norm {norm:.4g} is above clipping_norm {cfg.dp.clipping_norm:g} (not clipped)"
        return None

    def _privatize(self, r: int, arrays: ArrayRecord, n: int) -> ArrayRecord:
        """The average of n clipped updates plus Gaussian noise; records the release and the privacy spent."""
        dp = self.server_cfg.dp
        state = {k: a.numpy() for k, a in arrays.items()}
        keys = [k for k in state if "lora_B" in k] if self.server_cfg.lora_aggregation == "ffa" else list(state)
        state, std = noised(state, keys, dp.noise_multiplier, dp.clipping_norm, n)
        info = {"clipping_norm": dp.clipping_norm, "noise_multiplier": dp.noise_multiplier, "noise_std": std,
                "updates": n, "release": None, "epsilon": None, "delta": dp.target_delta}
        if dp.noise_multiplier > 0:
            release = Release(dp.noise_multiplier, n)
            self.privacy.record(release)
            spent = self.privacy.spent(population=len(self._node_names))
            info.update(release=vars(release), epsilon=spent.epsilon, releases=spent.num_releases)
            log(INFO, "round %d: DP: %d updates clipped to %g, noise std %.3g; privacy spent epsilon %.3f at "
                "delta %g after %d release(s)", r, n, dp.clipping_norm, std, spent.epsilon, dp.target_delta,
                spent.num_releases)
        else:
            log(WARNING, "round %d: DP noise_multiplier is 0: updates clipped to %g, no privacy claimed",
                r, dp.clipping_norm)
        self._record(r)["privacy"] = info
        return ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in state.items()})

    # ------------------------------------------------------------------------------ evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        r = self.real_round(server_round)
        if not self._record(r)["kept"]:
            # Nothing was aggregated: the global adapter is the one the edges already serve, so an
            # evaluation would only take CPU from busy edges.
            log(INFO, "round %d: the global adapter did not change; no evaluation, the edges keep "
                "serving what they serve", r)
            return []
        self._outbox = list(super().configure_evaluate(r, wire.pack_record(arrays), config, grid))
        return self._outbox

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        r = self.real_round(server_round)
        rec = self._record(r)
        replies = list(replies)
        names = self._names_of(replies)
        usable = []
        for m in replies:
            name = names[self._node_of(m)]
            if m.has_error():
                rec["eval"][name] = {"error": m.error.reason}
                log(WARNING, "round %d: evaluation on %s failed: %s", r, name, m.error.reason)
                continue
            metrics = m.content.metric_records
            if len(metrics) != 1:
                rec["eval"][name] = {"error": f"expected one MetricRecord, got {len(metrics)}"}
                continue
            values = dict(next(iter(metrics.values())))
            rec["eval"][name] = values
            log(INFO, "round %d: %s holdout eval-loss %s", r, name, _fmt(values.get("eval-loss")))
            if values.get("canary-refused"):
                rec["refused_by"].append(name)
                log(WARNING, "round %d: %s refused to serve this round's global (its canary gate: holdout "
                    "loss %s, worse than what it serves); it keeps serving version %s", r, name,
                    _fmt(values.get("eval-loss")), _fmt(values.get("adapter-version")))
            weight = values.get(self.weighted_by_key)
            if isinstance(weight, (int, float)) and weight > 0:
                usable.append(m)
        if not usable:
            return None
        metrics = super().aggregate_evaluate(r, _common_metric_keys(usable, r))
        rec["eval_aggregate"] = None if metrics is None else dict(metrics)
        return metrics


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def _unique_names(names: dict[int, str]) -> dict[int, str]:
    """A name reported by two nodes gets '#<node id>' appended."""
    counts: dict[str, int] = {}
    for n in names.values():
        counts[n] = counts.get(n, 0) + 1
    return {nid: (n if counts[n] == 1 else f"{n}#{nid}") for nid, n in names.items()}


def _train_reply_problem(content: RecordDict) -> str | None:
    """What makes a TRAIN reply unusable for FedAvg (one ArrayRecord, one MetricRecord with weight)."""
    if len(content.array_records) != 1:
        return f"expected one ArrayRecord, got {len(content.array_records)}"
    if len(content.metric_records) != 1:
        return f"expected one MetricRecord, got {len(content.metric_records)}"
    n = next(iter(content.metric_records.values())).get(P.NUM_EXAMPLES)
    if not isinstance(n, (int, float)):
        return f"metrics lack a numeric '{P.NUM_EXAMPLES}'"
    return None


def _keyed(m: Message, arrays: dict[str, np.ndarray]) -> Message:
    """The reply with its adapter keyed by tensor name (Flower's aggregation averages tensor by tensor)."""
    if not any(wire.is_packed(a) for a in m.content.array_records.values()):
        return m
    content = RecordDict(dict(m.content.items()))
    content[next(iter(m.content.array_records))] = wire.keyed(arrays)
    return Message(content, metadata=m.metadata)


def _with_weight(m: Message, weight: float) -> Message:
    """The reply with its aggregation weight (num-examples) replaced."""
    content = RecordDict(dict(m.content.items()))
    key, rec = next(iter(m.content.metric_records.items()))
    content[key] = MetricRecord({**dict(rec), P.NUM_EXAMPLES: weight})
    return Message(content, metadata=m.metadata)


def _common_metric_keys(replies: list[Message], r: int) -> list[Message]:
    """flwr's FedAvg rejects the whole round when MetricRecords differ in keys; keep the common ones."""
    records = [next(iter(m.content.metric_records.values())) for m in replies]
    common = set.intersection(*(set(rec.keys()) for rec in records))
    if all(set(rec.keys()) == common for rec in records):
        return replies
    extra = sorted(set.union(*(set(rec.keys()) for rec in records)) - common)
    log(WARNING, "round %d: replies differ in metric keys; averaging only the common ones (not: %s)",
        r, ", ".join(extra))
    out = []
    for m, rec in zip(replies, records, strict=True):
        content = RecordDict({P.METRICS: MetricRecord({k: rec[k] for k in common})})
        for key, arrays in m.content.array_records.items():
            content[key] = arrays
        out.append(Message(content, metadata=m.metadata))
    return out


class CollmFedAvg(CollmRounds, FedAvg):
    """FedAvg over the LoRA adapter, with the CoLLM balancer, robust filtering and checkpoints."""


class CollmFedProx(CollmRounds, FedProx):
    """FedProx ("proximal-mu" in every TRAIN config), with the CoLLM round logic."""


class CollmFedAdam(CollmRounds, FedAdam):
    """FedAdam (server-side Adam over the averaged update), with the CoLLM round logic."""


def build_strategy(cfg: ServerConfig, round_offset: int = 0,
                   server_state: dict[str, dict[str, np.ndarray]] | None = None) -> CollmRounds:
    """The strategy named by `cfg.strategy`. flwr samples every connected edge for the round's load
    reports (`fraction_train` is applied by the balancer) and `fraction_evaluate` of them for evaluation.
    flwr counts its sample before it waits for `min_available_nodes`, so its minimum for a sample
    (min_train_nodes, and min_evaluate_nodes while every edge evaluates) is the number waited for."""
    common = dict(server_cfg=cfg, round_offset=round_offset, fraction_train=1.0,
                  fraction_evaluate=cfg.fraction_evaluate, min_train_nodes=cfg.min_nodes,
                  min_evaluate_nodes=cfg.min_nodes if cfg.fraction_evaluate >= 1 else 1,
                  min_available_nodes=cfg.min_nodes)
    if cfg.strategy == "fedprox":
        strategy: CollmRounds = CollmFedProx(proximal_mu=cfg.proximal_mu, **common)
    elif cfg.strategy == "fedadam":
        strategy = CollmFedAdam(**cfg.fedadam.model_dump(), **common)
    else:
        strategy = CollmFedAvg(**common)
    if server_state:
        strategy.restore_server_state(server_state)
    return strategy
