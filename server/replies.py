"""Reading the edges' replies on the server side (the keys live in `collm.common.protocol`)."""

from __future__ import annotations

from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore import log
from logging import WARNING

import numpy as np

from collm.common import protocol as P
from collm.common import wire
from collm.common.protocol import EDGE_NAME, IDENTITY


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


def with_weight(m: Message, weight: float) -> Message:
    """The reply with its aggregation weight (num-examples) replaced."""
    content = RecordDict(dict(m.content.items()))
    key, rec = next(iter(m.content.metric_records.items()))
    content[key] = MetricRecord({**dict(rec), P.NUM_EXAMPLES: weight})
    return Message(content, metadata=m.metadata)


def common_metric_keys(replies: list[Message], r: int) -> list[Message]:
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
