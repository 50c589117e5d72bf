"""Bearer API keys for collm-edge and collm-router: who may call `/v1/*`, and who may call `/admin/*`.

Keys come from the config, an environment variable (comma-separated) or a file (one per line,
`#` comments), several at once; they are resolved once at start-up (a named variable or file that
is missing is a one-line error), compared in constant time against every key and never logged.
With no keys configured a surface is open, as before. `/health` and `/metrics` stay open unless
`protect_health` is set.

    401  no key, or one that is not valid            (code invalid_api_key)
    403  a valid API key on /admin/* (admin token needed)   (code admin_token_required)
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

from pydantic import Field

from collm.common.config import Strict
from collm.common.errors import UserError
from collm.common.http_guard import json_reply
from collm.common.limits import Limiter, RateLimit, client_id, retry_after
from collm.common.protocol import error_body

log = logging.getLogger("collm.auth")


class KeySource(Strict):
    """Where keys come from; every source given is used."""

    secret: ClassVar[bool] = True  # a config error under it never echoes the value (common/config.py)

    keys: list[str] = Field(default_factory=list, description="keys written in the config")
    env: str | None = Field(None, description="environment variable holding comma-separated keys")
    file: str | None = Field(None, description="file with one key per line ('#' starts a comment)")

    def resolve(self, what: str) -> tuple[str, ...]:
        out = [k.strip() for k in self.keys if k.strip()]
        if self.env:
            if self.env not in os.environ:
                raise UserError(f"{what}.env: environment variable {self.env} is not set; export it or drop the field")
            out += [k.strip() for k in os.environ[self.env].split(",") if k.strip()]
        if self.file:
            path = Path(self.file).expanduser()
            try:
                lines = path.read_text().splitlines()
            except OSError as e:
                raise UserError(f"{what}.file: cannot read {path} ({e.strerror or e}); give a readable key file") from None
            out += [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]
        return tuple(out)


class AuthConfig(Strict):
    """Bearer keys for the OpenAI API and a separate admin token (see collm.common.auth)."""

    secret: ClassVar[bool] = True  # a key typed where this mapping goes must not be echoed either

    api_keys: KeySource = KeySource()
    admin_tokens: KeySource = KeySource()
    protect_health: bool = Field(False, description="also require an API key for /health and /metrics")
    reload_s: float = Field(2.0, gt=0, description="key files are checked for changes this often; a changed file's "
                            "keys apply from the next request (rotate a key without a restart)")
    limits: RateLimit = Field(RateLimit(), description="per-key request rate and requests in flight on /v1/* "
                              "(common/limits.py); off by default")
    audit_log: str | None = Field(None, description="append one JSON line per /admin/* call (when, who: a digest of "
                                  "the token, from where, what, the status) to this file; every call is logged too")


@dataclass(frozen=True)
class Keys:
    api: tuple[str, ...]
    admin: tuple[str, ...]
    protect_health: bool = False

    @classmethod
    def from_config(cls, cfg: AuthConfig, where: str = "auth") -> Keys:
        return cls(cfg.api_keys.resolve(f"{where}.api_keys"), cfg.admin_tokens.resolve(f"{where}.admin_tokens"),
                   cfg.protect_health)


def matches(given: str, keys: tuple[str, ...]) -> bool:
    ok = False
    for k in keys:  # every key is compared, so the time does not tell which one (or whether any) matched
        ok |= hmac.compare_digest(given.encode(), k.encode())
    return ok


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def refusal(path: str, authorization: str | None, keys: Keys) -> tuple[int, dict] | None:
    """None if the request may go on, else (status, OpenAI error body). A pure function of the path,
    the Authorization header and the keys."""
    token = bearer(authorization)
    if path.startswith("/admin"):
        if not keys.admin:
            return None
        if token is not None and matches(token, keys.admin):
            return None
        if token is not None and keys.api and matches(token, keys.api):
            return 403, error_body("this is an API key; /admin/* needs the admin token", "permission_error",
                                   code="admin_token_required")
        return 401, error_body("missing or invalid admin token: send 'Authorization: Bearer <admin token>'",
                               "authentication_error", code="invalid_api_key")
    protected = path.startswith("/v1") or (keys.protect_health and path in ("/health", "/metrics"))
    if not protected or not keys.api:
        return None
    if token is not None and (matches(token, keys.api) or (keys.admin and matches(token, keys.admin))):
        return None
    return 401, error_body("missing or invalid API key: send 'Authorization: Bearer <key>'", "authentication_error",
                           code="invalid_api_key")


class KeyRing:
    """The keys of an `AuthConfig`, read again from their files when those change (checked every `reload_s`,
    on the request path: a stat per file). A file that no longer reads keeps the keys there were, with a
    warning: a botched edit must not open or close the door."""

    def __init__(self, cfg: AuthConfig, where: str = "auth"):
        self.cfg, self.where = cfg, where
        self.keys = Keys.from_config(cfg, where)
        self._stamp = self._files()
        self._checked = time.monotonic()

    def _files(self) -> tuple:
        out = []
        for src in (self.cfg.api_keys, self.cfg.admin_tokens):
            if src.file:
                try:
                    st = Path(src.file).expanduser().stat()
                    out.append((src.file, st.st_mtime_ns, st.st_size))
                except OSError:
                    out.append((src.file, None, None))
        return tuple(out)

    def current(self) -> Keys:
        now = time.monotonic()
        if now - self._checked >= self.cfg.reload_s:
            self._checked = now
            stamp = self._files()
            if stamp != self._stamp:
                try:
                    keys = Keys.from_config(self.cfg, self.where)
                except UserError as e:  # the stamp stays: the next check reads the file again
                    log.warning("%s: kept the previous keys: %s", self.where, e)
                    return self.keys
                self._stamp = stamp
                if (self.keys.api and not keys.api) or (self.keys.admin and not keys.admin):
                    # an emptied file (or one caught between truncate and write) would open the door
                    log.warning("%s: a key file now holds no key; kept the previous keys (remove the source from "
                                "the config, and restart, to open that surface)", self.where)
                    return self.keys
                self.keys = keys
                log.info("%s: key files changed; %d API key(s), %d admin token(s) now", self.where,
                         len(self.keys.api), len(self.keys.admin))
        return self.keys


class KeyCheck:
    """ASGI middleware, the HTTP door: every request checked against the keys on the routed path, /v1/* held
    to the per-key limits, every /admin/* call audited. Plain ASGI: a streamed response passes straight
    through (Starlette's BaseHTTPMiddleware relays every response through a task and a memory stream of its
    own), and a request counts as in flight until its last byte is sent."""

    def __init__(self, app, ring: KeyRing):
        self.app, self.ring = app, ring
        cfg = ring.cfg
        self.limiter = Limiter(cfg.limits) if cfg.limits.requests_per_s or cfg.limits.max_in_flight else None
        self.audit = Path(cfg.audit_log).expanduser() if cfg.audit_log else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        # scope["path"] is the path the app routes on; request.url.path is rebuilt from the Host header, which a
        # client can poison to skip this check (CVE-2026-48710; starlette >= 1.0.1 is pinned as well)
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if not path.startswith("/admin"):
            return await self._checked(scope, receive, send, path, auth)
        audited = False

        async def watched(message):  # the audit line is written before the answer leaves
            nonlocal audited
            if message["type"] == "http.response.start" and not audited:
                audited = True
                self._audit(scope, auth, message["status"])
            await send(message)

        try:
            await self._checked(scope, receive, watched, path, auth)
        finally:
            if not audited:  # the app failed before it answered
                self._audit(scope, auth, None)

    async def _checked(self, scope, receive, send, path: str, auth: str | None):
        refused = refusal(path, auth, self.ring.current())
        if refused is not None:
            status, body = refused
            return await json_reply(send, status, body, [(b"www-authenticate", b"Bearer")] if status == 401 else None)
        if self.limiter is None or not path.startswith("/v1"):
            return await self.app(scope, receive, send)
        # a key names the client only where keys are required (it then matched one): on an open API a made-up
        # token per request would get a fresh bucket each time, so the address names the client there
        who = client_id(bearer(auth) if self.ring.keys.api else None, (scope.get("client") or ("?",))[0])
        wait = self.limiter.admit(who, time.monotonic())
        if wait is not None:
            lim = self.ring.cfg.limits
            return await json_reply(send, 429, error_body(
                f"this key's limit ({lim.requests_per_s or 'no'} requests/s, burst {lim.burst}; "
                f"{lim.max_in_flight or 'no limit on'} in flight: auth.limits) is reached; retry after "
                f"{retry_after(wait)} s", "rate_limit_error", code="rate_limited"),
                [(b"retry-after", retry_after(wait).encode())])
        try:
            return await self.app(scope, receive, send)
        finally:
            self.limiter.release(who)

    def _audit(self, scope, auth: str | None, status: int | None) -> None:
        token = bearer(auth)
        entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "method": scope["method"],
                 "path": scope["path"][:200], "who": client_id(token, None) if token else "anonymous",
                 "client": (scope.get("client") or ("?",))[0], "status": status}
        log.info("admin call: %s", json.dumps(entry))
        if self.audit is not None:
            try:
                with open(self.audit, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as e:
                log.warning("auth.audit_log: cannot append to %s (%s)", self.audit, e)


def install(app, ring: KeyRing) -> None:
    """The door (`KeyCheck`) around a FastAPI `app`: outermost of the middleware installed so far."""
    app.add_middleware(KeyCheck, ring=ring)
