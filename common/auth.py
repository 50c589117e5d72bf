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
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from collm.common.config import Strict
from collm.common.errors import UserError
from collm.common.protocol import error_body


class KeySource(Strict):
    """Where keys come from; every source given is used."""

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

    api_keys: KeySource = KeySource()
    admin_tokens: KeySource = KeySource()
    protect_health: bool = Field(False, description="also require an API key for /health and /metrics")


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


class KeyCheck:
    """ASGI middleware: every request checked against `keys` before it reaches the app, on the routed path.
    Plain ASGI: a streamed response passes straight through (Starlette's BaseHTTPMiddleware relays every
    response through a task and a memory stream of its own)."""

    def __init__(self, app, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        # scope["path"] is the path the app routes on; request.url.path is rebuilt from the Host header, which a
        # client can poison to skip this check (CVE-2026-48710; starlette >= 1.0.1 is pinned as well)
        refused = refusal(scope["path"], auth, self.keys)
        if refused is None:
            return await self.app(scope, receive, send)
        status, body = refused
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def install(app, keys: Keys) -> None:
    """Check every request of a FastAPI `app` against `keys` before it reaches a handler (outermost of the
    middleware installed so far)."""
    if keys.api or keys.admin:
        app.add_middleware(KeyCheck, keys=keys)
