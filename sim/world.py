"""The simulated fleet: trace arrivals -> the router -> N edges -> rounds, on one logical clock.

One heap of events (time, sequence, kind, a, b); no wall clock anywhere, every random draw from
streams seeded by `seed`, so a run is a pure function of its config. Kinds:

* ARRIVE   a trace request reaches the router: `collm.router.fleet.choose` (the router's own
           columnar rule, with its Assumptions and admission test) over the last scrapes picks
           the edge; refused requests count as misses, as the router's 429s do in collm-bench;
* WAKE     an edge's step, decode run or background stretch ends (`collm.sim.edge`);
* TICK     every `router.interval_s`: the router's staggered polls refresh the scrape of
           at most max_polls_per_s * interval edges, as `router/app.py` paces them;
* SERVER   the round's phases (`sim/rounds.py`), as `server/strategy.py` runs them: QUERY -> the
           balancer (`server.balancer.BALANCERS`, the same function) -> TRAIN (each participant's
           job, its deadline counted from when its engine starts it) -> aggregate -> EVALUATE
           (each training edge evaluates the new global; collm edges swap when their evaluation
           ends; isolated serving edges load it `reload_s` after the round) -> the next round.
           Each exchange costs `network.exchange_s`, and the aggregation also waits for the slowest
           participant's upload (its update's size over its device class's `uplink_mbps`; a class's
           `precision` scales its steps and training). A round that aggregated nothing waits
           `balancer.idle_wait_s` (the server's default) before the next.

Served quality is the config's curve over the tokens aggregated so far (`QualityCurve`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from collm.common.slo import SLO, meets_slo
from collm.common.traces import TraceRequest
from collm.edge_client.config import TrainingConfig
from collm.edge_client.engine.co_schedule import make_policy
from collm.lab.bench_config import edge_policy, is_collm, mode_roles, router_policy
from collm.router import fleet
from collm.router.config import HealthConfig, RoutingConfig
from collm.router.admission import AdmissionController, routing_policy
from collm.router.policy import EdgeView, RequestView, learn_output, unattainable
from collm.router.requests import ROLE_MARKER_TOKENS
from collm.sim.config import SimConfig
from collm.sim.edge import SimEdge, SimRequest
from collm.sim.profile import EdgeProfile
from collm.sim.rounds import SERVER, FederationRounds

ARRIVE, WAKE, TICK = range(3)  # and rounds.SERVER
WINDOW_S = 60.0  # the edges' telemetry window (engine.telemetry)


@dataclass(slots=True)
class Served:
    """One request's outcome (what collm-bench's Outcome records)."""

    index: int
    point: int
    edge: int
    status: str  # length | expired | refused
    ttft_s: float | None
    tpot_s: float | None
    version: int
    met: bool


def fleet_profiles(cfg: SimConfig, n: int, load) -> list[EdgeProfile]:
    """Each edge's profile from the device mix: shares rounded to whole edges, largest remainder
    first, devices interleaved so that isolated's two halves get the same mix."""
    shares = np.array([d.share for d in cfg.devices], float)
    want = shares / shares.sum() * n
    counts = np.floor(want).astype(int)
    for i in np.argsort(-(want - counts), kind="stable")[: n - counts.sum()]:
        counts[i] += 1
    mb = cfg.network.update_mb_per_rank
    profiles = [load(d.profile, d.speed).for_device(d.precision, d.upload_s(mb)) for d in cfg.devices]
    order = []
    left = counts.copy()
    while len(order) < n:
        for i in range(len(profiles)):
            if left[i]:
                order.append(profiles[i])
                left[i] -= 1
    return order


class World(FederationRounds):
    def __init__(self, cfg: SimConfig, mode: str, profiles: list[EdgeProfile], seed: int):
        self.cfg, self.mode = cfg, mode
        n = len(profiles)
        self.roles = mode_roles(mode, n)
        self.seq = 0
        self.heap: list = []
        self.now = 0.0
        ss = np.random.SeedSequence([seed, n, sum(map(ord, mode))])
        edge_seeds = ss.spawn(n + 1)
        self.rng = random.Random(int(edge_seeds[-1].generate_state(1)[0]))  # the router's p2c sampler
        tc = TrainingConfig(co_schedule=edge_policy(mode, cfg.co_schedule),
                            busy_share=cfg.busy_share if is_collm(mode) else 0.0, feedback=cfg.feedback,
                            eval_share=cfg.eval_share if is_collm(mode) else 0.0)
        self.slo = SLO.from_ms(cfg.ttft_ms, cfg.tpot_ms)
        self.carry_rounds = tc.carry_budget_rounds
        self.edges = [SimEdge(i, f"{role.replace('+', '-')}{i}", p, role, make_policy(tc), self,
                              int(edge_seeds[i].generate_state(1)[0]), self.slo, cfg.slo_safety)
                      for i, (p, role) in enumerate(zip(profiles, self.roles))]
        inter = cfg.interference
        m = inter.per_machine
        for e in self.edges:  # consecutive edges share a machine and slow each other down
            first = e.index - e.index % m
            e.neighbours = [x for x in self.edges[first:first + m] if x is not e]
            e.slowdown = inter.slowdown
            e.background_slowdown = inter.slowdown if inter.background_slowdown is None else inter.background_slowdown
            e.step_factor = 1.0 if mode == "serve-only" else 1.0 + inter.federation_slowdown
        self.serving = [e for e in self.edges if e.serves]
        self.trainers = [e for e in self.edges if e.trains]
        self.policy = router_policy(mode, cfg.collm_routing)
        r = cfg.router
        self.counter = 0
        assumptions = RoutingConfig(  # what collm-router assumes, with the sim's edge safety
            edge_slo_safety=cfg.slo_safety, probe_after_s=r.probe_after_s, pack_slack=r.pack_slack,
            pack_spare=r.pack_spare, pack_newest=r.pack_newest, pack_free_slot=r.pack_free_slot,
            drain_rate=r.drain_rate).assumptions()
        S = len(self.serving)
        self._init_columns()
        self.assumptions = [assumptions] * self.shards  # per router shard: each learns its own L from its replies
        per_router = math.ceil(S / self.shards) if S else 0  # each router polls its own edges
        self.poll_every = max(1, math.ceil(per_router / (r.max_polls_per_s * r.interval_s)))
        self.stale_after = fleet.stale_after(HealthConfig().stale_after_s, self.poll_every * r.interval_s)
        self.out: list[Served] = []
        self._tick_no = 0
        self._history: deque[tuple] = deque()  # (time, busy, train, beside, finished, met) per tick
        self._init_rounds()

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def wake_at(self, t: float, edge: int, epoch: int) -> None:
        self.push(t, WAKE, edge, epoch)

    def run(self, points: list[list[TraceRequest]], warmup_s: float, drain_s: float) -> dict:
        """Replay `points` one after another (each from when the last one's requests are done, plus
        `drain_s`) after `warmup_s`; rounds run throughout if the mode trains."""
        self.push(0.0, TICK)
        if self.trainers:
            self.push(0.0, SERVER, 0)
        t = warmup_s
        spans = []
        for pi, reqs in enumerate(points):
            self._until(t)
            start = self.now = max(self.now, t)
            tok0 = self._train_tokens()
            n_before = len(self.out)
            self._arrivals = iter(enumerate(reqs))
            self._point, self._t0 = pi, start
            self._next_arrival()
            give_up = start + (reqs[-1].arrival_s if reqs else 0.0) + 3600.0  # a request that never ends
            while len(self.out) - n_before < len(reqs) and self.now < give_up:
                if not self._pop():
                    break
            end = self.now
            spans.append({"start": start, "end": end, "train_tokens": self._train_tokens() - tok0})
            t = end + drain_s
        return {"spans": spans}

    def _next_arrival(self) -> None:
        nxt = next(self._arrivals, None)
        if nxt is not None:
            i, r = nxt
            self.push(self._t0 + r.arrival_s, ARRIVE, i, 0)
            self._pending_req = (i, r)

    def _until(self, t: float) -> None:
        while self.heap and self.heap[0][0] <= t:
            self._pop()

    def _pop(self) -> bool:
        if not self.heap:
            return False
        t, _, kind, a, b = heapq.heappop(self.heap)
        self.now = t
        if kind == WAKE:
            self.edges[a].wake(t, b)
        elif kind == ARRIVE:
            i, r = self._pending_req
            self._route(i, r, t)
            self._next_arrival()
        elif kind == TICK:
            self._tick(t)
        else:
            self.server_phase(a, t)
        return True

    # ------------------------------------------------------------------ requests
    def request_view(self, tr: TraceRequest) -> RequestView:
        """The request as the router sees it: the chat message's tokens (with the role markers) and its SLO."""
        return RequestView(tr.prompt_tokens + ROLE_MARKER_TOKENS, tr.output_tokens, self.slo.ttft_s, self.slo.tpot_s)

    def _route(self, i: int, tr: TraceRequest, now: float) -> None:
        cfg = self.cfg
        x = self.request_view(tr)
        shard = self.counter % self.shards
        c = self._columns(now, shard)
        policy = routing_policy(self.policy, cfg.router.pack_gate, self.admissions[shard], now,  # as collm-router
                                self.waiting[shard].values())
        d = fleet.choose(policy, c, x, self.rng, self.counter // self.shards, self.assumptions[shard])
        self.counter += 1
        k = self._row[d.edge]
        e = self.serving[k]
        # the edge prefills its chat template's tokens too (a trace counts the message alone)
        r = SimRequest(i, self._point, now, tr.prompt_tokens + e.p.template_tokens, tr.output_tokens, self.slo)
        shard = k % self.shards
        if cfg.router.admission and unattainable(d, self.admissions[shard].update(now, self.waiting[shard].values())):
            self._record(r, -1, "refused", None, None)
            return
        key = (r.index, r.point)
        self.waiting[shard][key] = (now, r.slo.ttft_s)  # before arriving: an idle edge may shed it at once
        if not e.arrive(r, now):
            self.waiting[shard].pop(key, None)
            self._record(r, e.index, "refused", None, None)
            self.admissions[shard].shed(now)  # the edge's 429: its queue is full
            return
        self.outstanding[k] += 1
        self.last_sent[k] = now

    def first_token(self, r: SimRequest, edge: SimEdge, now: float) -> None:
        """The edge's router relays the first token (its admission learns the TTFT; the client sees it a
        round trip after the edge measured it)."""
        k = self._row.get(edge.name)
        if k is not None:
            shard = k % self.shards
            self.waiting[shard].pop((r.index, r.point), None)
            self.admissions[shard].observe(now, now - r.arrival + self.cfg.network.rtt_s, r.slo.ttft_s)

    def finished(self, r: SimRequest, edge: SimEdge, now: float, status: str, ttft: float | None,
                 tpot: float | None) -> None:
        """`ttft`, `tpot`: as the edge measured them (the client's TTFT adds the network's round trip)."""
        k = self._row.get(edge.name)
        if k is not None:
            self.outstanding[k] -= 1
        if status != "length":
            self._record(r, edge.index, status, None, None)
            if k is not None:
                shard = k % self.shards
                self.waiting[shard].pop((r.index, r.point), None)
                if status == "expired":  # shed as late: the edge's 429
                    self.admissions[shard].shed(now)
            return
        ttft += self.cfg.network.rtt_s
        if k is not None:  # that edge's router learns the output length it relayed (collm-router's L)
            shard = k % self.shards
            a = self.assumptions[shard]
            self.assumptions[shard] = replace(a, typical_output_tokens=learn_output(a.typical_output_tokens,
                                                                                   len(r.out_ids)))
        edge.finished += 1
        ok = meets_slo(True, ttft, tpot, r.slo.ttft_s, r.slo.tpot_s)
        edge.met += ok
        self.out.append(Served(r.index, r.point, edge.index, status, ttft, tpot, r.adapter.version, ok))

    def _record(self, r: SimRequest, edge: int, status: str, ttft, tpot) -> None:
        self.out.append(Served(r.index, r.point, edge, status, ttft, tpot, -1, False))

    # ------------------------------------------------------------------ the router's view
    def _init_columns(self) -> None:
        S = len(self.serving)
        self._row = {e.name: k for k, e in enumerate(self.serving)}
        self.names = [e.name for e in self.serving]
        self.outstanding = np.zeros(S)
        self.last_sent = np.zeros(S)
        # each serving edge as the router first sees it: its limits and costs, no load yet (the same
        # declared columns the router fills from its scrapes)
        first = fleet.columns_from_views([
            EdgeView(e.name, 0, max_running=e.p.max_running, step_coef=e.p.belief(), ttft_target_s=self.slo.ttft_s,
                     tpot_target_s=self.slo.tpot_s, step_token_budget=e.p.step_token_budget,
                     slo_safety=self.cfg.slo_safety) for e in self.serving])
        self.scr = {k: getattr(first, k) for k in fleet.ROW_KEYS}
        self.scraped_at = np.full(S, -np.inf)
        self.shards = min(self.cfg.router.shards, max(S, 1))
        self._shard_rows = [np.arange(k, S, self.shards) for k in range(self.shards)]
        self._shard_names = [[self.names[j] for j in rows] for rows in self._shard_rows]
        r = self.cfg.router
        self.waiting: list[dict[tuple[int, int], tuple[float, float]]] = [{} for _ in range(self.shards)]
        self.admissions = [AdmissionController(r.admission_margin, r.admission_margin_max, r.admission_feedback)
                           for _ in range(self.shards)]

    def _columns(self, now: float, shard: int = 0) -> fleet.Columns:
        """The rule's input: the serving edges' last scrapes (older than stale_after: only the router's
        own counts), as `FleetTable.columns` gives them; with router.shards > 1, one shard's edges."""
        if self.shards > 1:
            rows = self._shard_rows[shard]
            d = {k: v[rows] for k, v in self.scr.items()}
            return self._as_columns(d, self._shard_names[shard], self.outstanding[rows],
                                    now - self.last_sent[rows], now - self.scraped_at[rows] <= self.stale_after)
        return self._as_columns(self.scr, self.names, self.outstanding.copy(), now - self.last_sent,
                                now - self.scraped_at <= self.stale_after)

    @staticmethod
    def _as_columns(d: dict, names: list[str], outstanding, unused, fresh) -> fleet.Columns:
        d = fleet.mask_stale(d, fresh)
        return fleet.Columns(names=names, outstanding=outstanding, unused=unused, **d)

    def _tick(self, now: float) -> None:
        """Telemetry windows, and the router's polls due this tick."""
        E = self.edges
        busy = np.fromiter((e.busy_s for e in E), float, len(E))
        train = np.fromiter((e.train_s for e in E), float, len(E))
        beside = np.fromiter((e.beside_s for e in E), float, len(E))
        fin = np.fromiter((e.finished for e in E), float, len(E))
        met = np.fromiter((e.met for e in E), float, len(E))
        self._history.append((now, busy, train, beside, fin, met))
        while self._history[0][0] < now - WINDOW_S:
            self._history.popleft()
        self._tick_no += 1
        if self.serving:
            k = self._tick_no % self.poll_every
            rows = range(k, len(self.serving), self.poll_every)
            w = self.window(now)
            for j in rows:
                e = self.serving[j]
                i = e.index
                d = self.scr
                d["outstanding_at"][j] = self.outstanding[j]
                d["queue"][j], d["running"][j] = len(e.waiting), len(e.running)
                d["training"][j] = w["train"][i] > 0
                d["busy"][j] = w["beside"][i] / w["span"]
                d["spare"][j] = w["spare"][i]
                d["finish_rate"][j] = w["fin"][i] / w["span"]
                d["share"][j] = w["train"][i] / w["span"]
                d["version"][j] = e.version.version
                self.scraped_at[j] = now
        self.push(now + self.cfg.router.interval_s, TICK)

    def window(self, now: float) -> dict:
        """Each edge's telemetry over the last WINDOW_S seconds (what its /metrics and load report say)."""
        t0, busy0, train0, beside0, fin0, met0 = self._history[0]
        t1, busy1, train1, beside1, fin1, met1 = self._history[-1]
        span = max(min(WINDOW_S, now - t0), 1e-6)
        fin = fin1 - fin0
        with np.errstate(invalid="ignore", divide="ignore"):
            att = np.where(fin > 0, (met1 - met0) / fin, np.nan)
        return {"span": span, "spare": np.clip(1.0 - (busy1 - busy0) / span, 0.0, 1.0), "train": train1 - train0,
                "beside": beside1 - beside0, "fin": fin, "attainment": att}

    def _train_tokens(self) -> int:
        return sum(e.train_tokens_at(self.now) for e in self.edges)
