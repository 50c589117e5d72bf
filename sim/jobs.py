"""A simulated background job (training or evaluation): micro-batches of resumable units, a token
budget and a deadline, with the same deadline, grace and carry rules as `training.jobs.BackgroundJob`
and `training.trainer.TrainJob`, on a profile's measured micro-batch."""

from __future__ import annotations

import math

from collm.sim.profile import EdgeProfile


class SimJob:
    """A background job: micro-batches of `units` resumable units each, until `budget_tokens` input
    tokens are done, or past `deadline` (+ grace for the one in flight)."""

    __slots__ = ("kind", "profile", "mb_s", "units", "mb_tokens", "budget_tokens", "deadline_s", "deadline",
                 "grace_s", "unit_in_mb", "tokens", "on_done", "carry_after", "carry_rounds", "started", "ended")

    def __init__(self, kind: str, profile: EdgeProfile, budget_tokens: int, deadline_s: float = math.inf,
                 finish_grace: float = 0.0, on_done=None, carry_after: bool = False, carry_rounds: float = 1.0):
        """`on_done(job, deadline_hit)`: called when the job ends; `carry_after`: a round's job that leaves
        a carry of `carry_rounds` times its budget (`training.carry_budget_rounds`)."""
        self.kind, self.profile = kind, profile
        if kind == "train":
            self.mb_s, self.units, self.mb_tokens = profile.train_s, profile.train_units, profile.train_tokens
        else:
            self.mb_s, self.units, self.mb_tokens = profile.eval_s, profile.eval_units, profile.eval_tokens
        self.budget_tokens, self.deadline_s = budget_tokens, deadline_s
        self.deadline = math.inf  # set when the engine starts the job: the deadline counts from then
        self.grace_s = finish_grace * deadline_s if math.isfinite(deadline_s) else 0.0
        self.unit_in_mb = 0  # units of the current micro-batch already run
        self.tokens = 0
        self.on_done, self.carry_after, self.carry_rounds = on_done, carry_after, carry_rounds
        self.started = self.ended = False

    def start(self, now: float) -> None:
        if not self.started:
            self.started = True
            self.deadline = now + self.deadline_s

    def past_deadline(self, now: float) -> bool:
        """`BackgroundJob.past_deadline`: at the deadline no micro-batch starts; one in flight may finish
        within the grace."""
        if now < self.deadline:
            return False
        return self.unit_in_mb == 0 or now >= self.deadline + self.grace_s - 1e-9

    def absorb(self, carry: SimJob) -> None:
        """A round's job takes over the carry's completed micro-batches (`TrainJob` drops a half-done one)."""
        self.tokens += carry.tokens

    def make_carry(self) -> SimJob:
        return SimJob("train", self.profile, max(1, round(self.budget_tokens * self.carry_rounds)))

    def finish(self, deadline_hit: bool = False, now: float | None = None) -> None:
        if not self.ended:
            self.ended = True
            if self.on_done is not None:
                self.on_done(self, deadline_hit)

    @property
    def unit_s(self) -> float:
        return self.mb_s / self.units

    def done(self) -> bool:
        return self.tokens >= self.budget_tokens

    def units_to_budget(self) -> int:
        mbs = math.ceil((self.budget_tokens - self.tokens) / self.mb_tokens)
        return max(0, mbs * self.units - self.unit_in_mb)

    def units_to_end(self, t0: float, u: float | None = None) -> int:
        """Units (of `u` seconds; default `unit_s`) to run from t0 until the job ends: its budget, or the
        deadline rule (`past_deadline`: no micro-batch starts after the deadline; the one in flight may
        finish within the grace)."""
        n = self.units_to_budget()
        if math.isinf(self.deadline):
            return n
        u = u or self.unit_s
        n_d = max(0, math.ceil((self.deadline - t0) / u - 1e-9))  # units that start before the deadline
        if n <= n_d:
            return n
        left_in_mb = (self.units - (self.unit_in_mb + n_d) % self.units) % self.units
        if t0 + (n_d + left_in_mb) * u <= self.deadline + self.grace_s:
            return n_d + left_in_mb
        return max(n_d, math.ceil((self.deadline + self.grace_s - t0) / u - 1e-9))

    def advance(self, units: int) -> int:
        """Run `units` units; returns the tokens of micro-batches completed."""
        total = self.unit_in_mb + units
        mbs, self.unit_in_mb = divmod(total, self.units)
        done = mbs * self.mb_tokens
        self.tokens += done
        return done
