"""The simulated federation's rounds, as `server/strategy.py` runs them, on the world's clock.

QUERY (load reports) -> the balancer (`server.balancer.BALANCERS`, the same function) -> TRAIN (each
participant's job, its deadline counted from when its engine starts it) -> aggregate, once the
slowest participant's update has arrived -> EVALUATE (each training edge evaluates the new global;
collm edges swap when their evaluation ends; isolated's serving edges load it `reload_s` after the
round) -> the next round. `World` mixes this in: it owns the edges, the clock and the event heap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from collm.common.protocol import LoadReport
from collm.lab.bench_config import is_collm
from collm.server.balancer import BALANCERS, balancer_params
from collm.server.config import BalancerConfig
from collm.sim.edge import SimEdge
from collm.sim.jobs import SimJob

SERVER = 3  # the world's event kind for a round's phase (after ARRIVE, WAKE, TICK)
QUERY, TRAIN, AGGREGATE, SWAP, RELOAD = range(5)  # the phases


@dataclass
class RoundLog:
    round: int
    started: float
    took_part: list[str] = field(default_factory=list)
    tokens: int = 0
    aggregated_at: float | None = None
    swapped_at: float | None = None
    loss: float | None = None


class FederationRounds:
    """The round state and phases of the simulated ServerApp (a mixin of `World`)."""

    def _init_rounds(self) -> None:
        cfg, f = self.cfg, self.cfg.federation
        self.rounds: list[RoundLog] = []
        self.version = 0
        self.tokens_aggregated = 0.0
        self.losses = [(0.0, 0, cfg.quality.loss(0.0))]  # (time, version, loss) of every swap
        self._last_gain: float | None = None
        bc = BalancerConfig()
        self.balance = BALANCERS["slo" if is_collm(self.mode) else "uniform"]
        self.params = replace(balancer_params(bc), round_deadline_s=f.round_deadline_s,
                              round_token_budget=f.round_token_budget)  # the sim's own federation budget
        self.idle_wait_s = bc.idle_wait_s
        self.round: RoundLog | None = None
        self._pending: set[int] = set()
        self._uploaded_at = 0.0

    def server_phase(self, phase: int, now: float) -> None:
        (self._query, self._train, self._aggregate, self._swap, self._reload_global)[phase](now)

    def _query(self, now: float) -> None:
        if len(self.rounds) >= self.cfg.federation.rounds:
            return
        self.round = RoundLog(len(self.rounds) + 1, now)
        self.rounds.append(self.round)
        self.push(now + self.cfg.network.exchange_s, SERVER, TRAIN)

    def _train(self, now: float) -> None:
        """The balancer over the trainers' load reports, then each participant's TRAIN job."""
        w = self.window(now) if self._history else None
        decisions = self.balance([self._report(e, w) for e in self.trainers], self.params)
        by_name = {e.name: e for e in self.trainers}
        self._pending = set()
        self._uploaded_at = now  # the round aggregates once the slowest update has arrived
        for d in decisions:
            if d.take_part and d.budget_tokens > 0:
                e = by_name[d.name]
                self.round.took_part.append(d.name)
                self._pending.add(e.index)
                e.queue_job(SimJob("train", e.p, d.budget_tokens, d.deadline_s, self.cfg.finish_grace,
                                   on_done=lambda job, hit, e=e: self._trained(e, job, self.now),
                                   carry_after=self.cfg.carry_between_rounds, carry_rounds=self.carry_rounds),
                            now)
        if not self._pending:
            self.push(now + self.idle_wait_s, SERVER, QUERY)

    def _aggregate(self, now: float) -> None:
        """The new global's quality from the curve, then EVALUATE on every training edge."""
        rl = self.round
        if rl.tokens <= 0:
            self.push(now + self.idle_wait_s, SERVER, QUERY)
            return
        before = self.cfg.quality.loss(self.tokens_aggregated)
        self.tokens_aggregated += rl.tokens
        rl.loss = self.cfg.quality.loss(self.tokens_aggregated)
        self._last_gain = (before - rl.loss) / (rl.tokens / 1000.0)
        self.version += 1
        rl.aggregated_at = now
        self._pending = set()
        n_mb = math.ceil(self.cfg.eval_records / self.trainers[0].p.eval_batch)
        for e in self.trainers:
            self._pending.add(e.index)
            e.queue_job(SimJob("eval", e.p, n_mb * e.p.eval_tokens,
                               on_done=lambda job, hit, e=e: self._evaluated(e, job, self.now)), now)

    def _swap(self, now: float) -> None:
        """The round is done: isolated's serving half loads the new global."""
        self.round.swapped_at = now
        if self.mode == "isolated":
            self._reload = (self.version, self.round.loss)
            self.push(now + self.cfg.network.reload_s, SERVER, RELOAD)
        self.push(now, SERVER, QUERY)

    def _reload_global(self, now: float) -> None:
        version, loss = self._reload
        for e in self.serving:
            e.set_version(version)
        self.losses.append((now, version, loss))

    def _trained(self, edge: SimEdge, job: SimJob, now: float) -> None:
        edge.budget_fill = min(1.0, job.tokens / max(job.budget_tokens, 1))  # its next load report says it
        if edge.index in self._pending:
            self._pending.discard(edge.index)
            self.round.tokens += job.tokens
            self._uploaded_at = max(self._uploaded_at, now + edge.p.upload_s)
            if not self._pending:
                self.push(self._uploaded_at + self.cfg.network.exchange_s, SERVER, AGGREGATE)

    def _evaluated(self, edge: SimEdge, job: SimJob, now: float) -> None:
        if self.mode != "isolated" and edge.serves:
            edge.set_version(self.version)  # collm: the edge serves the new global once its evaluation passed
            if edge is self.trainers[0]:
                self.losses.append((now, self.version, self.round.loss))
        if edge.index in self._pending:
            self._pending.discard(edge.index)
            if not self._pending:
                self.push(now + self.cfg.network.exchange_s, SERVER, SWAP)

    def _report(self, e: SimEdge, w: dict | None) -> LoadReport:
        i = e.index
        if w is None:
            spare, att, rate = 1.0, None, 0.0
        else:
            spare, rate = float(w["spare"][i]), float(w["fin"][i] / w["span"])
            att = None if math.isnan(w["attainment"][i]) else float(w["attainment"][i])
        return LoadReport(e.name, rate, att, spare, float(len(e.waiting)), float(len(e.running)),
                          self.cfg.train_examples, self._last_gain, e.p.idle_train_tokens_per_s,
                          carried_tokens=e.carried_tokens(), train_share=e.policy.share, budget_fill=e.budget_fill)
