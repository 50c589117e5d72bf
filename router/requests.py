"""What a request asks the router for, read from its body and its stream, never raising on odd input:
the routing rule's view of it (`request_view`) and its relayed stream's first token and length
(`SSEWatch`, by `common.sse`'s one rule).
"""

from __future__ import annotations

import math
import time

from collm.common import sse
from collm.router.config import RouterConfig
from collm.router.policy import RequestView

ROLE_MARKER_TOKENS = 8  # what the router guesses a chat message's template adds (it has no tokenizer)
MAX_TOKENS = 2**31 - 1  # the most max_tokens the rule reads (an edge's own limit is far lower)
MAX_TARGET_MS = 1e9     # the longest SLO target the rule reads (11 days)


def request_view(body: object, chat: bool, cfg: RouterConfig, typical_output: float) -> tuple[RequestView, bool]:
    """(the rule's view of the request, whether it asks for a stream); never raises on odd bodies."""
    if not isinstance(body, dict):
        return RequestView(1, int(typical_output), best_effort=True), False
    r = cfg.routing
    if chat:
        msgs = body.get("messages") if isinstance(body.get("messages"), list) else []
        chars, extra = 0, 0
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
            chars += len(c.encode("utf-8", "surrogatepass")) if isinstance(c, str) else 0
            extra += ROLE_MARKER_TOKENS
        prompt_tokens = math.ceil(chars / r.chars_per_token) + extra
    else:
        p = body.get("prompt")
        p = p[0] if isinstance(p, list) and p and isinstance(p[0], str) else p
        prompt_tokens = (math.ceil(len(p.encode("utf-8", "surrogatepass")) / r.chars_per_token)
                         if isinstance(p, str) else 1)
    # JSON's integers are unbounded: a 300-digit one overflowed the rule's float arithmetic (a 500). A value out
    # of range is the edge's to reject (400); the rule reads it as absent. Comparisons never overflow.
    m = body.get("max_tokens") or body.get("max_completion_tokens")
    max_tokens = m if isinstance(m, int) and not isinstance(m, bool) and 0 < m <= MAX_TOKENS else int(typical_output)
    slo = body.get("slo") if isinstance(body.get("slo"), dict) else {}

    def target(key: str) -> float | None:
        v = slo.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_TARGET_MS  # NaN, inf: no
        return v / 1000 if ok else None

    view = RequestView(max(1, prompt_tokens), max_tokens, target("ttft_ms"), target("tpot_ms"),
                       body.get("best_effort") is True)
    return view, body.get("stream") is True


class SSEWatch:
    """Reads the events of a relayed stream on the side: first-token time, token count, boundaries."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.buf = b""
        self.first_token_s: float | None = None
        self.completion_tokens: int | None = None
        self.at_boundary = True

    def feed(self, chunk: bytes) -> None:
        self.at_boundary = chunk.endswith(b"\n\n")
        self.buf += chunk
        while b"\n\n" in self.buf:
            ev, self.buf = self.buf.split(b"\n\n", 1)
            if self.first_token_s is None or b'"usage"' in ev:  # parse only what can still tell something
                self._parse(ev.decode("utf-8", errors="replace"))

    def _parse(self, event: str) -> None:
        obj = sse.data_of(event)
        if obj is None:
            return
        if self.first_token_s is None and sse.is_first_token(obj):
            self.first_token_s = time.perf_counter() - self.t0
        if (n := sse.completion_tokens(obj)) is not None:
            self.completion_tokens = n
