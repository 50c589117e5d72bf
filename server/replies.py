"""Reading the edges' replies on the server side (the keys live in `collm.common.protocol`)."""

from __future__ import annotations

from dataclasses import replace

from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore import log
from logging import INFO, WARNING

import numpy as np

from collm.common import protocol as P
from collm.common import wire
from collm.common.protocol import EDGE_NAME, IDENTITY
from collm.server.robust import Update, capped_weights


def edge_name(msg: Message) -> str | None:
    """The edge name in the reply's identity record, or None (error replies carry none)."""
    ident = msg.content.config_records.get(IDENTITY) if msg.has_content() else None
    name = ident.get(EDGE_NAME) if ident is not None else None
    return str(name) if name else None


def fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def unique_names(names: dict[int, str]) -> dict[int, str]:
    """A name reported by two nodes gets '#<node id>' appended."""
    counts: dict[str, int] = {}
    for n in names.values():
        counts[n] = counts.get(n, 0) + 1
    return {nid: (n if counts[n] == 1 else f"{n}#{nid}") for nid, n in names.items()}


def train_reply_problem(content: RecordDict) -> str | None:
    """What makes a TRAIN reply unusable for FedAvg (one ArrayRecord, one MetricRecord with weight)."""
    if len(content.array_records) != 1:
        return f"expected one ArrayRecord, got {len(content.array_records)}"
    if len(content.metric_records) != 1:
        return f"expected one MetricRecord, got {len(content.metric_records)}"
    n = next(iter(content.metric_records.values())).get(P.NUM_EXAMPLES)
    if not isinstance(n, (int, float)):
        return f"metrics lack a numeric '{P.NUM_EXAMPLES}'"
    return None


def keyed(m: Message, arrays: dict[str, np.ndarray]) -> Message:
    """The reply with its adapter keyed by tensor name (Flower's aggregation averages tensor by tensor)."""
    if not any(wire.is_packed(a) for a in m.content.array_records.values()):
        return m
    content = RecordDict(dict(m.content.items()))
    content[next(iter(m.content.array_records))] = wire.keyed(arrays)
    return Message(content, metadata=m.metadata)


def with_arrays(m: Message, arrays: dict[str, np.ndarray]) -> Message:
    """The reply with its adapter replaced (keyed by tensor): a rule that brought it to the global's shapes."""
    content = RecordDict(dict(m.content.items()))
    content[next(iter(m.content.array_records))] = wire.keyed(arrays)
    return Message(content, metadata=m.metadata)


def with_weight(m: Message, weight: float) -> Message:
    """The reply with its aggregation weight (num-examples) replaced."""
    content = RecordDict(dict(m.content.items()))
    key, rec = next(iter(m.content.metric_records.items()))
    content[key] = MetricRecord({**dict(rec), P.NUM_EXAMPLES: weight})
    return Message(content, metadata=m.metadata)


def common_metric_keys(replies: list[Message], r: int) -> list[Message]:
    """flwr's FedAvg rejects the whole round when MetricRecords differ in keys, and its average raises (ending
    the ServerApp) on a list beside a number or lists of unequal length: keep the keys every reply holds as a
    number. The metrics are an edge's word; ours are all numbers."""
    records = [next(iter(m.content.metric_records.values())) for m in replies]
    common = set.intersection(*(set(rec.keys()) for rec in records))
    common = {k for k in common if all(isinstance(rec[k], (int, float)) for rec in records)}
    if all(set(rec.keys()) == common for rec in records):
        return replies
    extra = sorted(set.union(*(set(rec.keys()) for rec in records)) - common)
    log(WARNING, "round %d: replies differ in metric keys or hold lists; averaging only the numbers every reply "
        "holds (not: %s)", r, ", ".join(extra))
    out = []
    for m, rec in zip(replies, records, strict=True):
        content = RecordDict({P.METRICS: MetricRecord({k: rec[k] for k in common})})
        for key, arrays in m.content.array_records.items():
            content[key] = arrays
        out.append(Message(content, metadata=m.metadata))
    return out


def read_train_replies(replies: list[Message], names: list[str], robust, rec) -> tuple[list[Update], list[Message]]:
    """Each usable TRAIN reply as an Update with the weight it will carry, and the reply keyed by tensor; the
    others are recorded in `rec.dropped` with why. An edge's reply is untrusted: whatever it holds, a bad one
    is left out and the round goes on."""
    updates, candidates = [], []
    for m, name in zip(replies, names, strict=True):
        try:
            if m.has_error():
                rec.train[name] = {"error": str(m.error.reason)[:500]}
                rec.dropped[name] = f"error reply: {str(m.error.reason)[:500]}"
                continue
            metrics = m.content.metric_records
            rec.train[name] = dict(next(iter(metrics.values()))) if len(metrics) == 1 else {}
            if problem := train_reply_problem(m.content):
                rec.dropped[name] = problem
                continue
            arrays = wire.unpack(next(iter(m.content.array_records.values())))
            alpha = rec.train[name].get(P.LORA_ALPHA)
            alpha = float(alpha) if isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha > 0 else None
            update = Update(name, float(rec.train[name][P.NUM_EXAMPLES]), arrays, alpha)
            candidate = keyed(m, arrays)
        except Exception as e:  # noqa: BLE001 - RecursionError, TypeError, ...: the reply is left out, not the run
            rec.dropped[name] = (f"malformed reply: {str(e)[:300]}" if isinstance(e, ValueError) else
                                 f"malformed reply ({type(e).__name__}: {str(e)[:300]})")
            rec.train.setdefault(name, {})
            continue
        updates.append(update)
        candidates.append(candidate)
    return weighed(updates, robust, rec), candidates


def weighed(updates: list[Update], robust, rec) -> list[Update]:
    """The updates with their FedAvg weight: the examples each edge claims, capped (`robust.max_weight_ratio`,
    each cut recorded in `rec.capped`), or 1 each (`robust.weighting: equal`)."""
    if robust.weighting == "equal":
        return [replace(u, num_examples=1.0) if np.isfinite(u.num_examples) and u.num_examples > 0 else u
                for u in updates]
    weights = capped_weights([u.num_examples for u in updates], robust.max_weight_ratio)
    for u, w in zip(updates, weights, strict=True):
        if w < u.num_examples:
            rec.capped[u.name] = w
            log(WARNING, "update from %s claims %g examples; weighed as %g (robust.max_weight_ratio %g x the "
                "median of the others)", u.name, u.num_examples, w, robust.max_weight_ratio)
    return [replace(u, num_examples=w) for u, w in zip(updates, weights, strict=True)]


def read_eval_replies(replies: list[Message], names: list[str], weighted_by_key: str, r: int, rec) -> list[Message]:
    """Each edge's holdout metrics into `rec.eval`, and an edge whose canary gate refused the new global into
    `rec.refused_by`; the replies that carry a positive weight (`weighted_by_key`) are the ones to average."""
    usable = []
    for m, name in zip(replies, names, strict=True):
        if m.has_error():
            rec.eval[name] = {"error": m.error.reason}
            log(WARNING, "round %d: evaluation on %s failed: %s", r, name, m.error.reason)
            continue
        metrics = m.content.metric_records
        if len(metrics) != 1:
            rec.eval[name] = {"error": f"expected one MetricRecord, got {len(metrics)}"}
            continue
        values = dict(next(iter(metrics.values())))
        rec.eval[name] = values
        log(INFO, "round %d: %s holdout eval-loss %s", r, name, fmt(values.get(P.EVAL_LOSS)))
        if values.get(P.CANARY_REFUSED):
            rec.refused_by.append(name)
            log(WARNING, "round %d: %s refused to serve this round's global (its canary gate: holdout "
                "loss %s, worse than what it serves); it keeps serving version %s", r, name,
                fmt(values.get(P.EVAL_LOSS)), fmt(values.get(P.ADAPTER_VERSION)))
        weight = values.get(weighted_by_key)
        if isinstance(weight, (int, float)) and weight > 0:
            usable.append(m)
    return usable
