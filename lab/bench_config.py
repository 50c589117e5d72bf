"""Configuration of `collm-bench` (configs/bench.yaml, configs/bench-quick.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from collm.common.config import Strict

MODES = ("collm", "isolated", "colocated-naive", "serve-only")


class TraceConfig(Strict):
    """Which trace to replay and how it is scaled to this hardware (the report states these knobs)."""

    path: str | None = Field(None, description="Azure-format CSV; default: the shipped conv trace")
    start_s: float = Field(0.0, ge=0, description="skip this much of the trace")
    speed: float = Field(1.0, gt=0, description="divide inter-arrival times by this (2 = twice the rate)")
    token_scale: float = Field(0.05, gt=0, description="multiply the trace's token counts by this")
    max_prompt_tokens: int = Field(256, ge=8)
    max_output_tokens: int = Field(32, ge=1)
    min_output_tokens: int = Field(4, ge=1)


class SweepConfig(Strict):
    """The rate sweep: the main window's rate times each factor, `seconds` each, same processes."""

    factors: list[float] = Field(default_factory=lambda: [0.5, 1.0, 2.0, 3.0], min_length=1)
    seconds: float = Field(30.0, gt=0)
    target_attainment: float = Field(0.9, gt=0, le=1)


class FederationBudget(Strict):
    rounds: int = Field(100, ge=1, description="upper bound; rounds run back to back during the replay")
    round_deadline_s: float = Field(20.0, gt=0)
    round_token_budget: int = Field(8000, ge=1)
    lr: float = Field(5e-4, gt=0)
    eval_records: int = Field(8, ge=1, description="holdout records each edge evaluates the new global "
                              "adapter on per round (the round waits for it)")


class BenchConfig(Strict):
    """One benchmark: the same replicas, trace and SLOs for every mode, run one after another."""

    model: Literal["tiny", "bundled"] = "tiny"
    replicas: int = Field(2, ge=2, description="edge processes in every mode (isolated: half serve, half train); "
                                               "each is pinned to its own share of the cores")
    modes: list[Literal["collm", "isolated", "colocated-naive", "serve-only"]] = Field(
        default_factory=lambda: list(MODES), min_length=1)
    window_s: float = Field(120.0, gt=0, description="replay window per mode (goodput, quality over time)")
    warmup_s: float = Field(5.0, ge=0, description="run the topology this long before the window starts")
    ttft_ms: float = Field(1000.0, gt=0)
    tpot_ms: float = Field(100.0, gt=0)
    trace: TraceConfig = TraceConfig()
    sweep: SweepConfig = SweepConfig()
    federation: FederationBudget = FederationBudget()
    eval_records: int = Field(16, ge=1, description="holdout records per served-quality evaluation")
    out: str = "runs/bench"

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        if "isolated" in self.modes and self.replicas % 2:
            raise ValueError("replicas must be even when 'isolated' is a mode (half serve, half train)")
        return self
