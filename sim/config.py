"""Configuration of `collm-sim` (configs/sim.yaml, configs/sim-fidelity.yaml).

The knobs mirror collm-bench's (configs/bench.yaml: trace scaling, SLOs, load points, federation
budget, bootstrap), so a simulation and a real run of the same setting read alike; what only a
simulation has (profiles and device mix, fleet sizes, the quality curve, network latency) is here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from collm.common.config import Strict
from collm.edge_client.config import FeedbackConfig
from collm.lab.bench_config import (MODES, CapacityConfig, FederationBudget, LoadConfig, LoadFraction, Mode,
                                    TraceConfig, check_modes)
from collm.router.config import AdmissionFeedback, RoutingConfig, check_margins


class DeviceClass(Strict):
    """A share of the fleet running one profile (`speed` scales it: 4.0 = four times as fast)."""

    profile: str = Field("smollm2-cpu1", description="a shipped profile name or a path to a profile JSON")
    speed: float = Field(1.0, gt=0)
    share: float = Field(1.0, gt=0, description="relative share of the edges (normalised over the mix)")
    precision: Literal["none", "nf4", "int8"] = Field(
        "none", description="the base model's precision (model.quantization): a quantized base's steps and "
        "training take the factors benchmarks/quantized_base.py measured (sim/profile.py PRECISION_COST)")
    lora_r: int = Field(8, ge=1, le=256, description="the LoRA rank the class trains (lora.r); its update is "
                        "lora_r x network.update_mb_per_rank")
    uplink_mbps: float | None = Field(None, gt=0, description="the class's uplink; sending an update then takes "
                                      "its size / uplink before the round can aggregate; unset: no time")

    def upload_s(self, mb_per_rank: float) -> float:
        return 0.0 if self.uplink_mbps is None else self.lora_r * mb_per_rank * 8.0 / self.uplink_mbps


class QualityCurve(Strict):
    """Served holdout loss after T aggregated training tokens: floor + (base - floor) * (1 + T/scale)^-exponent.

    Default: fitted to benchmarks/federation_quality.py's fedavg run (3 SmolLM2 edges, Dolly non-IID,
    4500 tokens a round, 5 rounds; rms error 0.0044)."""

    base: float = 2.2545
    floor: float = 2.0396
    scale_tokens: float = Field(22200.0, gt=0)
    exponent: float = Field(3.0, gt=0)

    def loss(self, tokens: float) -> float:
        return self.floor + (self.base - self.floor) * (1.0 + max(tokens, 0.0) / self.scale_tokens) ** -self.exponent


class NetworkConfig(Strict):
    rtt_s: float = Field(0.004, ge=0, description="client -> router -> edge and back, added to every TTFT")
    exchange_s: float = Field(2.0, ge=0, description="one Flower message exchange (QUERY, TRAIN, EVALUATE): the "
                              "SuperNodes' polling and the transfer")
    reload_s: float = Field(0.5, ge=0, description="isolated: a serving replica loading the new adapter from disk")
    update_mb_per_rank: float = Field(1.19, gt=0, description="megabytes one LoRA rank adds to an update (SmolLM2-135M, "
                                      "7 projections in 30 layers, float32: 4.7 / 9.5 / 19 MB at ranks 4 / 8 / 16, "
                                      "benchmarks/federation_quality.py)")


class InterferenceConfig(Strict):
    """Edges that share one machine slow each other down (memory bandwidth, caches): measured on the
    real bench with `python benchmarks/interference.py RUN_DIR` (its decode steps and training units
    by what the other replica was doing)."""

    per_machine: int = Field(1, ge=1, description="edges on one machine (consecutive edges share it); 1: none")
    slowdown: float = Field(0.0, ge=0, le=2, description="a serving step or background unit takes this much longer "
                            "(a fraction) for each other edge of its machine that is busy when it starts")
    background_slowdown: float | None = Field(
        None, ge=0, le=2, description="a serving step takes this much longer for each other edge of its machine "
        "running background work (training or evaluation) when it starts, in place of `slowdown` (a backward pass "
        "streams more memory than a decode step); unset: `slowdown`")
    federation_slowdown: float = Field(
        0.0, ge=0, le=2, description="a serving step takes this much longer in modes that run a federation (collm, "
        "isolated, colocated-naive: the SuperLink, SuperNode and ServerApp processes on the same cores, the training "
        "state beside the weights) than in serve-only")


_ROUTING = RoutingConfig()  # the router's defaults


class RouterSim(Strict):
    """The router's settings the simulation uses (router/config.py's defaults)."""

    interval_s: float = Field(0.5, gt=0, description="health.interval_s")
    max_polls_per_s: float = Field(100.0, gt=0, description="health.max_polls_per_s (staggered polling)")
    shards: int = Field(1, ge=1, description="routers in front of the fleet, each routing to its own 1/shards of "
                        "the edges; arrivals go to them in turn (a front load balancer)")
    admission: bool = Field(_ROUTING.admission, description="routing.admission")
    admission_margin: float = Field(_ROUTING.admission_margin, ge=1.0, description="routing.admission_margin")
    admission_margin_max: float | None = Field(_ROUTING.admission_margin_max, ge=1.0, allow_inf_nan=False,
                                               description="routing.admission_margin_max")
    admission_feedback: AdmissionFeedback = Field(_ROUTING.admission_feedback,
                                                  description="routing.admission_feedback")
    probe_after_s: float = Field(_ROUTING.probe_after_s, gt=0, description="routing.probe_after_s")
    pack_slack: float = Field(_ROUTING.pack_slack, ge=0, le=1, description="routing.pack_slack (slo_pack)")
    pack_spare: float = Field(_ROUTING.pack_spare, ge=0, le=1, description="routing.pack_spare (slo_pack)")
    pack_newest: bool = Field(_ROUTING.pack_newest, description="routing.pack_newest (slo_pack)")
    pack_free_slot: bool = Field(_ROUTING.pack_free_slot, description="routing.pack_free_slot (slo_pack)")
    pack_gate: float | None = Field(_ROUTING.pack_gate, ge=-1, lt=1, allow_inf_nan=False,
                                    description="routing.pack_gate (slo_pack)")
    drain_rate: Literal["serving", "window"] = Field(_ROUTING.drain_rate, description="routing.drain_rate")

    @model_validator(mode="after")
    def _margins(self) -> RouterSim:
        check_margins(self)
        return self


class SweepConfig(Strict):
    fleet_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [10, 100, 1000], min_length=1,
                                                            description="edges per run of the sweep")
    fractions: list[LoadFraction] = Field(default_factory=lambda: [0.3, 0.8, 1.0], min_length=1)
    seeds: int = Field(1, ge=1, description="runs per fleet size (different arrivals and noise)")
    max_requests: int | None = Field(60000, ge=100, description="at most this many requests per probe and point "
                                     "(a large fleet replays a shorter stretch of arrivals)")
    sizing_rate: float | None = Field(None, gt=0, description="find, per mode, the smallest fleet that meets "
                                      "capacity.target_attainment at this absolute rate (req/s)")


class SimConfig(Strict):
    edges: int = Field(2, ge=1, description="edges of the single run (isolated: half serve, half train)")
    devices: list[DeviceClass] = Field(default_factory=lambda: [DeviceClass()], min_length=1)
    modes: list[Mode] = Field(default_factory=lambda: list(MODES), min_length=1)
    ttft_ms: float = Field(3000.0, gt=0)
    tpot_ms: float = Field(400.0, gt=0)
    slo_safety: float = Field(0.8, gt=0, le=1)
    co_schedule: Literal["slo_feedback", "work_conserving"] = Field(
        "slo_feedback", description="collm edges' training.co_schedule (as in collm-bench)")
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig, description="collm edges' training.feedback")
    busy_share: float = Field(0.0, ge=0, le=1, description="collm edges' training.busy_share (work_conserving)")
    eval_share: float = Field(0.25, ge=0, le=1, description="collm edges' training.eval_share (the evaluation's "
                              "floor beside decodes)")
    collm_routing: Literal["slo", "slo_pack", "round_robin", "least_outstanding"] = "slo_pack"
    eval_records: int = Field(8, ge=1, description="holdout records each training edge evaluates per round")
    train_examples: int = Field(1500, ge=1, description="local training examples per edge (balancer weight)")
    carry_between_rounds: bool = True
    finish_grace: float = Field(0.25, ge=0, le=1)
    trace: TraceConfig = TraceConfig(start_s=120.0, token_scale=0.1, max_prompt_tokens=96, max_output_tokens=16)
    capacity: CapacityConfig = CapacityConfig(start_rate=0.4, refine=3, probe_s=120.0, min_requests=200,
                                              confirm=False)  # the simulator's machine does not drift between probes
    load: LoadConfig = LoadConfig(fractions=[0.3, 0.8, 1.0, 1.2], seconds=120.0, min_requests=300)
    federation: FederationBudget = FederationBudget(round_deadline_s=30.0, round_token_budget=6000, rounds=1000)
    quality: QualityCurve = QualityCurve()
    network: NetworkConfig = NetworkConfig()
    interference: InterferenceConfig = InterferenceConfig()
    router: RouterSim = RouterSim()
    sweep: SweepConfig | None = Field(None, description="also run every fleet size of the sweep")
    warmup_s: float = Field(30.0, ge=0, description="simulated seconds before the first point (rounds start)")
    bootstrap: int = Field(2000, ge=100)
    seed: int = Field(0, ge=0)
    out: str = "runs/sim"

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        check_modes(self.co_schedule, self.busy_share, self.modes, self.edges, "edges")
        for n in self.sweep.fleet_sizes if self.sweep else []:
            check_modes(self.co_schedule, self.busy_share, self.modes, n, f"sweep.fleet_sizes ({n})")
        return self
