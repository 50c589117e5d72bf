"""Per-client limits at the HTTP door: a token bucket of requests per second and a cap on requests in flight
(streams included), per API key (or per client address where no key is sent). Pure state over plain numbers:
`admit` decides, `release` ends a request; the door (`common/auth.py` KeyCheck) calls them.

Why: one key's client that opens hundreds of slow streams, or fires requests in a loop, would otherwise take
the capacity every other client's SLO depends on (issue #34).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from pydantic import Field

from collm.common.config import Strict

MAX_CLIENTS = 10_000  # clients remembered; the idlest are forgotten first (a flood of addresses stays bounded)


class RateLimit(Strict):
    """Limits per API key (per client address on an open API)."""

    requests_per_s: float | None = Field(None, gt=0, description="sustained requests per second per key; null: none")
    burst: int = Field(20, ge=1, description="requests a key may send at once above the sustained rate")
    max_in_flight: int | None = Field(None, ge=1, description="requests (streams included) one key may have open; "
                                      "null: none")


def client_id(token: str | None, address: str | None) -> str:
    """Whom a limit applies to: a digest of the key (the key itself is never kept), else the address."""
    if token:
        return "key:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    return f"addr:{address or '?'}"


@dataclass
class _Client:
    tokens: float
    at: float
    in_flight: int = 0


@dataclass
class Limiter:
    cfg: RateLimit
    clients: dict[str, _Client] = field(default_factory=dict)

    def admit(self, who: str, now: float) -> float | None:
        """None if the request may go on (it then counts as in flight until `release`), else seconds to wait."""
        c = self.clients.get(who)
        if c is None:
            if len(self.clients) >= MAX_CLIENTS:
                self._forget(now)
            c = self.clients[who] = _Client(float(self.cfg.burst), now)
        rate = self.cfg.requests_per_s
        if rate is not None:
            c.tokens = min(float(self.cfg.burst), c.tokens + (now - c.at) * rate)
            c.at = now
            if c.tokens < 1.0:
                return (1.0 - c.tokens) / rate
        if self.cfg.max_in_flight is not None and c.in_flight >= self.cfg.max_in_flight:
            return 1.0
        if rate is not None:
            c.tokens -= 1.0
        c.in_flight += 1
        return None

    def release(self, who: str) -> None:
        c = self.clients.get(who)
        if c is not None:
            c.in_flight = max(0, c.in_flight - 1)

    def _forget(self, now: float) -> None:
        idle = sorted((k for k, c in self.clients.items() if c.in_flight == 0), key=lambda k: self.clients[k].at)
        for k in idle[: max(1, len(self.clients) // 10)]:
            del self.clients[k]


def retry_after(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
