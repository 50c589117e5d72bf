"""Reading OpenAI-style server-sent event streams, once for every reader (the router, collm-bench's load
generator, the router benchmark): what a `data:` event holds and when the first token came.

The first token is the first chunk that carries generated text (`text` of a completion, `delta.content`
of a chat completion) or a finish reason: a generation that ended before any text showed (an
immediate end of sequence, text the detokenizer held back) has its first token there.
"""

from __future__ import annotations

import json

DONE = "[DONE]"


def data_of(line: str) -> dict | None:
    """The JSON object of one `data: {...}` line; None for other lines, `[DONE]` and what is not an object."""
    if not line.startswith("data: "):
        return None
    payload = line[6:].strip()
    if payload == DONE:
        return None
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def first_choice(obj: dict) -> dict:
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else {}
    return first if isinstance(first, dict) else {}


def text_of(obj: dict) -> str:
    """The generated text a chunk carries (completion or chat), '' if none."""
    c = first_choice(obj)
    delta = c.get("delta")
    text = c.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    return text if isinstance(text, str) else ""


def finish_reason_of(obj: dict) -> str | None:
    r = first_choice(obj).get("finish_reason")
    return r if isinstance(r, str) else None


def is_first_token(obj: dict) -> bool:
    """Whether this chunk, if nothing came before it, marks the first token (the module docstring)."""
    return bool(text_of(obj)) or finish_reason_of(obj) is not None


def completion_tokens(obj: dict) -> int | None:
    usage = obj.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None
