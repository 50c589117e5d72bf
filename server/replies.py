"""Reading the edges' replies on the server side (the keys live in `collm.common.protocol`)."""

from __future__ import annotations

import math

from flwr.app import Message

from collm.common.protocol import EDGE_NAME, IDENTITY, UNKNOWN

from collm.server.balancer import EdgeReport


def edge_name(msg: Message) -> str | None:
    """The edge name in the reply's identity record, or None (error replies carry none)."""
    ident = msg.content.config_records.get(IDENTITY) if msg.has_content() else None
    name = ident.get(EDGE_NAME) if ident is not None else None
    return str(name) if name else None


def parse_report(name: str, report: dict) -> EdgeReport:
    """EdgeReport from a QUERY reply's MetricRecord (missing or non-finite values: unknown/zero).

    Attainment is a fraction, so any negative value means unknown; a gain may be negative
    (quality got worse), so only exactly UNKNOWN (-1.0) means unknown.
    """
    def num(key: str, default: float = 0.0) -> float:
        v = report.get(key, default)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else default

    attainment, gain = num("slo-attainment", UNKNOWN), num("gain-per-ktok", UNKNOWN)
    return EdgeReport(
        name=name,
        request_rate=num("request-rate"),
        slo_attainment=attainment if attainment >= 0 else None,
        spare_capacity=num("spare-capacity"),
        queue_depth=num("queue-depth"),
        train_examples=int(num("train-examples")),
        gain_per_ktok=gain if gain != UNKNOWN else None,
        train_tokens_per_s=num("train-tokens-per-s"),
    )
