"""One simulated edge: the engine's step loop on a logical clock, deciding with the engine's own code.

Each pass mirrors `Engine._loop` (edge_client/engine/engine.py): shed waiting requests that can no
longer start in time (`planner.too_late`), admit into free slots (pinning the serving version),
plan the step (`planner.plan_step`, the same Segment objects), run it for the profile's time, then
ask the replica's co-execution policy (`co_schedule.make_policy`, the same object the engine asks)
whether a unit of background work may run. Only the clock and the costs are simulated.

Two fast-forwards keep 1,000 edges cheap, both exact under the shipped rule: (1) while only
decodes run, nothing waits, and the policy refuses background work for a reason that cannot change
until something arrives (`STABLE_REFUSALS`), k decode steps (up to the next finish) are one event;
an arrival cuts the run at the step boundary after it, where the engine would take it. (2) An idle
replica's background work (verdict "idle") runs unit after unit as one event until the job's
budget or deadline; an arrival cuts it at the next unit boundary (the unit in flight finishes;
the micro-batch's finished units are kept, as `training.layerwise` keeps them).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import deque
from itertools import accumulate

from collm.edge_client.engine.co_schedule import RequestSlack, ServingLoad
from collm.edge_client.engine.replica import latencies, outcome
from collm.edge_client.engine.planner import next_step_shape, plan_step, prefill_time, step_shape, too_late
from collm.sim.profile import EdgeProfile

STABLE_REFUSALS = frozenset({"busy-share-off"})  # refusals that hold for a whole decode-only run

STEP, RUN, TRAIN, PASS, UNIT = range(5)  # what the edge is doing


class Version:
    """The adapter a request is pinned to (plan_step sorts segments by `.version`)."""

    __slots__ = ("version",)

    def __init__(self, version: int):
        self.version = version


class SimRequest:
    """What the planner and the slack guard read of a request (the engine's `Request` fields)."""

    __slots__ = ("index", "point", "arrival", "prompt_ids", "prefilled", "out_ids", "slot", "adapter",
                 "first_token_at", "max_tokens", "ttft_slo", "tpot_slo")

    def __init__(self, index: int, point: int, arrival: float, prompt_tokens: int, max_tokens: int,
                 ttft_slo: float, tpot_slo: float):
        self.index, self.point, self.arrival = index, point, arrival
        self.prompt_ids = range(prompt_tokens)  # slicing a range is O(1): plan_step slices prompts
        self.prefilled = 0
        self.out_ids: list[int] = []
        self.slot = -1
        self.adapter: Version | None = None
        self.first_token_at: float | None = None
        self.max_tokens = max_tokens
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def prefill_left(self) -> int:
        return len(self.prompt_ids) - self.prefilled


class SimJob:
    """A background job: micro-batches of `units` resumable units each, until `budget_tokens` input
    tokens are done, or past `deadline` (+ grace for the one in flight)."""

    __slots__ = ("kind", "mb_s", "units", "mb_tokens", "budget_tokens", "deadline_s", "deadline", "grace_s",
                 "unit_in_mb", "tokens", "on_done", "carry_after", "started", "ended")

    def __init__(self, kind: str, profile: EdgeProfile, budget_tokens: int, deadline_s: float = math.inf,
                 finish_grace: float = 0.0, on_done=None, carry_after: bool = False):
        self.kind = kind
        if kind == "train":
            self.mb_s, self.units, self.mb_tokens = profile.train_s, profile.train_units, profile.train_tokens
        else:
            self.mb_s, self.units, self.mb_tokens = profile.eval_s, profile.eval_units, profile.eval_tokens
        self.budget_tokens, self.deadline_s = budget_tokens, deadline_s
        self.deadline = math.inf  # set when the engine starts the job: the deadline counts from then
        self.grace_s = finish_grace * deadline_s if math.isfinite(deadline_s) else 0.0
        self.unit_in_mb = 0  # units of the current micro-batch already run
        self.tokens = 0
        self.on_done, self.carry_after = on_done, carry_after
        self.started = self.ended = False

    def start(self, now: float) -> None:
        if not self.started:
            self.started = True
            self.deadline = now + self.deadline_s

    @property
    def unit_s(self) -> float:
        return self.mb_s / self.units

    def done(self) -> bool:
        return self.tokens >= self.budget_tokens

    def units_to_budget(self) -> int:
        mbs = math.ceil((self.budget_tokens - self.tokens) / self.mb_tokens)
        return max(0, mbs * self.units - self.unit_in_mb)

    def units_to_end(self, t0: float) -> int:
        """Units to run from t0 until the job ends: its budget, or the deadline rule (`past_deadline`:
        no micro-batch starts after the deadline; the one in flight may finish within the grace)."""
        n = self.units_to_budget()
        if math.isinf(self.deadline):
            return n
        u = self.unit_s
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


class SimEdge:
    def __init__(self, index: int, name: str, profile: EdgeProfile, role: str, policy, world, seed: int,
                 ttft_slo: float, tpot_slo: float, safety: float, carry_rounds: float = 4.0):
        self.index, self.name, self.p, self.role, self.policy, self.world = index, name, profile, role, policy, world
        self.carry_rounds = carry_rounds  # training.carry_budget_rounds
        self.rng = random.Random(seed)
        self.ttft_slo, self.tpot_slo, self.safety = ttft_slo, tpot_slo, safety
        self.serves, self.trains = "serve" in role, "train" in role
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free = list(range(profile.max_running - 1, -1, -1))
        self.version = Version(0)
        self.jobs: deque[SimJob] = deque()
        self.job: SimJob | None = None
        self.carry: SimJob | None = None
        self.act: tuple | None = None  # (kind, start, end, data)
        self.epoch = 0
        self._stepped = False
        self._step_end = 0.0  # when the last serving step ended (the per-step cap counts from it)
        self._stable_refusal = True
        # counters (cumulative; the world windows them)
        self.busy_s = 0.0         # serving steps
        self.train_s = 0.0        # background units
        self.beside_s = 0.0       # background units while requests ran or waited
        self.train_tokens = 0
        self.finished = 0
        self.met = 0
        self.budget_fill: float | None = None  # tokens trained / budget last round (the load report's)

    # ------------------------------------------------------------------ inputs
    def arrive(self, r: SimRequest, now: float) -> bool:
        """A request reaches the edge (Engine.submit); False: the queue is full (429)."""
        if len(self.waiting) >= self.p.max_queue + len(self.free):
            return False
        self.waiting.append(r)
        self._interrupt(now)
        return True

    def queue_job(self, job: SimJob, now: float) -> None:
        self.jobs.append(job)
        self._interrupt(now)

    def set_version(self, version: int) -> None:
        """Swap the serving adapter: requests admitted from now on are pinned to it."""
        self.version = Version(version)

    def _interrupt(self, now: float) -> None:
        """Something the loop must see: start it if idle, else cut a fast-forwarded stretch at the next
        boundary (a decode run at its step, idle training at its unit)."""
        act = self.act
        if act is None:
            self._next(now)
            return
        kind, start, end, data = act
        if kind == RUN:
            ends = data[0]
            m = bisect_left(ends, now)
            if m + 1 < len(ends):
                self.act = (RUN, start, ends[m], (ends[: m + 1],))
                self._schedule(ends[m])
        elif kind == TRAIN:
            job, planned, _, beside = data
            u = job.unit_s
            done = max(1, math.ceil((now - start) / u - 1e-9))
            if done < planned:
                t = start + done * u
                self.act = (TRAIN, start, t, (job, done, False, beside))
                self._schedule(t)

    def _schedule(self, t: float) -> None:
        self.epoch += 1
        self.world.wake_at(t, self.index, self.epoch)

    # ------------------------------------------------------------------ the loop
    def wake(self, now: float, epoch: int) -> None:
        if epoch != self.epoch or self.act is None:
            return  # superseded by a cut
        kind, start, end, data = self.act
        self.act = None
        if kind == STEP:
            self._end_step(data, now)
        elif kind == RUN:
            self._end_run(data, start, now)
        else:
            self._end_units(kind, data, start, now)
        self._next(now)

    def _next(self, now: float) -> None:
        if self._stepped:  # the engine asks the co-execution rule after every serving step
            self._stepped = False
            if self._background(now):
                return
        self._shed(now)
        self._admit()
        if self.running:
            self._start_serving(now)
            return
        if self._background(now):
            return
        # idle: nothing until an arrival or a job (`_interrupt`)

    def _shed(self, now: float) -> None:
        if not self.waiting:
            return
        B = self.p.step_token_budget
        keep = deque()
        ahead = sum(r.prefill_left for r in self.running)
        for r in self.waiting:
            if too_late(now, r.arrival, prefill_time(ahead + len(r.prompt_ids), B, self.p.step_s), r.ttft_slo):
                self._ended(r, now, "expired")
            else:
                keep.append(r)
                ahead += len(r.prompt_ids)
        self.waiting = keep

    def _admit(self) -> None:
        while self.waiting and self.free:
            r = self.waiting.popleft()
            r.slot = self.free.pop()
            r.adapter = self.version
            self.running.append(r)

    def _noise(self) -> float:
        s = self.p.noise_sigma
        return self.rng.lognormvariate(-0.5 * s * s, s) if s > 0 else 1.0  # mean 1

    def _start_serving(self, now: float) -> None:
        running = self.running
        if not self.waiting and self._stable_refusal and all(r.decoding for r in running):
            # a decode run up to the next finish
            d = len(running)
            k = min(r.max_tokens - len(r.out_ids) for r in running)
            a0 = sum(len(r.prompt_ids) + len(r.out_ids) for r in running)
            step_s = self.p.step_s
            times = [step_s(d, 0, a0 + j * d) * self._noise() for j in range(k)]
            ends = list(accumulate(times, initial=now))[1:]
            self.act = (RUN, now, ends[-1], (ends,))
            self._schedule(ends[-1])
            return
        segs = plan_step(running, self.p.step_token_budget)
        by_slot = {r.slot: r for r in running}
        prefilling = {s.slot for s in segs if not by_slot[s.slot].decoding}
        shape = step_shape(segs, prefilling)
        dt = self.p.step_s(shape.decode, shape.prefill, shape.attended) * self._noise()
        self.act = (STEP, now, now + dt, (segs, prefilling, by_slot, dt))
        self._schedule(now + dt)

    def _end_step(self, data, now: float) -> None:
        segs, prefilling, by_slot, dt = data
        self._served(now, dt)
        for s in segs:
            r = by_slot[s.slot]
            if s.slot in prefilling:
                r.prefilled += len(s.tokens)
            if s.want_logits:
                if r.first_token_at is None:
                    r.first_token_at = now
                r.out_ids.append(0)
                if len(r.out_ids) >= r.max_tokens:
                    self._finish(r, now)
        self._stepped = True

    def _end_run(self, data, start: float, now: float) -> None:
        (ends,) = data
        n = len(ends)
        self._served(now, now - start)
        for r in list(self.running):
            r.out_ids.extend([0] * n)
            if len(r.out_ids) >= r.max_tokens:
                self._finish(r, now)
        self._stepped = True

    def _served(self, end: float, seconds: float) -> None:
        self._step_end = end
        self.busy_s += seconds
        self.policy.observe_step(end, seconds)

    def _finish(self, r: SimRequest, now: float) -> None:
        self.running.remove(r)
        self.free.append(r.slot)
        self._ended(r, now, "length")

    def _ended(self, r: SimRequest, now: float, status: str) -> None:
        """The request leaves the edge: the co-execution policy learns its latencies (as the engine's
        `_finish` tells it), the world records the outcome."""
        ttft, tpot = latencies(r.arrival, r.first_token_at, len(r.out_ids), now)
        if (seen := outcome(status, ttft, tpot, r.ttft_slo, r.tpot_slo)) is not None:
            self.policy.observe_request(now, seen)
        self.world.finished(r, self, now, status, ttft, tpot)

    # ------------------------------------------------------------------ background work
    def _pick_job(self, now: float) -> SimJob | None:
        """Engine._run_background's choice: the current job; queued work before the carry; a round's
        training job absorbs the carry (its tokens and its micro-batch in flight)."""
        if self.job is not None and self.job is self.carry and self.jobs:
            self.job = None  # the carry yields to queued work, intact
        if self.job is None and self.jobs:
            self.job = self.jobs.popleft()
            if self.job.kind == "train" and self.carry is not None:
                c, j = self.carry, self.job
                j.tokens, j.unit_in_mb = c.tokens, c.unit_in_mb
                self.carry = None
            self.job.start(now)
        elif self.job is None and self.carry is not None and not self.carry.done():
            self.job = self.carry
            self.job.start(now)
        return self.job

    def _serving_load(self, now: float) -> ServingLoad:
        running, waiting = self.running, self.waiting
        shape = next_step_shape(running, self.p.step_token_budget)
        step_s = self.p.step_s(shape.decode, shape.prefill, shape.attended) if running else 0.0
        reqs = tuple(RequestSlack(r.arrival, r.first_token_at, len(r.out_ids), r.ttft_slo, r.tpot_slo,
                                  r.prefill_left) for r in (*running, *waiting))
        return ServingLoad(now, len(running), len(waiting), sum(r.prefill_left for r in running), step_s, reqs,
                           self.p.step_token_budget, self.safety, max(0.0, now - self._step_end))

    def _background(self, now: float) -> bool:
        """Start background work if the policy admits it; True if something started."""
        self._stable_refusal = True  # no background work: nothing can want the replica mid-run
        while True:
            job = self._pick_job(now)
            if job is None:
                return False
            if job.done() or now >= job.deadline + job.grace_s or (now >= job.deadline and job.unit_in_mb == 0):
                self._end_job(job, now)
                continue
            break
        load = self._serving_load(now)
        v = self.policy.verdict(load, job.unit_s)
        self._stable_refusal = not v.run and v.reason in STABLE_REFUSALS
        if not v.run:
            return False
        if self.policy.whole_passes:  # naive: the rest of the micro-batch at once
            units = job.units - job.unit_in_mb
            kind = PASS
        elif load.idle:  # idle: unit after unit until the job ends or something arrives
            units = job.units_to_end(now)
            kind = TRAIN
        else:
            units, kind = 1, UNIT
        units = max(1, units)
        end = now + units * job.unit_s
        self.act = (kind, now, end, (job, units, v.reason == "busy-share", not load.idle))
        self._schedule(end)
        return True

    def _end_units(self, kind: int, data, start: float, now: float) -> None:
        job, units, busy_share, beside = data
        seconds = units * job.unit_s
        tokens = job.advance(units)
        self.train_s += seconds
        if beside:  # serving was waiting or running when the verdict admitted it (Telemetry's beside_serving)
            self.beside_s += seconds
        if kind == UNIT and busy_share:
            self.policy.spent(seconds)
            self._stepped = True  # beside decodes the engine asks again before its next step
        if job.kind == "train":
            self.train_tokens += tokens
        if job.done() or now >= job.deadline:
            if job.done() or job.unit_in_mb == 0 or now >= job.deadline + job.grace_s - 1e-9:
                self._end_job(job, now)

    def _end_job(self, job: SimJob, now: float) -> None:
        if job.ended:
            return
        job.ended = True
        if self.job is job:
            self.job = None
        if job is self.carry:
            self.carry = None
            return
        if job.on_done is not None:
            job.on_done(self, job, now)
        if job.kind == "train" and job.carry_after:
            self.carry = SimJob("train", self.p, max(1, round(job.budget_tokens * self.carry_rounds)))

    def carried_tokens(self) -> int:
        return self.carry.tokens if self.carry is not None else 0
