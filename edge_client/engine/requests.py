"""A request's life in the engine: its state, the events it emits, the errors that refuse it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from collm.common.slo import SLO
from collm.edge_client.engine.telemetry import RequestRecord
from collm.edge_client.model.lora import AdapterWeights
from collm.edge_client.model.sampling import SamplingParams, TextStream


class EngineError(Exception):
    """A request the engine cannot take; the message says why and what the limit is."""


class QueueFull(EngineError):
    pass


class PromptTooLong(EngineError):
    pass


class ShuttingDown(EngineError):
    pass


class EngineFailed(EngineError):
    """The engine loop died (a bug, not a request's fault): the process should be restarted."""


@dataclass
class AdmittedEvent:
    """The request got a slot; it is pinned to this adapter version for its whole life."""

    adapter_version: int


@dataclass
class TokenEvent:
    text: str
    token_id: int
    index: int


@dataclass
class FinishEvent:
    reason: str  # stop | length | cancelled | error | expired (waited past its TTFT target, never admitted)
    record: RequestRecord
    text: str  # the whole generated text
    token_ids: list[int]


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    slo: SLO
    on_event: Callable[[object], None]
    arrival: float = field(default_factory=time.perf_counter)
    slot: int | None = None
    adapter: AdapterWeights | None = None
    prefilled: int = 0
    out_ids: list[int] = field(default_factory=list)
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    first_token_at: float | None = None
    cancelled: bool = False
    finished: bool = False

    @property
    def adapter_version(self) -> int | None:
        return None if self.adapter is None else self.adapter.version

    @property
    def prefill_left(self) -> int:
        return len(self.prompt_ids) - self.prefilled

    @property
    def decoding(self) -> bool:
        """Its whole prompt is in: each step now adds one token."""
        return self.prefilled == len(self.prompt_ids)
