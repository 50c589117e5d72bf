"""The OpenAI-compatible request bodies we accept, and OpenAI-style error bodies.

Fields OpenAI clients commonly send are accepted; the ones we cannot honour are rejected with a
400 that names the field when they ask for something other than the default (e.g. `n: 2`).
CoLLM extensions: `slo` (per-request TTFT/TPOT targets) and `ignore_eos`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from collm.edge_client.model.sampling import SEED_MAX, SEED_MIN

MAX_STOP_CHARS = 256  # OpenAI takes up to 4 stop sequences; none needs to be longer than this
UNSUPPORTED = {  # OpenAI options this server does not implement: the values it accepts, and the refusal
    "n": ((1,), "only n=1 is supported"),
    "logprobs": ((None, False, 0), "logprobs are not supported"),
    "presence_penalty": ((0.0,), "penalties are not supported; use 0"),
    "frequency_penalty": ((0.0,), "penalties are not supported; use 0"),
}


def _encodable(text: str, field: str) -> str:
    """Text the tokenizer can take: a lone surrogate (e.g. JSON "\\ud800") cannot be UTF-8 encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} holds text that is not valid Unicode (a lone surrogate code point)") from None
    return text


class SLOOverride(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = True


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    slo: SLOOverride | None = None
    user: str | None = None

    @field_validator("model", "user")
    @classmethod
    def _unicode(cls, v: str | None, info) -> str | None:
        return None if v is None else _encodable(v, info.field_name)

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _supported(cls, v: Any, info) -> Any:
        allowed, message = UNSUPPORTED[info.field_name]
        if v not in allowed:
            raise ValueError(message)
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):  # each token is checked against every stop string
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return [_encodable(s, "stop") for s in stops]

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1 or not isinstance(v[0], str):
                raise ValueError("exactly one prompt string is supported")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return _encodable(v, "the prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                if part.get("type") == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i}: a text part needs a string 'text'")
                if part.get("type") == "text":
                    _encodable(part["text"], f"content part {i}")
        elif isinstance(v, str):
            _encodable(v, "content")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p["text"] for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _max(self) -> ChatRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class AdminTrain(BaseModel):
    """Local training in the SLO slack, outside federated rounds (`/admin/train`)."""

    model_config = ConfigDict(extra="forbid")
    steps: int | None = Field(None, ge=1)
    tokens: int | None = Field(None, ge=1)
    deadline_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _budget(self) -> AdminTrain:
        if self.steps is None and self.tokens is None:
            raise ValueError("give steps or tokens")
        return self


class AdminEvaluate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int | None = None


class AdminPublish(BaseModel):
    """Serve a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    version: int | None = Field(None, ge=1)


class AdminRollback(BaseModel):
    """Serve a retained earlier version again (`/admin/rollback`)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
