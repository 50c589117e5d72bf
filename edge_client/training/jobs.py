"""Background work the engine runs between serving steps, one unit at a time (see `layerwise`).

A job is a queue of units: `next_unit()` says what comes next (so the co-execution rule can
predict its cost), `run_unit()` runs it. Units are never discarded, so a job that yields to
serving loses nothing; `finish()` resolves the job's future with its report.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from collm.edge_client.training.layerwise import LayerwisePass, Unit


@dataclass
class TrainBudget:
    steps: int | None = None  # optimizer steps
    tokens: int | None = None  # input tokens processed
    deadline_s: float | None = None  # seconds from the job's start

    def __post_init__(self):
        if self.steps is None and self.tokens is None:
            raise ValueError("a training budget needs steps or tokens")


@dataclass
class JobReport:
    kind: str
    microbatches: int = 0
    sequences: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    steps: int = 0
    loss: float | None = None  # mean per-token loss over the job
    first_loss: float | None = None
    last_loss: float | None = None
    accuracy: float | None = None
    seconds: float = 0.0
    compute_seconds: float = 0.0  # time spent running the job's units
    units: int = 0
    deferrals: int = 0  # times the engine held a unit back because serving needed the replica
    deadline_hit: bool = False
    extra: dict = field(default_factory=dict)
    adapter_state: dict | None = field(default=None, repr=False)  # a train job's adapter at its end (the update)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "adapter_state"}

    def add_microbatch(self, sequences: int, tokens: int, answer_tokens: int, loss_sum: float) -> None:
        """Count one finished micro-batch (training and evaluation alike); `loss_sum`: the job's summed
        per-token loss so far, this micro-batch's included."""
        self.microbatches += 1
        self.sequences += sequences
        self.tokens += tokens
        self.answer_tokens += answer_tokens
        self.loss = loss_sum / max(self.answer_tokens, 1)


class BackgroundJob:
    """Work the engine runs when serving leaves room, one unit per `run_unit()` call. The replica core
    (`engine.replica`) starts, ends and carries jobs through the methods below."""

    kind = "job"
    carry_after = False  # a round's training job sets it: the core starts `make_carry()` when it ends

    def __init__(self, deadline_s: float | None, finish_grace: float = 0.0):
        self.future: Future = Future()
        self.report = JobReport(self.kind)
        self.started_at: float | None = None
        self.deadline_s = deadline_s
        self.finish_grace = finish_grace  # fraction of the deadline a micro-batch in flight may run past it
        self.pass_s = 0.0  # compute seconds of the micro-batch in flight so far (its cost, once complete)

    @property
    def started(self) -> bool:
        return self.started_at is not None

    def start(self, now: float | None = None) -> None:
        """`now`: the engine's clock (perf_counter); the deadline counts from it."""
        self.started_at = time.perf_counter() if now is None else now

    def absorb(self, carry: BackgroundJob) -> None:
        """Take over a carry's work (training jobs)."""
        raise NotImplementedError

    def make_carry(self) -> BackgroundJob:
        """The job that carries on after this one (training jobs with `carry_after`)."""
        raise NotImplementedError

    def past_deadline(self, now: float) -> bool:
        """At the deadline no new micro-batch starts; one in flight may still finish within
        `finish_grace * deadline_s` after it (its work would be thrown away otherwise)."""
        if self.deadline_s is None or self.started_at is None:
            return False
        over = now - self.started_at - self.deadline_s
        if over < 0:
            return False
        return self.at_pass_boundary() or over >= self.finish_grace * self.deadline_s

    def next_unit(self) -> Unit:
        """The unit `run_unit()` would run (only called while not `done()`)."""
        raise NotImplementedError

    def run_unit(self) -> int:
        """Run the next unit; returns the input tokens of the micro-batch it completed (0 if none)."""
        raise NotImplementedError

    def at_pass_boundary(self) -> bool:
        """True when no micro-batch is half done (the naive baseline runs whole micro-batches)."""
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def finish(self, deadline_hit: bool = False, now: float | None = None) -> JobReport:
        """Resolve the job's future with its report (`now`: the clock the job was started on)."""
        self.report.deadline_hit = deadline_hit
        if self.started_at is not None:
            self.report.seconds = (time.perf_counter() if now is None else now) - self.started_at
        if not self.future.done():
            self.future.set_result(self.report)
        return self.report

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class PassJob(BackgroundJob):
    """A job made of micro-batch passes (`layerwise.LayerwisePass`), run one unit at a time: a pass is
    built when the first of its units runs (`new_pass`) and counted when its last one has (`completed`)."""

    def __init__(self, deadline_s: float | None, finish_grace: float = 0.0):
        super().__init__(deadline_s, finish_grace)
        self._pass: LayerwisePass | None = None

    def new_pass(self) -> LayerwisePass:
        raise NotImplementedError

    def completed(self, p: LayerwisePass) -> int:
        """Account for a finished pass; returns its input tokens."""
        raise NotImplementedError

    def _current(self) -> LayerwisePass:
        if self._pass is None:
            self._pass = self.new_pass()
        return self._pass

    def next_unit(self) -> Unit:
        return self._current().next_unit()

    def at_pass_boundary(self) -> bool:
        return self._pass is None

    def run_unit(self) -> int:
        p = self._current()
        p.run_unit()
        self.report.units += 1
        if not p.done:
            return 0
        self._pass = None
        return self.completed(p)
