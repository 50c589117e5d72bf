"""Reading the edges' replies on the server side (the keys live in `collm.common.protocol`)."""

from __future__ import annotations

from flwr.app import Message

from collm.common.protocol import EDGE_NAME, IDENTITY


def edge_name(msg: Message) -> str | None:
    """The edge name in the reply's identity record, or None (error replies carry none)."""
    ident = msg.content.config_records.get(IDENTITY) if msg.has_content() else None
    name = ident.get(EDGE_NAME) if ident is not None else None
    return str(name) if name else None
