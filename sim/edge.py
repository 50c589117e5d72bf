"""One simulated edge: the engine's step loop on a logical clock, deciding with the engine's own code.

Every decision is the replica core's (`edge_client/engine/replica.py`, the object `Engine` drives):
shed and admit, plan the step (the same Segment objects), pick the background job and its carry, and
ask the co-execution policy whether its next unit may run. SimEdge only keeps the clock: a step
takes the profile's time, a unit its share of a measured micro-batch.

Two fast-forwards keep 1,000 edges cheap, both exact: (1) while only decodes run, nothing waits, and
the policy refuses background work for a reason that cannot change until something arrives
(`STABLE_REFUSALS`: a fixed share of 0, or no background job at all; the controller's refusals can
change with time, so under `slo_feedback` an edge with a job steps one step at a time), k decode
steps (up to the next finish) are one event;
an arrival cuts the run at the step boundary after it, where the engine would take it. (2) An idle
replica's background work (verdict "idle") runs unit after unit as one event until the job's
budget or deadline; an arrival cuts it at the next unit boundary (the unit in flight finishes;
the micro-batch's finished units are kept, as `training.layerwise` keeps them).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from itertools import accumulate

from collm.common.slo import SLO
from collm.edge_client.engine.replica import ReplicaCore
from collm.sim.jobs import SimJob
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
                 "first_token_at", "max_tokens", "slo", "cancelled")

    def __init__(self, index: int, point: int, arrival: float, prompt_tokens: int, max_tokens: int, slo: SLO):
        self.index, self.point, self.arrival = index, point, arrival
        self.cancelled = False  # a simulated client never goes away
        self.prompt_ids = range(prompt_tokens)  # slicing a range is O(1): plan_step slices prompts
        self.prefilled = 0
        self.out_ids: list[int] = []
        self.slot = -1
        self.adapter: Version | None = None
        self.first_token_at: float | None = None
        self.max_tokens = max_tokens
        self.slo = slo

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt_ids)

    @property
    def prefill_left(self) -> int:
        return len(self.prompt_ids) - self.prefilled


class SimEdge:
    """The engine's loop on a logical clock: every decision is the replica core's (`ReplicaCore`)."""

    def __init__(self, index: int, name: str, profile: EdgeProfile, role: str, policy, world, seed: int,
                 slo: SLO, safety: float, log: list | None = None):
        self.index, self.name, self.p, self.role, self.policy, self.world = index, name, profile, role, policy, world
        self.rng = random.Random(seed)
        self.slo = slo
        self.serves, self.trains = "serve" in role, "train" in role
        self.core = ReplicaCore(policy, profile.step_s, slots=profile.max_running, max_queue=profile.max_queue,
                                step_token_budget=profile.step_token_budget, safety=safety, log=log)
        self.free = list(range(profile.max_running - 1, -1, -1))
        self.version = Version(0)
        self.act: tuple | None = None  # (kind, start, end, data)
        self.neighbours: list[SimEdge] = []  # edges on the same machine (the world's interference setting)
        self.slowdown = 0.0  # a step or unit is this much longer per busy neighbour
        self.background_slowdown = 0.0  # a step is this much longer per neighbour in background work
        self.step_factor = 1.0  # a step is this much longer in a mode with a federation
        self.epoch = 0
        self._stepped = False
        self._stable_refusal = True
        # counters (cumulative; the world windows them)
        self.busy_s = 0.0         # serving steps
        self.train_s = 0.0        # background units
        self.beside_s = 0.0       # background units while requests ran or waited
        self.train_tokens = 0
        self.finished = 0
        self.met = 0
        self.budget_fill: float | None = None  # tokens trained / budget last round (the load report's)

    @property
    def waiting(self):
        return self.core.waiting

    @property
    def running(self):
        return self.core.running

    # ------------------------------------------------------------------ inputs
    def arrive(self, r: SimRequest, now: float) -> bool:
        """A request reaches the edge (Engine.submit); False: the queue is full (429)."""
        if self.core.queue_full(len(self.core.waiting), len(self.free)):
            return False
        self.core.waiting.append(r)
        self._interrupt(now)
        return True

    def queue_job(self, job: SimJob, now: float) -> None:
        self.core.queue_job(job)
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
            job, planned, verdict, beside, u = data
            done = max(1, math.ceil((now - start) / u - 1e-9))
            if done < planned:
                t = start + done * u
                self.act = (TRAIN, start, t, (job, done, verdict, beside, u))
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
        for r, why in self.core.shed(now):
            self._ended(r, now, why)
        for r in self.core.admit(self._allocate):
            r.adapter = self.version
        if self.core.running:
            self._start_serving(now)
            return
        if self._background(now):
            return
        # idle: nothing until an arrival or a job (`_interrupt`)

    def _allocate(self) -> int | None:
        return self.free.pop() if self.free else None

    def _noise(self) -> float:
        s = self.p.noise_sigma
        return self.rng.lognormvariate(-0.5 * s * s, s) if s > 0 else 1.0  # mean 1

    def _interference(self) -> float:
        """How much longer a background unit that starts now takes: `slowdown` per other edge of the
        machine busy now."""
        if not self.slowdown:
            return 1.0
        return 1.0 + self.slowdown * sum(1 for n in self.neighbours if n.act is not None)

    def _step_interference(self) -> float:
        """How much longer a serving step that starts now takes: the mode's factor, and per other edge
        of the machine `slowdown` if it is serving, `background_slowdown` if it is in background work."""
        busy = 0.0
        for n in self.neighbours:
            if n.act is not None:
                busy += self.slowdown if n.act[0] in (STEP, RUN) else self.background_slowdown
        return self.step_factor * (1.0 + busy)

    def _start_serving(self, now: float) -> None:
        running = self.core.running
        if not self.core.waiting and self._stable_refusal and all(r.decoding for r in running):
            # a decode run up to the next finish
            d = len(running)
            k = min(r.max_tokens - len(r.out_ids) for r in running)
            a0 = sum(len(r.prompt_ids) + len(r.out_ids) for r in running)
            step_s, slow = self.p.step_s, self._step_interference()
            times = [step_s(d, 0, a0 + j * d) * self._noise() * slow for j in range(k)]
            ends = list(accumulate(times, initial=now))[1:]
            self.act = (RUN, now, ends[-1], (ends,))
            self._schedule(ends[-1])
            return
        segs, prefilling, shape = self.core.plan()
        by_slot = {r.slot: r for r in running}
        dt = self.p.step_s(shape.decode, shape.prefill, shape.attended) * self._noise() * self._step_interference()
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
                    self.world.first_token(r, self, now)
                r.out_ids.append(0)
                if len(r.out_ids) >= r.max_tokens:
                    self._ended(r, now, "length")
        self._stepped = True

    def _end_run(self, data, start: float, now: float) -> None:
        (ends,) = data
        n = len(ends)
        self._served(now, now - start)
        for r in list(self.core.running):
            r.out_ids.extend([0] * n)
            if len(r.out_ids) >= r.max_tokens:
                self._ended(r, now, "length")
        self._stepped = True

    def _served(self, end: float, seconds: float) -> None:
        self.busy_s += seconds
        self.core.stepped(end, seconds)

    def _ended(self, r: SimRequest, now: float, status: str) -> None:
        """The request leaves the edge (the core tells the co-execution policy); the world records it."""
        slot = r.slot if r in self.core.running else None
        ttft, tpot = self.core.ended(r, status, now)
        if slot is not None:
            self.free.append(slot)
        self.world.finished(r, self, now, status, ttft, tpot)

    # ------------------------------------------------------------------ background work
    def _background(self, now: float) -> bool:
        """Start background work if the core's verdict admits it; True if something started."""
        self._stable_refusal = True  # no background work: nothing can want the replica mid-run
        job = self.core.current_job(now)
        if job is None:
            return False
        v, load = self.core.verdict(now, job.unit_s)
        self._stable_refusal = not v.run and v.reason in STABLE_REFUSALS
        if not v.run:
            return False
        u = job.unit_s * self._interference()
        if self.policy.whole_passes:  # naive: the rest of the micro-batch at once
            units = job.units - job.unit_in_mb
            kind = PASS
        elif load.idle:  # idle: unit after unit until the job ends or something arrives
            units = job.units_to_end(now, u)
            kind = TRAIN
        else:
            units, kind = 1, UNIT
        units = max(1, units)
        end = now + units * u
        self.act = (kind, now, end, (job, units, v, not load.idle, u))
        self._schedule(end)
        return True

    def _end_units(self, kind: int, data, start: float, now: float) -> None:
        job, units, verdict, beside, u = data
        seconds = units * u
        tokens = job.advance(units)
        self.train_s += seconds
        if beside:  # serving was waiting or running when the verdict admitted it (Telemetry's beside_serving)
            self.beside_s += seconds
        if kind == UNIT:
            self.core.ran(verdict, seconds)
            self._stepped = verdict.reason == "busy-share"  # beside decodes the engine asks again before its next step
        if job.kind == "train":
            self.train_tokens += tokens
        self.core.after_units(job, now)

    def train_tokens_at(self, now: float) -> int:
        """Training tokens of the micro-batches completed by `now`. A stretch of units in flight credits
        its micro-batches to `train_tokens` when it ends (an idle run fast-forwarded as one event may
        span a load point's start); the ones it has completed by `now` count here, as the engine's
        counter would show them, so a window's tokens are the micro-batches completed inside it."""
        tokens = self.train_tokens
        if self.act is not None and self.act[0] in (TRAIN, PASS, UNIT):
            _, start, _, (job, units, _, _, u) = self.act
            if job.kind == "train":
                done = min(units, int((now - start) / u + 1e-9))
                tokens += (job.unit_in_mb + done) // job.units * job.mb_tokens
        return tokens

    def carried_tokens(self) -> int:
        c = self.core.carry
        return c.tokens if c is not None else 0
