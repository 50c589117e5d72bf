"""The replica core: a serving replica's queue, its background work and every decision over them, once.

`Engine` (edge_client/engine/engine.py) drives it with its threads, the model and the wall clock;
`SimEdge` (sim/edge.py) drives the same object on a logical clock with a profile's costs. Neither
decides anything about requests or background work itself; a driver only says what time it is, how
long things take, and computes the steps and units the core plans. A loop pass, in order:

1. `shed(now)`: waiting requests that were cancelled, and (shed_late) those that can no longer start
   in time: the wait so far plus the prefill queued ahead of them and their own is past their TTFT
   target (`planner.too_late`; counting only their own prefill let a request behind a burst of
   prompts wait until it was surely late); running requests that were cancelled.
2. `admit(allocate)`: waiting requests, oldest first, into free KV slots.
3. `plan()`: the step (`planner.plan_step`) and its cost features; after it runs, `stepped(...)`.
4. `current_job(now)`: the background job to work on. Queued work goes before the carry (its
   micro-batch in flight waits, intact); a round's training job absorbs the carry (`absorb`); a job
   that is done or past its deadline ends (`end_job`), and a round's job that asks for it leaves a
   carry behind (`make_carry`); a job whose start raises fails alone (`fail(exc)`). Then
   `verdict(now, unit_s)`: the co-execution policy's answer for the job's next unit, from
   `serving_load`; after units ran, `after_units` ends a job that is done.
5. `ended(r, reason, now)`: a request leaves; its TTFT and TPOT (`latencies`) go to the policy.

Requests are objects with the engine `Request`'s fields (arrival, prompt_ids, prefilled, out_ids,
slot, adapter, first_token_at, cancelled, slo, prefill_left, decoding). Jobs have `kind`, `started`,
`carry_after`, `start(now)`, `done()`, `past_deadline(now)`, `absorb(carry)`, `make_carry()` and
`finish(deadline_hit, now)`, and `fail(exc)` if their start can raise (`training.jobs.BackgroundJob`,
`sim.jobs.SimJob`, whose start cannot).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from collm.edge_client.engine.co_schedule import CoSchedule, RequestSlack, ServingLoad, Verdict
from collm.edge_client.engine.controller import RequestOutcome
from collm.edge_client.engine.planner import StepShape, next_step_shape, plan_step, prefill_time, step_shape, too_late

log = logging.getLogger("collm.engine")


def latencies(arrival: float, first_token_at: float | None, tokens: int, end: float) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) of a request that ended at `end` with `tokens` output tokens: TPOT is the mean gap
    after the first token (0 for a one-token answer; None for none)."""
    if first_token_at is None:
        return None, None
    tpot = (end - first_token_at) / (tokens - 1) if tokens > 1 else 0.0
    return first_token_at - arrival, tpot


def outcome(reason: str, ttft: float | None, tpot: float | None, ttft_slo: float,
            tpot_slo: float) -> RequestOutcome | None:
    """What the co-execution controller learns from a request that ended for `reason`: its latencies if
    it completed, a shed (a TTFT miss) if it expired waiting; None if it says nothing (cancelled, failed)."""
    if reason in ("stop", "length"):
        return RequestOutcome(ttft, tpot, ttft_slo, tpot_slo)
    if reason == "expired":
        return RequestOutcome(None, None, ttft_slo, tpot_slo, shed=True)
    return None


class ReplicaCore:
    """One replica's requests and background work, and the decisions over them (the module docstring).

    `predict_step(decode, prefill, attended)`: the driver's cost model. `log`: if a list, every
    decision is appended to it as a tuple, requests named by their arrival time (the engine and the
    simulator are tested against each other on it)."""

    def __init__(self, policy: CoSchedule, predict_step: Callable[[int, int, int], float], *, slots: int,
                 max_queue: int, step_token_budget: int, safety: float, shed_late: bool = True,
                 log: list | None = None):
        self.policy, self.predict_step = policy, predict_step
        self.slots, self.max_queue, self.budget, self.safety = slots, max_queue, step_token_budget, safety
        self.shed_late = shed_late
        self.waiting: deque = deque()
        self.running: list = []
        self.jobs: deque = deque()
        self.job = None    # the background job being worked on
        self.carry = None  # training between rounds, lowest priority, absorbed by the next round's job
        self.ending = False  # shutdown: end background jobs at the next unit boundary, start no carry
        self.step_end = 0.0  # when the last serving step ended: the per-step cap counts from it
        self.log = log
        self.on_job_end: Callable[[object, bool], None] | None = None  # the driver hears of every job that ends

    def _note(self, *decision) -> None:
        if self.log is not None:
            self.log.append(decision)

    # ------------------------------------------------------------------ requests
    def queue_room(self, queued: int, free_slots: int) -> int:
        """How many more requests may wait: `engine.max_queue` beyond the free slots, less those queued."""
        return self.max_queue + free_slots - queued

    def queue_full(self, queued: int, free_slots: int) -> bool:
        """A new request is refused (429) when no room is left."""
        return self.queue_room(queued, free_slots) <= 0

    def prefill_s(self, prompt_tokens: int) -> float:
        """Predicted time to prefill a prompt alone: its chunks of at most the step token budget."""
        return prefill_time(prompt_tokens, self.budget, self.predict_step)

    def shed(self, now: float) -> list[tuple[object, str]]:
        """Waiting requests to drop (removed here) and running ones that were cancelled, with the reason;
        the driver finishes each (`ended`)."""
        out = []
        ahead = sum(r.prefill_left for r in self.running)  # prefill that runs before a waiting request's own
        keep: deque = deque()
        for r in self.waiting:
            if r.cancelled:
                out.append((r, "cancelled"))
            elif self.shed_late and too_late(now, r.arrival, self.prefill_s(ahead + len(r.prompt_ids)), r.slo.ttft_s):
                out.append((r, "expired"))
            else:
                keep.append(r)
                ahead += len(r.prompt_ids)
        self.waiting = keep
        out += [(r, "cancelled") for r in self.running if r.cancelled]
        for r, why in out:
            self._note("drop", now, r.arrival, why)
        return out

    def admit(self, allocate: Callable[[], int | None]) -> list:
        """Waiting requests, oldest first, into the KV slots `allocate()` hands out (None: none free)."""
        admitted = []
        while self.waiting and len(self.running) < self.slots:
            slot = allocate()
            if slot is None:
                break
            r = self.waiting.popleft()
            r.slot = slot
            self.running.append(r)
            admitted.append(r)
            self._note("admit", r.arrival)
        return admitted

    def plan(self) -> tuple[list, set[int], StepShape]:
        """The next step's segments, the slots prefilling in it, and its cost features."""
        segments = plan_step(self.running, self.budget)
        by_slot = {r.slot: r for r in self.running}
        prefilling = {s.slot for s in segments if not by_slot[s.slot].decoding}
        shape = step_shape(segments, prefilling)
        if segments:
            self._note("step", shape.decode, shape.prefill, shape.attended)
        return segments, prefilling, shape

    def stepped(self, end: float, seconds: float) -> None:
        """A serving step of `seconds` ended at `end`."""
        self.step_end = end
        self.policy.observe_step(end, seconds)

    def ended(self, r, reason: str, now: float) -> tuple[float | None, float | None]:
        """`r` leaves the replica (its slot is the driver's to free): its TTFT and TPOT, which the
        co-execution policy learns too."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        ttft, tpot = latencies(r.arrival, r.first_token_at, len(r.out_ids), now)
        if (seen := outcome(reason, ttft, tpot, r.slo.ttft_s, r.slo.tpot_s)) is not None:
            self.policy.observe_request(now, seen)
        self._note("end", now, r.arrival, reason, len(r.out_ids))
        return ttft, tpot

    # ------------------------------------------------------------------ background work
    def serving_load(self, now: float, arriving: Iterable = ()) -> ServingLoad:
        """The plain-data view of serving the co-execution rule decides from (`arriving`: requests handed
        to the replica but not yet in its queue, which wait all the same)."""
        waiting = [*self.waiting, *arriving]
        shape = next_step_shape(self.running, self.budget)
        step_s = self.predict_step(shape.decode, shape.prefill, shape.attended) if self.running else 0.0
        reqs = tuple(RequestSlack(r.arrival, r.first_token_at, len(r.out_ids), r.slo.ttft_s, r.slo.tpot_s,
                                  r.prefill_left) for r in (*self.running, *waiting))
        return ServingLoad(now, len(self.running), len(waiting), sum(r.prefill_left for r in self.running),
                           step_s, reqs, self.budget, self.safety, max(0.0, now - self.step_end))

    def carry_runnable(self) -> bool:
        c = self.carry
        return c is not None and not c.done() and not self.ending

    def has_job(self) -> bool:
        return self.job is not None or bool(self.jobs) or self.carry_runnable()

    def queue_job(self, job) -> None:
        self.jobs.append(job)

    def current_job(self, now: float):
        """The job to work on now, started if it was not (module docstring, 4); None if there is none."""
        while True:
            if self.job is not None and self.job is self.carry and self.jobs:
                self.job = None  # the carry yields to queued work; its micro-batch in flight waits, intact
            if self.job is None and self.jobs:
                self.job = self.jobs.popleft()
                if self.job.kind == "train" and self.carry is not None:
                    self.job.absorb(self.carry)  # the round's job sends the carry's work
                    self.carry = None
                if not self._started(self.job, now):
                    continue
                self._note("job", now, self.job.kind)
            elif self.job is None and self.carry_runnable():
                self.job = self.carry
                if not self.job.started and not self._started(self.job, now):
                    continue
                self._note("job", now, "carry")
            job = self.job
            if job is None:
                return None
            if job.done() or job.past_deadline(now) or self.ending:
                self.end_job(job, now, deadline_hit=not job.done())
                continue
            return job

    def _started(self, job, now: float) -> bool:
        """Start `job`; one that cannot (a global that does not fit, a rebase that does not converge) fails alone
        and is let go, as a job whose unit fails: serving goes on (it took the engine down)."""
        try:
            job.start(now)
            return True
        except Exception as e:  # noqa: BLE001 - any failure of a job's start is the job's
            log.exception("%s job failed to start (a carry it absorbed is dropped with it)", job.kind)
            job.fail(e)
            self.job = None
            if self.carry is job:
                self.carry = None
            return False

    def verdict(self, now: float, unit_s: float, arriving: Iterable = ()) -> tuple[Verdict, ServingLoad]:
        """May the current job's next unit (predicted `unit_s`) run now? The policy decides (an evaluation's
        units by its floor, co_schedule's docstring)."""
        load = self.serving_load(now, arriving)
        v = self.policy.verdict(load, unit_s, self.job.kind if self.job is not None else "train")
        self._note("verdict", now, v.run, v.reason)
        return v, load

    def ran(self, verdict: Verdict, seconds: float) -> None:
        """A unit the verdict admitted took `seconds` (busy-time units spend the policy's bucket)."""
        if verdict.reason == "busy-share":
            self.policy.spent(seconds)

    def after_units(self, job, now: float) -> bool:
        """Units of `job` ran up to `now`: end it if it is done or past its deadline. True if it ended."""
        if job.done() or job.past_deadline(now):
            self.end_job(job, now, deadline_hit=not job.done())
            return True
        return False

    def end_job(self, job, now: float, deadline_hit: bool = False) -> None:
        """The job ends (its report or callback is the job's `finish`); a round's training job that asks
        for it leaves a carry, which the next round's job absorbs."""
        if self.job is job:
            self.job = None
        job.finish(deadline_hit, now)
        self._note("end-job", now, job.kind, deadline_hit)
        if self.on_job_end is not None:
            self.on_job_end(job, deadline_hit)
        if job.kind == "train" and job.carry_after and not self.ending and job is not self.carry:
            self.carry = job.make_carry()
