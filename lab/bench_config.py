"""Configuration of `collm-bench` (configs/bench.yaml, configs/bench-load.yaml, configs/bench-quick.yaml)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from collm.common.config import Strict
from collm.common.errors import UserError
from collm.common.traces import TraceRequest, TraceScaling, bursts, load_trace, trace_segment

MODES = ("collm", "isolated", "colocated-naive", "serve-only")
"""The modes a bench runs unless its config names others; `collm-<variant>` runs a variant of collm beside it."""
Mode = Literal["collm", "isolated", "colocated-naive", "serve-only"]  # collm-sim's modes (no variants there)


class Variant(Strict):
    """A variant of collm for a same-run A/B (mode `collm-<name>`): collm with these configs merged in."""

    router: dict = Field(default_factory=dict, description="merged into its router's config, e.g. "
                         "{routing: {admission: false}}")
    server: dict = Field(default_factory=dict, description="merged into its ServerApp's config last, e.g. "
                         "{reply_poll_s: 3}")
    edge: dict = Field(default_factory=dict, description="merged into its edges' configs last (over what the bench "
                       "sets, e.g. training.max_eval_records from federation.eval_records), e.g. "
                       "{training: {feedback: {f_max: 0.5}}}")


class BurstConfig(Strict):
    """On/off bursts over the trace's arrivals (`common.traces.bursts`), mean rate kept."""

    period_s: float = Field(30.0, gt=0, description="one on phase and one off phase (seconds)")
    peak: float = Field(2.5, ge=1, description="arrivals come this many times as fast in the on phase")
    duty: float = Field(0.3, gt=0, lt=1, description="the on phase's share of each period")

    @model_validator(mode="after")
    def _check(self) -> BurstConfig:
        if self.peak * self.duty >= 1:
            raise ValueError(f"trace.burst.peak x trace.burst.duty must be below 1 (got {self.peak * self.duty:g}): "
                             "the off phase would need a negative rate to keep the mean")
        return self


class TraceConfig(Strict):
    """Which trace to replay and how its requests are sized for this hardware (the report states these)."""

    path: str | None = Field(None, description="Azure-format CSV; default: the shipped conv trace")
    start_s: float = Field(0.0, ge=0, description="skip this much of the trace")
    token_scale: float = Field(0.05, gt=0, description="multiply the trace's token counts by this")
    max_prompt_tokens: int = Field(256, ge=8)
    max_output_tokens: int = Field(32, ge=1)
    min_output_tokens: int = Field(4, ge=1)
    burst: BurstConfig | None = Field(None, description="lay on/off bursts over the trace (a burstier workload, "
                                      "same mean rate); none: the trace's own arrivals")

    @model_validator(mode="after")
    def _check(self) -> TraceConfig:
        if self.min_output_tokens > self.max_output_tokens:
            raise ValueError("trace.min_output_tokens must not exceed trace.max_output_tokens")
        return self

    def segment(self, requests: list[TraceRequest], rate: float, seconds: float,
                min_requests: int) -> list[TraceRequest]:
        """A load point's or probe's arrivals (`common.traces.trace_segment`), with the bursts if set: every
        probe and point of collm-bench and collm-sim comes from here."""
        seg = trace_segment(requests, rate, seconds, min_requests)
        b = self.burst
        return seg if b is None else bursts(seg, b.period_s, b.peak, b.duty)

    def load(self) -> list[TraceRequest]:
        """The trace's requests as these knobs scale them (collm-bench's workload, collm-sim's); a
        one-line error if fewer than 2 are left."""
        reqs = load_trace(self.path, TraceScaling(
            token_scale=self.token_scale, max_prompt_tokens=self.max_prompt_tokens,
            max_output_tokens=self.max_output_tokens, min_output_tokens=self.min_output_tokens, start_s=self.start_s))
        if len(reqs) < 2:
            raise UserError(f"trace {self.path or '(shipped)'} from {self.start_s:g} s holds {len(reqs)} "
                            "request(s); a benchmark needs at least 2: lower trace.start_s")
        return reqs


class CapacityConfig(Strict):
    """Serve-only's capacity: its highest request rate at >= `target_attainment`, measured first in the
    same run; every load point is a fraction of it."""

    rate: float | None = Field(None, gt=0, description="use this capacity (req/s) instead of measuring it")
    start_rate: float = Field(1.0, gt=0, description="first probe rate (req/s)")
    growth: float = Field(1.5, gt=1, description="each probe multiplies the rate by this until attainment drops")
    refine: int = Field(2, ge=0, description="bisection probes between the last rate that passed and the first "
                                             "that failed")
    probe_s: float | None = Field(None, gt=0, description="seconds of arrivals per probe; default: load.seconds, so "
                                  "a probe at rate r replays exactly the arrivals a load point at r replays (the "
                                  "trace's later requests are burstier: shorter probes found capacities the points "
                                  "then missed)")
    min_requests: int | None = Field(None, ge=1, description="at least this many requests per probe; default: "
                                     "load.min_requests")
    max_probes: int = Field(8, ge=1)
    confirm: bool = Field(True, description="replay a probe that failed once more at the same rate and judge the "
                                            "rate on both (one slow minute on a shared machine should not set the "
                                            "capacity, and with it every load point, too low)")
    target_attainment: float = Field(0.9, gt=0, le=1)


LoadFraction = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a point's rate over capacity: 0 has no arrivals


class LoadConfig(Strict):
    """The load points every mode replays: the same arrivals at each point for every mode."""

    fractions: list[LoadFraction] = Field(default_factory=lambda: [0.2, 0.5, 0.8, 1.0, 1.2], min_length=1,
                                          description="offered load as fractions of serve-only's capacity")
    seconds: float = Field(120.0, gt=0, description="seconds of arrivals per point ...")
    min_requests: int = Field(40, ge=1, description="... or more, until the point has this many requests")
    drain_s: float = Field(5.0, ge=0, description="pause between points (queues empty, training resumes)")


class FederationBudget(Strict):
    rounds: int = Field(100, ge=1, description="upper bound; rounds run back to back while the points replay")
    round_deadline_s: float = Field(20.0, gt=0)
    round_token_budget: int = Field(8000, ge=1)
    lr: float = Field(2e-3, gt=0, description="the edges' local learning rate in round 1 (every deployment's)")
    lr_decay: float = Field(0.8, gt=0, le=1, description="the rate's factor per round that changed the global "
                            "(the server's balancer.lr_decay)")
    lr_min: float = Field(5e-4, ge=0, description="the decay's floor (the server's balancer.lr_min)")
    eval_records: int = Field(8, ge=1, description="holdout records each edge evaluates the new global "
                              "adapter on per round (the round waits for it)")

    @model_validator(mode="after")
    def _floor_below_rate(self) -> FederationBudget:
        if self.lr_min > self.lr:  # the server would refuse it only once the bench has started its first mode
            raise ValueError(f"lr_min ({self.lr_min:g}) is above lr ({self.lr:g}): set federation.lr_min to at "
                             "most federation.lr")
        return self


class BenchConfig(Strict):
    """One benchmark: the same replicas, trace and SLOs for every mode, run one after another."""

    model: Literal["tiny", "bundled"] = "tiny"
    replicas: int = Field(2, ge=2, description="edge processes in every mode (isolated: half serve, half train); "
                                               "each is pinned to its own share of the cores")
    modes: list[str] = Field(
        default_factory=lambda: list(MODES), min_length=1,
        description="modes to compare (collm, isolated, colocated-naive, serve-only, and collm-<variant> for each "
                    "variant named); serve-only always runs first (it measures the capacity and is every ratio's "
                    "baseline) and is always reported")
    variants: dict[str, Variant] = Field(default_factory=dict, description="collm variants for a same-run A/B, by "
                                         "name: mode collm-<name> is collm with the variant's router and edge "
                                         "configs merged in")
    warmup_s: float = Field(5.0, ge=0, description="run each topology this long before its first point")
    ttft_ms: float = Field(1000.0, gt=0, allow_inf_nan=False)
    tpot_ms: float = Field(100.0, gt=0, allow_inf_nan=False)
    co_schedule: Literal["slo_feedback", "work_conserving"] = Field(
        "slo_feedback", description="collm edges' training.co_schedule: slo_feedback (the controller; its settings "
        "under edge: {training: {feedback: ...}}) or work_conserving (idle time plus busy_share)")
    busy_share: float = Field(0.0, ge=0, le=1, description="collm edges' training.busy_share (work_conserving)")
    collm_routing: Literal["slo", "slo_pack", "round_robin", "least_outstanding"] = Field(
        "slo_pack", description="collm's router policy (the other modes route round robin: one serving replica, or "
                           "replicas that all look alike)")
    edge: dict = Field(default_factory=dict, description="merged into every edge's config (and the quality "
                       "judge's model), e.g. {model: {tiny: {hidden_size: 256}}} or {engine: {max_running: 8}}")
    trace: TraceConfig = TraceConfig()
    capacity: CapacityConfig = CapacityConfig()
    load: LoadConfig = LoadConfig()
    federation: FederationBudget = FederationBudget()
    eval_records: int = Field(16, ge=1, description="holdout records per served-quality evaluation")
    bootstrap: int = Field(2000, ge=100, description="bootstrap resamples for every confidence interval")
    order: Literal["sequential", "counterbalanced"] = Field(
        "sequential", description="sequential: each mode once, serve-only first; counterbalanced: every mode twice, "
        "A B C D then D C B A (serve-only first and last), pooled, each ratio's interval widened to cover both "
        "passes' own ratios: a drift in the machine's speed over the run weighs on every mode alike")
    drift_check: bool = Field(False, description="run serve-only again after the other modes, on the same "
                              "arrivals: modes are measured one after another, so this shows how far the machine "
                              "drifted during the run (a ratio between modes is good only to within it); "
                              "counterbalanced runs always have it (serve-only's second pass)")
    timeline: bool = Field(False, description="every replica writes its engine timeline (engine.timeline) to "
                           "OUT/<mode>/timeline-<edge>.jsonl: each serving step and training unit with its time, to "
                           "see what a replica did while a request was slow (benchmarks/timeline_report.py)")
    out: str = "runs/bench"

    @model_validator(mode="after")
    def _check(self) -> BenchConfig:
        for m in self.modes:
            if m not in MODES and not (m.startswith("collm-") and m[len("collm-"):] in self.variants):
                named = ", ".join(f"collm-{v}" for v in self.variants) or "none"
                raise ValueError(f"modes: {m!r} is not a mode; use {', '.join(MODES)} or collm-<variant> for a "
                                 f"variant under `variants:` (named: {named})")
        for name, v in self.variants.items():  # a variant's rate against the floor, before any mode has run
            b = v.server.get("balancer") if isinstance(v.server.get("balancer"), dict) else {}
            lr, lr_min = b.get("lr", self.federation.lr), b.get("lr_min", self.federation.lr_min)
            if isinstance(lr, (int, float)) and isinstance(lr_min, (int, float)) and lr_min > lr:
                raise ValueError(f"variants.{name}.server.balancer: lr {lr:g} is below the floor lr_min {lr_min:g}; "
                                 f"set variants.{name}.server.balancer.lr_min too (or federation.lr_min) to at most it")
        check_modes(self.co_schedule, self.busy_share, self.modes, self.replicas, "replicas")
        return self


def check_modes(co_schedule: str, busy_share: float, modes: list[str], replicas: int, field: str) -> None:
    """What collm-bench and collm-sim configs both check: busy_share belongs to the work-conserving
    rule (the controller sets the share itself), and isolated serves on half and trains on half."""
    if busy_share > 0 and co_schedule != "work_conserving":
        raise ValueError(f"busy_share ({busy_share:g}) is a setting of co_schedule: work_conserving (collm's "
                         f"co_schedule is {co_schedule}, which sets the share itself)")
    if "isolated" in modes and replicas % 2:
        raise ValueError(f"{field} must be even when 'isolated' is a mode (half serve, half train)")


def is_collm(mode: str) -> bool:
    """collm, or a variant of it run beside it for an A/B (`collm-<variant>`)."""
    return mode.startswith("collm")


def variant_of(mode: str, variants: dict[str, Variant]) -> Variant:
    """The variant a mode runs (collm and the baselines: none, an empty one)."""
    return variants.get(mode[len("collm-"):], Variant()) if mode.startswith("collm-") else Variant()


def router_policy(mode: str, collm_routing: str) -> str:
    """The router's policy in a mode: collm's (and its variants', unless they set one) is the config's; the
    others route round robin (one serving replica, or replicas that all look alike)."""
    return collm_routing if is_collm(mode) else "round_robin"


def edge_policy(mode: str, collm_policy: str) -> str:
    """The co-execution policy (`training.co_schedule`) of a mode's edges: collm's is the config's choice,
    colocated-naive's the naive baseline; the others never train beside serving (the rule only sees idle time)."""
    if mode == "colocated-naive":
        return "naive"
    return collm_policy if is_collm(mode) else "work_conserving"


def mode_roles(mode: str, n: int) -> list[str]:
    """What each replica does in `mode`: serve+train, serve, or train."""
    if mode == "isolated":
        return ["serve"] * (n // 2) + ["train"] * (n // 2)
    if mode == "serve-only":
        return ["serve"] * n
    return ["serve+train"] * n
