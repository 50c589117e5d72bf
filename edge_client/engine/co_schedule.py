"""When may background work (training, evaluation) run on a replica that serves? The co-execution rule.

Background work comes in units: one decoder layer of one micro-batch, forward or backward, or one
chunk of its loss (`training.layerwise`). Units resume where the last one stopped and are never
thrown away, and each takes tens of milliseconds where a whole micro-batch takes seconds. After
each serving step the engine asks the rule whether the next unit (predicted to take tau seconds)
may run now, and asks again after each unit it admits beside decodes, so the gap before the next
step holds as many units as the rule allows (in idle time it asks once per loop, between arrivals):

1. **Idle** (no request running or waiting): yes. An arriving request waits for at most the unit
   in flight; an idle replica trains back to back.
2. **Serving work that is not a decode** (a request waits for a slot, or a prompt is still being
   prefilled): no. Serving is work-conserving: training never takes time that a waiting or
   running request needs. A request's TTFT is what bursts break, and a queue is where it is lost.
3. **Only decodes running**: the unit runs only if all three hold
       tau <= bucket                         busy-period budget: `bucket` accrues
                                             f seconds per second (the policy's fill rate), up to
                                             `bucket_max_s`
       tau <= gamma * s * P_min - t_step - e per-step cap: every running request's next token still
                                             comes within gamma * s of its TPOT target P (e: the
                                             time since the last serving step ended)
       tau <= allowance(...)                 the slack guard below: no request's TTFT or TPOT so far
                                             goes past s times its target
   The policies below differ only in how fast the bucket fills.

The slack guard, `allowance`: the minimum over every decoding request i (first token at f_i, g_i
tokens so far, TPOT target P_i) of  s * P_i * g_i - (now - f_i) - t_step, and over every request
j still before its first token (arrived a_j, TTFT target T_j) of
s * T_j - (now - a_j) - ceil(prefill queued up to j / B) * t_step. `s` is slo.safety, B the step
token budget, `t_step` the cost model's next step.

Where the bucket's fill rate comes from is the policy's choice, with one floor for evaluation: a round's
evaluation of the new global gates the round on every edge and the swap of the served version (the canary
judges on it), and it is small (a few seconds of forward units), so while an evaluation job is current the
bucket fills at least at `training.eval_share` even where training gets nothing. Its units still pass the
per-step cap and the slack guard; only the rate is floored, and the share the rule reports stays training's.
With a floor set, the bucket empties when the job kind switches: training never spends what the floor
filled. With eval_share 0 nothing of this applies; the edge's default is 0.25 (its A/B: docs/benchmarks.md).

* `slo_feedback` (CoLLM's default): a feedback controller over *measured* latencies
  (`controller.SlackController`) sets f, the training seconds per wall-clock second the bucket
  accrues: up while the TTFT/TPOT percentiles have slack against their targets, down before they
  would be missed, 0 when serving is near saturation or there is no evidence. The per-step cap's
  gamma is 1 here: no single token may come later than s * P; the controller decides how much of
  the slack below that training takes on average.
* `work_conserving` (a fixed share): f = max(0, u - rho - margin), u = `training.busy_share`;
  with u = 0 training runs only in idle time.

The baseline `naive` (colocated-naive in collm-bench) ignores all of this: after every serving
step it runs one whole micro-batch (every unit of it), as a deployment without SLO control would.
Policies are chosen by `training.co_schedule` (`POLICIES`); each is a small object over plain data.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from collm.edge_client.config import FeedbackConfig
from collm.edge_client.engine.controller import RequestOutcome, SlackController


@dataclass(frozen=True)
class RequestSlack:
    """What the slack guard needs to know about one admitted or waiting request (times in seconds)."""

    arrival: float
    first_token_at: float | None
    tokens_out: int
    ttft_slo: float
    tpot_slo: float
    prefill_left: int  # prompt tokens not yet run through the model


@dataclass(frozen=True)
class Allowance:
    seconds: float
    binding: str  # which constraint set it (for telemetry and logs)


def allowance(now: float, requests: list[RequestSlack], *, step_s: float, step_token_budget: int,
              safety: float) -> Allowance:
    """How long background work may hold the replica before some request's SLO slips (see the docstring)."""
    best = Allowance(math.inf, "idle")
    ahead = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        if r.first_token_at is not None:
            a = safety * r.tpot_slo * max(r.tokens_out, 1) - (now - r.first_token_at) - step_s
            why = "tpot"
        else:
            ahead += r.prefill_left
            steps = max(1, math.ceil(ahead / step_token_budget))
            a = safety * r.ttft_slo - (now - r.arrival) - steps * step_s
            why = "ttft"
        if a < best.seconds:
            best = Allowance(a, why)
    return best


@dataclass(frozen=True)
class ServingLoad:
    """The replica's serving state when the rule is asked (plain data; the engine fills it in)."""

    now: float
    running: int  # admitted requests
    waiting: int  # requests not yet admitted
    prefill_left: int  # prompt tokens of admitted requests not yet run
    step_s: float  # predicted time of the next serving step
    requests: tuple[RequestSlack, ...] = ()
    step_token_budget: int = 256
    safety: float = 0.8
    since_step: float = 0.0  # seconds since the last serving step ended (units already run in this gap)

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


@dataclass(frozen=True)
class Verdict:
    run: bool
    reason: str  # idle | serving-first | bucket | per-step-cap | slack | busy-share-off | naive


class BusyWindow:
    """rho: the fraction of the last `window_s` seconds spent in serving steps."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._steps: deque[tuple[float, float]] = deque()  # (end time, seconds)
        self._sum = 0.0

    def record(self, end: float, seconds: float) -> None:
        self._steps.append((end, seconds))
        self._sum += seconds

    def rho(self, now: float) -> float:
        start = now - self.window_s
        while self._steps and self._steps[0][0] <= start:
            self._sum -= self._steps.popleft()[1]
        if not self._steps:
            self._sum = 0.0
            return 0.0
        first_end, first_s = self._steps[0]
        clipped = max(0.0, first_end - start)  # the part of the oldest step inside the window
        return min(1.0, (self._sum - first_s + min(first_s, clipped)) / self.window_s)


class CoSchedule:
    """Interface of a co-execution policy; the engine calls it once per loop iteration."""

    name = "base"
    whole_passes = False  # True: once a micro-batch starts, run all of its units at once

    def observe_step(self, end: float, seconds: float) -> None:
        """A serving step of `seconds` ended at `end` (perf_counter time)."""

    def observe_request(self, end: float, outcome: RequestOutcome) -> None:
        """A request ended at `end` (completed, or shed as late)."""

    def verdict(self, load: ServingLoad, unit_s: float, kind: str = "train") -> Verdict:
        """May a unit of a `kind` job (train | eval) predicted to take `unit_s` run now?"""
        raise NotImplementedError

    def spent(self, seconds: float) -> None:
        """A unit the verdict admitted took `seconds`."""

    @property
    def share(self) -> float:
        """The training seconds per second the rule grants beside serving now (telemetry, load report)."""
        return 0.0


class WorkConserving(CoSchedule):
    """CoLLM's rule (the module docstring): idle time always, busy time only within the bucket and caps.
    The bucket fills at max(0, busy_share - rho - margin): a fixed, hand-set share."""

    name = "work_conserving"

    def __init__(self, busy_share: float = 0.0, margin: float = 0.1, gamma: float = 0.5, window_s: float = 10.0,
                 bucket_max_s: float = 1.0, eval_share: float = 0.0):
        self.busy_share, self.margin, self.gamma = busy_share, margin, gamma
        self.eval_share = eval_share
        self._kind = "train"  # the job kind the bucket last filled for
        self.window = BusyWindow(window_s)
        self.bucket_max_s = bucket_max_s
        self.bucket = 0.0
        self._accrued_at: float | None = None
        self._rate = 0.0

    def observe_step(self, end: float, seconds: float) -> None:
        self.window.record(end, seconds)

    def fill_rate(self, load: ServingLoad) -> float:
        """Seconds of busy-time training the bucket gains per second now."""
        rho = 1.0 if load.waiting else self.window.rho(load.now)
        return max(0.0, self.busy_share - rho - self.margin)

    def busy_time_off(self) -> bool:
        return self.busy_share <= 0

    @property
    def share(self) -> float:
        """The fill rate at the last verdict: what the rule granted beside serving then."""
        return self._rate

    def _accrue(self, load: ServingLoad, kind: str = "train") -> None:
        rate = self._rate = self.fill_rate(load)
        if self.eval_share > 0:  # the evaluation's floor (module docstring)
            if kind == "eval" and not (load.waiting or load.prefill_left):
                rate = max(rate, self.eval_share)
            if kind != self._kind:  # what the floor filled is not training's to spend, nor the reverse
                self.bucket, self._kind, self._accrued_at = 0.0, kind, load.now
        if self._accrued_at is not None:
            dt = max(0.0, load.now - self._accrued_at)
            self.bucket = min(self.bucket_max_s, self.bucket + dt * rate)
        self._accrued_at = load.now

    def verdict(self, load: ServingLoad, unit_s: float, kind: str = "train") -> Verdict:
        if load.idle:  # idle time trains without the bucket; it neither fills it nor moves the share
            self._accrued_at = load.now
            return Verdict(True, "idle")
        self._accrue(load, kind)
        if load.waiting or load.prefill_left:
            return Verdict(False, "serving-first")
        return self._busy_verdict(load, unit_s, kind)

    def _busy_verdict(self, load: ServingLoad, unit_s: float, kind: str = "train") -> Verdict:
        """Only decodes run: rule 3."""
        if self.busy_time_off() and not (kind == "eval" and self.eval_share > 0):
            return Verdict(False, "busy-share-off")
        if unit_s > self.bucket:
            return Verdict(False, "bucket")
        p_min = min((r.tpot_slo for r in load.requests), default=math.inf)
        if unit_s > self.gamma * load.safety * p_min - load.step_s - load.since_step:
            return Verdict(False, "per-step-cap")
        guard = allowance(load.now, list(load.requests), step_s=load.step_s,
                          step_token_budget=load.step_token_budget, safety=load.safety)
        if unit_s > guard.seconds:
            return Verdict(False, "slack")
        return Verdict(True, "busy-share")

    def spent(self, seconds: float) -> None:
        if self._accrued_at is not None:
            self.bucket = max(0.0, self.bucket - seconds)


class SlackFeedback(WorkConserving):
    """CoLLM's default: the bucket fills at f, set by `SlackController` from measured latencies."""

    name = "slo_feedback"

    def __init__(self, params: FeedbackConfig | None = None, gamma: float = 1.0, bucket_max_s: float = 1.0,
                 window_s: float = 10.0, eval_share: float = 0.0):
        super().__init__(busy_share=0.0, margin=0.0, gamma=gamma, window_s=window_s, bucket_max_s=bucket_max_s,
                         eval_share=eval_share)
        self.controller = SlackController(params)

    def observe_request(self, end: float, outcome: RequestOutcome) -> None:
        self.controller.observe(end, outcome)

    def fill_rate(self, load: ServingLoad) -> float:
        if self.controller.update(load, self.window.rho(load.now)):
            self.bucket = 0.0
        if load.waiting or load.prefill_left:
            return 0.0  # as the fixed share (rho = 1 while anything waits): a queue earns training no time
        return self.controller.f

    def busy_time_off(self) -> bool:
        return False

    @property
    def share(self) -> float:
        return self.controller.f

    def _busy_verdict(self, load: ServingLoad, unit_s: float, kind: str = "train") -> Verdict:
        v = super()._busy_verdict(load, unit_s, kind)
        if not v.run and kind == "train":  # what the controller learns is about training's share
            self.controller.note_refusal(v.reason)
        return v


class Naive(CoSchedule):
    """The colocated-naive baseline: one whole micro-batch after every step, no SLO control."""

    name = "naive"
    whole_passes = True

    def verdict(self, load: ServingLoad, unit_s: float, kind: str = "train") -> Verdict:
        return Verdict(True, "naive")


POLICIES: dict[str, type[CoSchedule]] = {p.name: p for p in (SlackFeedback, WorkConserving, Naive)}


def make_policy(training_cfg) -> CoSchedule:
    """The policy `training.co_schedule` names, with the rule's knobs from the same section."""
    kind = POLICIES[training_cfg.co_schedule]
    if kind is Naive:
        return Naive()
    if kind is SlackFeedback:
        return SlackFeedback(training_cfg.feedback, window_s=training_cfg.busy_window_s,
                             eval_share=training_cfg.eval_share)
    return WorkConserving(busy_share=training_cfg.busy_share, margin=training_cfg.busy_margin,
                          window_s=training_cfg.busy_window_s, eval_share=training_cfg.eval_share)
