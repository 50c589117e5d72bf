"""The engine's background work: training and evaluation units run as the co-execution rule admits
them (a mixin of `engine.Engine`, on the loop thread). In idle time one unit per loop pass, so an
arrival waits at most for the unit in flight; beside decodes unit after unit while the rule admits
each; the naive policy a whole micro-batch. A failed job fails alone: serving goes on.
"""

from __future__ import annotations

import logging
import time

import torch

from collm.edge_client.training.jobs import BackgroundJob
from collm.edge_client.training.trainer import TrainJob

log = logging.getLogger("collm.engine")


class BackgroundRunner:
    """Needs the engine's `core`, `policy`, `costs`, `telemetry`, `timeline`, `device`, `clock`, `_lock`,
    `_incoming` and `_share_seen`."""

    def _run_background(self) -> bool:
        """Run background work the rule admits: in idle time one unit (the loop then looks for arrivals);
        beside decodes, unit after unit while the rule admits each (the gap before the next serving step);
        the naive policy a whole micro-batch. True if anything ran."""
        core = self.core
        job = core.current_job(self.clock())
        if job is None:
            return False
        ran = False
        verdict = None
        try:
            while True:
                unit = job.next_unit()
                if verdict is None or verdict.reason == "busy-share":  # beside decodes: ask before every unit
                    with self._lock:
                        arriving = list(self._incoming)
                    verdict, load = core.verdict(self.clock(), self.costs.unit_time(job.kind, unit.kind, unit.tokens),
                                                 arriving)
                    self._note_share()
                    if not verdict.run:
                        if not ran:
                            job.report.deferrals += 1
                            self.telemetry.record_deferral()
                        return ran
                now = self._run_unit(job, unit, verdict, beside_serving=not load.idle)
                ran = True
                if core.after_units(job, now) or core.ending:
                    return True  # it ended (or ends at the next pass: shutdown)
                if verdict.reason == "busy-share":
                    continue  # the gap before the next serving step may hold more (the verdict decides)
                if not self.policy.whole_passes or job.at_pass_boundary():
                    return True  # idle: one unit per pass, so an arrival waits at most for it
        except Exception as e:  # noqa: BLE001 - a failed job must not take serving down
            log.exception("%s job failed", job.kind)
            job.fail(e)
            if core.job is job:
                core.job = None
            if core.carry is job:  # a failed carry is not picked up again at the next pass
                core.carry = None
            return False

    def _run_unit(self, job: BackgroundJob, unit, verdict, beside_serving: bool) -> float:
        """Run one unit and account for it (timeline, cost models, telemetry, the core, the job's
        report; `beside_serving`: requests were running or waiting when the rule admitted it); the clock
        after it."""
        t0 = self.clock()
        completed_tokens = job.run_unit()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = self.clock()
        dt = now - t0
        if self.timeline is not None:
            self.timeline.record("unit", t=time.time() - dt, s=dt, job=job.kind,
                                 unit=unit.kind, tok=unit.tokens, why=verdict.reason)
        self.costs.observe_unit(job.kind, unit.kind, unit.tokens, dt)
        self.telemetry.record_background(job.kind, dt, completed_tokens, beside_serving=beside_serving)
        self.core.ran(verdict, dt)
        job.report.compute_seconds += dt
        job.pass_s += dt
        if completed_tokens:  # a micro-batch completed: what a whole one costs, for the load report
            (self.costs.train if job.kind == "train" else self.costs.eval).observe([completed_tokens], job.pass_s)
            job.pass_s = 0.0
        return now

    def _note_share(self) -> None:
        """The timeline records each change of the share the co-execution rule grants beside serving."""
        share = self.policy.share
        if self.timeline is not None and share != self._share_seen:
            ctl = getattr(self.policy, "controller", None)
            self.timeline.record("share", t=time.time(), f=round(share, 4),
                                 **({"slack": ctl.slack, "act": ctl.action} if ctl is not None else {}))
        self._share_seen = share

    def _job_ended(self, job: BackgroundJob, deadline_hit: bool) -> None:
        """The core ended a job (its future now holds the report)."""
        train = job if isinstance(job, TrainJob) else None
        carry = " (carry, until the next round)" if train and train.is_carry else ""
        log.info("%s job done%s: %s", job.kind, carry,
                 {k: v for k, v in job.report.as_dict().items() if k != "extra"})
