"""Typed configuration: YAML files parsed into pydantic models (the loader and the shared sections).

Each process keeps its own config next to it (`collm.edge_client.config`, `collm.server.config`,
`collm.router.config`, `collm.lab.bench_config`); this module has what they share.

Unknown keys are errors. Every validation error becomes one line that names the file, the
field path, the bad value and what is expected, e.g.

    configs/edge.yaml: engine.max_running: expected an integer, got 'many'

Relative paths inside a config are resolved against the current working directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from collm.common.errors import UserError, reading

LORA_TARGETS_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Strict(BaseModel):
    """Base for every config section: unknown keys are rejected, values are validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


# ----------------------------------------------------------------------------- shared sections
class LoraConfig(Strict):
    """The LoRA adapter trained on the edges and served unmerged."""

    r: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS_LLAMA), min_length=1)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


# ----------------------------------------------------------------------------- loading
M = TypeVar("M", bound=BaseModel)


class ServerTls(Strict):
    """HTTPS for an HTTP API (uvicorn's own TLS): a certificate chain and its private key, both or neither."""

    certfile: str | None = Field(None, description="PEM certificate (chain) this server presents")
    keyfile: str | None = Field(None, description="PEM private key of that certificate")

    @model_validator(mode="after")
    def _pair(self) -> ServerTls:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("give both certfile and keyfile, or neither")
        for name in ("certfile", "keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"{name} {path!r} does not exist")
        return self

    @property
    def enabled(self) -> bool:
        return self.certfile is not None

    def uvicorn_args(self) -> dict:
        if not self.enabled:
            return {}
        return {"ssl_certfile": str(Path(self.certfile).expanduser()),
                "ssl_keyfile": str(Path(self.keyfile).expanduser())}


def _describe_expected(err: dict[str, Any]) -> str:
    msg = err.get("msg", "invalid value")
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    msg = msg.replace("Input should be", "expected").replace("Input", "value")
    return msg[0].lower() + msg[1:] if msg else msg


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names allowed at `loc` (walking nested models), for unknown-key errors."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = field.annotation
    return sorted(getattr(cls, "model_fields", {}))


def _models_in(annotation: Any) -> list:
    """The classes an annotation names: itself, or the members of `X | None`, `list[X]` and the like."""
    args = get_args(annotation)
    return [c for a in args for c in _models_in(a)] if args else [annotation]


def _secret_at(model: type[BaseModel], loc: tuple) -> bool:
    """Whether `loc` lies under a model that holds secrets (`secret = True`: keys, tokens), whose values a
    config error must not echo into logs."""
    classes: list = [model]
    for part in loc:
        if any(getattr(c, "secret", False) is True for c in classes):
            return True
        fields = [f for c in classes if (f := getattr(c, "model_fields", {}).get(part)) is not None]
        if not fields and not isinstance(part, int):
            return False
        if fields:  # an int part is a list index: the same classes go on
            classes = [c for f in fields for c in _models_in(f.annotation)]
    return any(getattr(c, "secret", False) is True for c in classes)


def format_validation_error(source: str, model: type[BaseModel], exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        path = ".".join(str(p) for p in loc) or "(top level)"
        if err.get("type") == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(model, loc))
            lines.append(f"{source}: {path}: unknown key (allowed here: {allowed})")
            continue
        got = err.get("input")
        shown = "" if isinstance(got, dict) else (f", got a {type(got).__name__} (not shown: it may be a key)"
                                                  if _secret_at(model, loc) else f", got {got!r}")
        lines.append(f"{source}: {path}: {_describe_expected(err)}{shown}")
    return "\n".join(lines)


def validate_config(model: type[M], data: Any, source: str) -> M:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(source, model, e)) from None


def load_config(model: type[M], path: str | Path, overrides: dict[str, Any] | None = None) -> M:
    """Read a YAML file into `model`; raise UserError with one line per problem."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a folder; give the config file in it (e.g. {p / 'edge.yaml'})")
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        with reading(p, "config"):
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{p}{where}: YAML syntax error: {problem}") from None
    if overrides and isinstance(data, dict | None):  # anything else gets validate_config's one-line error
        data = deep_merge(data or {}, overrides)
    return validate_config(model, data, str(p))


def check_writable_file(path: str | Path, field: str) -> Path:
    """Prove `path` can be written now (a file, or none yet, in a folder this user can write), not after minutes
    of work whose result would then be lost."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"{field} {p}: is a folder; give a file name in it")
    if not p.parent.is_dir():
        raise UserError(f"{field} {p}: the folder {p.parent} does not exist")
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
        if not existed:
            p.unlink()
    except OSError as e:
        raise UserError(f"{field} {p}: cannot write it ({e.strerror or e})") from None
    return p


def check_writable_dir(path: str | Path, field: str) -> Path:
    """Create `path` if needed and prove it is writable now, not at shutdown when state is saved."""
    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".collm-write-check"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{field}: cannot write to {d} ({e.strerror or e}); choose a folder this user can write") \
            from None
    return d


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dump_config(cfg: BaseModel) -> str:
    """The fully resolved config (defaults filled in) as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
