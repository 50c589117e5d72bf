"""Which edge should serve a request? The router's rule, as pure functions over plain data.

`slo` policy. For a request x with prompt p tokens and output budget m tokens, and its targets
T (TTFT) and P (TPOT) -- the request's own `slo` override if it has one, else the edge's default
targets (`collm_slo_ttft_seconds`, `collm_slo_tpot_seconds`) -- estimate on every healthy edge e:

    n   = max(o, q + r + o - o_s)            requests on e: scraped queue q and running r, plus what
                                             this router sent since the scrape (o in flight now,
                                             o_s in flight when the scrape was sent)
    k   = min(n, M),  w = n - k              running and waiting after the correction (M = max running)
    ctx = p + m/2                            KV tokens per running sequence (x's shape as the typical one)
    t_dec(d) = c0 + c1*d + c3*d*ctx/1000     one decode step with d sequences, from the edge's online
                                             step-cost model c = collm_step_cost_seconds{term=...}
    f   = min(p, B - k)                      prefill tokens of x in one step (B: step token budget)
    t_pf = c0 + c1*k + c2*f + c3*(k*ctx + f)/1000       one step that prefills a chunk of x
    g   = 1 + b / max(1 - sigma, 0.05)  if training is active, else 1
                                             stretch of serving by co-scheduled training: wall seconds
                                             per serving second (b: fraction of the edge's window
                                             spent training while requests were running or waiting,
                                             collm_training_beside_serving_fraction; sigma: spare
                                             capacity). Training in idle time (all of it under the
                                             edge's default rule) stretches nothing: counting it made
                                             a lightly loaded edge that trains in its idle time look
                                             1/rho times slower, and the router piled requests onto
                                             whichever edge was not training at the moment
    wait = (w + 1) * max(L * t_dec(M) * g / M, max(1 - sigma, 0.05) / lam)   if n >= M, else 0
                                             x waits for w + 1 departures; by the cost model one comes
                                             every L*t_dec(M)*g/M seconds (L: typical output length of
                                             running requests), by the edge's own finished requests
                                             (collm_request_rate_rps lam, if > 0) every (1 - sigma)/lam:
                                             whichever is slower. lam counts finishes over the whole
                                             window, so per second spent serving (1 - sigma of it) it
                                             is the rate a busy edge drains its queue at; 1/lam read a
                                             burst after a calm stretch at the calm stretch's rate
                                             (2-2.5x the TTFT that followed; routing.drain_rate: window
                                             keeps that reading). sigma counts training beside serving
                                             and the loop's own time between steps as spare, so on
                                             such an edge this guard is the weaker and the cost
                                             model's term (stretched by g) the one that binds
    TTFT^ = wait + t_pf + (ceil(p / (B - k)) - 1) * t_pf * g
                                             an arrival preempts training, so only later chunks stretch
    TPOT^ = min(t_dec(k+1) * g, max(t_dec(k+1), s*P))
                                             the co-scheduler never lets training push TPOT past s*P
                                             (s: the edges' slo.safety)

    slack_e = min((T - TTFT^) / T, (P - TPOT^) / P)

    best  = max_e slack_e
    near  = {e : slack_e >= min(best - tie_margin, comfort)}
    choose  the edge of `near` with the most slack if it is alone; otherwise sample two edges of `near`
            at random and take the one with fewer requests in flight from this router (then smaller
            n, then the one that trains less, then the first sampled): power of two choices. The
            training tie-break keeps requests off a training edge when it costs nothing, e.g. at low
            load when both are empty, so it trains on; it never outweighs load.

    probe   before all that: an edge that is idle (n = 0) and has had nothing from this router for
            probe_after_s seconds, while not in `near`, gets x (the longest-idle one first).

Slack above `comfort` (default 0.5: at most half of each target used) counts as good as any: all
such edges meet the SLOs with room to spare, and spreading load over them keeps it that way. Below
it, the rule is strict: only edges within `tie_margin` of the best. The probe keeps an edge from
being starved by a stale estimate: its cost model only learns from the steps it runs, so an edge
whose coefficients were fit while it was overloaded would otherwise look slow forever once idle
(seen in benchmarks/bench_router.py). An idle edge serves a probe at its bare step cost.

Admission (`unattainable`, routing.admission): when even the soonest edge's TTFT^ is past the
request's target times a margin (routing.admission_margin; with admission_margin_max above it, the
margin follows the first tokens the router relays: router/admission.py), the router answers 429
(Retry-After) instead of sending it to be served late:
past capacity, a late answer is a miss that also delays the requests behind it. A request that
asks for best effort (`"best_effort": true`, or the X-CoLLM-Best-Effort header) is always routed.

The router runs this rule in columnar form (`collm.router.fleet`: the same decisions, tested on
random snapshots) so that one decision stays well under a millisecond at 1,000 edges; the
functions here are the readable reference.

`slo_pack` policy (the default): the same rule, but near-ties with at least `pack_slack` slack (and
`pack_spare` spare capacity) go to the one with the most requests, so a light load gathers on few
edges and the others train in idle time, where training costs serving nothing; while the router's
measured TTFT slack (`admission.AdmissionController.slack`) is below `pack_gate`, it spreads as `slo`
(`policy_now`): a burst that lands on a gathered edge costs more than gathering gains. With `pack_newest`
the gathering goes to the edge serving the newest global adapter first: after a round the edge that trained
evaluates and swaps first, takes the light load, and the other drains and evaluates in its idle time
instead of behind its traffic (so the new version serves sooner and the round ends sooner). Measured
(docs/benchmarks.md, 2026-12-05): 1.6-2.0x slo's training tokens at 0.3-0.5 x C at 0.99-1.00x
serve-only's goodput.

Baselines (the same interface): `round_robin` cycles through the healthy edges; `least_outstanding`
takes the edge with the fewest requests in flight from this router (random among equals).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from collm.common.step_cost import step_seconds

POLICIES = ("slo", "slo_pack", "round_robin", "least_outstanding")


@dataclass(frozen=True)
class EdgeView:
    """What the rule knows about one edge: its last scrape (or defaults) and the router's own counts."""

    name: str
    outstanding: int  # o: requests this router has in flight there now
    outstanding_at: int = 0  # o_s: ... when the last scrape used here was sent (a Scrape's name)
    queue_depth: float | None = None  # q (None: no fresh scrape; then only o counts)
    running: float | None = None  # r
    max_running: float = 16  # M
    step_coef: tuple[float, float, float, float] = (0.01, 0.01, 0.002, 0.001)  # c0..c3
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.2
    training_active: bool = False
    training_busy: float = 0.0  # b
    spare_capacity: float = 1.0  # sigma
    finish_rate: float = 0.0  # lam: finished requests per second over the edge's window
    unused_s: float = 0.0  # seconds since this router last sent the edge a request
    step_token_budget: float | None = None  # B as the edge exports it (None: Assumptions' value)
    slo_safety: float | None = None  # s as the edge exports it (None: Assumptions' value)
    training_share: float = 0.0  # fraction of the window spent training, idle time included (a tie-break)
    adapter_version: float | None = None  # the global adapter version it serves (None: unknown; slo_pack's pack_newest)


# The rule's input, declared once. Each column of `fleet.Columns` and the EdgeView field it holds (a
# router `state.Scrape` has the same fields, so a scrape, a view and a simulated edge all fill a row
# through this table); step_coef is four columns, c0..c3.
COLUMN_FIELDS = {"outstanding_at": "outstanding_at", "queue": "queue_depth", "running": "running",
                 "max_running": "max_running", "ttft_target": "ttft_target_s", "tpot_target": "tpot_target_s",
                 "training": "training_active", "busy": "training_busy", "spare": "spare_capacity",
                 "finish_rate": "finish_rate", "budget": "step_token_budget", "safety": "slo_safety",
                 "share": "training_share", "version": "adapter_version"}
# What a scrape says about the edge's load at the time: a stale scrape drops these (the router then
# counts only its own requests in flight there) and keeps the rest, the edge's limits and costs. The
# served version goes with them: an edge whose scrapes stopped must not draw the gathered load by it.
LOAD_FIELDS = ("outstanding_at", "queue_depth", "running", "training_active", "training_busy", "spare_capacity",
               "finish_rate", "training_share", "adapter_version")


@dataclass(frozen=True)
class RequestView:
    prompt_tokens: int  # p (estimated by the router)
    max_tokens: int  # m
    ttft_target_s: float | None = None  # the request's `slo` override, if any
    tpot_target_s: float | None = None
    best_effort: bool = False  # route it even if no edge can meet its TTFT target


@dataclass(frozen=True)
class Assumptions:
    """What the rule assumes about an edge until it exports its own values (older edges never do)."""

    step_token_budget: int = 256  # B
    slo_safety: float = 0.8  # s
    typical_output_tokens: float = 64.0  # L
    tie_margin: float = 0.05
    comfort: float = 0.5
    pack_slack: float = 0.4   # slo_pack: gather requests only on edges with at least this slack ...
    pack_spare: float = 0.0   # ... and at least this spare capacity (not serving) over their window
    pack_newest: bool = True  # ... to the newest adapter version first (then the most requests)
    pack_free_slot: bool = True  # ... and only onto an edge where x runs at once (n < M), never into its queue
    probe_after_s: float = float("inf")
    drain_per_serving_s: bool = True  # the finish-rate guard per second spent serving (False: over the whole window)


@dataclass(frozen=True)
class Estimate:
    edge: str
    load: float  # n
    ttft_s: float
    tpot_s: float
    ttft_target_s: float
    tpot_target_s: float

    @property
    def slack(self) -> float:
        s = min((self.ttft_target_s - self.ttft_s) / self.ttft_target_s,
                (self.tpot_target_s - self.tpot_s) / self.tpot_target_s)
        return s if math.isfinite(s) else -math.inf  # an estimate from broken inputs ranks last


@dataclass(frozen=True)
class Decision:
    edge: str
    estimate: Estimate | None  # None for the baselines
    why: str  # "best" | "p2c among N" | "round_robin" | "least_outstanding" ...
    soonest: Estimate | None = None  # slo policy: the edge that would give x its first token soonest


OUTPUT_LEARN_WEIGHT = 0.1  # each finished request's weight in L, the typical output length
MAX_LEARNED_OUTPUT = 1_000_000  # output tokens past any edge's context: a count above it is not learned


def learn_output(typical: float, tokens: int | None) -> float:
    """L after a request finished with `tokens` output tokens: a moving average from the configured prior.

    The wait term counts L tokens per departure; a prior four times the traffic's outputs made the
    cost model's term four times too slow. collm-router and collm-sim both learn L here. The count is an
    edge's word: one outside (0, MAX_LEARNED_OUTPUT] is not learned (a 300-digit one overflowed, a 1e300 one
    made every later estimate refuse)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 < tokens <= MAX_LEARNED_OUTPUT:
        return typical
    return (1 - OUTPUT_LEARN_WEIGHT) * typical + OUTPUT_LEARN_WEIGHT * tokens


def unattainable(d: Decision, margin: float = 1.0) -> bool:
    """Admission: no edge's estimated TTFT is within `margin` times the request's target (the
    router answers 429).

    Only the TTFT is judged: it is what a queue destroys, and a request refused now can retry
    elsewhere or later; the TPOT estimate is left to the edges' own co-execution rule."""
    return d.soonest is not None and d.soonest.ttft_s > margin * d.soonest.ttft_target_s


def edge_load(e: EdgeView) -> float:
    """n: requests on the edge, the scrape corrected by what this router sent since."""
    if e.queue_depth is None or e.running is None:
        return float(e.outstanding)
    return max(float(e.outstanding), e.queue_depth + e.running + e.outstanding - e.outstanding_at)


def estimate(e: EdgeView, x: RequestView, a: Assumptions = Assumptions()) -> Estimate:
    """TTFT^ and TPOT^ of request x on edge e (the formulas of the module docstring)."""
    M = max(1.0, float(e.max_running))
    B = e.step_token_budget or a.step_token_budget
    n = edge_load(e)
    k = min(n, M)
    w = n - k
    p = max(1, x.prompt_tokens)
    ctx = p + x.max_tokens / 2

    def t_dec(d: float) -> float:
        return step_seconds(e.step_coef, d, 0, d * ctx)

    chunk = max(1.0, B - k)
    f = min(p, chunk)
    t_pf = step_seconds(e.step_coef, k, f, k * ctx + f)
    g = 1.0 + e.training_busy / max(1.0 - e.spare_capacity, 0.05) if e.training_active else 1.0
    departure = a.typical_output_tokens * t_dec(M) * g / M
    if e.finish_rate > 0:
        serving = max(1.0 - e.spare_capacity, 0.05) if a.drain_per_serving_s else 1.0
        departure = max(departure, serving / e.finish_rate)
    wait = (w + 1) * departure if n >= M else 0.0
    ttft = wait + t_pf + (math.ceil(p / chunk) - 1) * t_pf * g
    T = x.ttft_target_s or e.ttft_target_s
    P = x.tpot_target_s or e.tpot_target_s
    bare = t_dec(min(k + 1, M))
    tpot = min(bare * g, max(bare, (e.slo_safety or a.slo_safety) * P))
    return Estimate(e.name, n, ttft, tpot, T, P)


def choose_slo(edges: list[EdgeView], x: RequestView, rng: random.Random,
               a: Assumptions = Assumptions(), pack: bool = False) -> Decision:
    """The `slo` policy: most normalised SLO slack, near-ties by power of two choices. `pack` (the
    `slo_pack` policy): near-ties with at least `pack_slack` slack and `pack_spare` spare capacity go
    to the one serving the newest adapter version (`pack_newest`), then the one with the most requests
    (then the one that trains less, then the first), with `pack_free_slot` only where x gets a running
    slot at once (a request queued behind a full batch waits while another edge has room), so a
    light load gathers on few edges and the others train in idle time, where a unit costs serving
    nothing (and a busier edge batches its decodes better); once no near edge has that much room the
    load spreads by power of two choices again."""
    if not edges:
        raise ValueError("no edge to choose from")
    ests = {e.name: estimate(e, x, a) for e in edges}
    slack = {name: est.slack for name, est in ests.items()}
    best = max(slack.values())
    near = [e for e in edges if slack[e.name] >= min(best - a.tie_margin, a.comfort)] or list(edges)
    near_names = {e.name for e in near}
    starved = [e for e in edges if e.name not in near_names and ests[e.name].load == 0
               and e.unused_s >= a.probe_after_s]
    soonest = min(ests.values(), key=lambda est: est.ttft_s)
    if starved:
        pick = max(starved, key=lambda e: e.unused_s)
        return Decision(pick.name, ests[pick.name], "probe", soonest)
    if len(near) == 1:
        return Decision(near[0].name, ests[near[0].name], "best", soonest)
    roomy = [e for e in near if slack[e.name] >= a.pack_slack and e.spare_capacity >= a.pack_spare
             and not (a.pack_free_slot and ests[e.name].load >= max(1.0, e.max_running))] if pack else []
    if roomy:  # the first of equals
        pick = max(roomy, key=lambda e: (_version(e) if a.pack_newest else 0.0, ests[e.name].load, -e.training_share))
        return Decision(pick.name, ests[pick.name], f"pack among {len(roomy)}", soonest)
    i, j = rng.sample(range(len(near)), 2)
    one, two = near[i], near[j]
    pick = min((one, two), key=lambda e: (e.outstanding, ests[e.name].load, e.training_share))
    return Decision(pick.name, ests[pick.name], f"p2c among {len(near)}", soonest)


def _version(e: EdgeView) -> float:
    """The edge's served version for pack_newest; unknown ranks below every known one."""
    v = e.adapter_version
    return -math.inf if v is None or not math.isfinite(v) else float(v)


def policy_now(policy: str, measured_slack: float | None, pack_gate: float | None) -> str:
    """The rule to route by now. `slo_pack` with a `pack_gate` (routing.pack_gate) gathers only while the
    router's measured TTFT slack (`admission.AdmissionController.slack`: 1 - the 0.9 quantile of TTFT /
    target over its recent first tokens and waits) is at least the gate, and spreads as `slo` below it.
    Why: gathering trains more in light load for ~1% of goodput, but a burst that lands on the gathered
    edge costs far more (-12% in one pass at 0.8 x C, docs/pack-ab-2026-12-05); the estimates cannot see
    a burst coming, the first tokens show one within a few seconds. No evidence yet (too few first
    tokens: light load): gather."""
    if policy != "slo_pack" or pack_gate is None or measured_slack is None or measured_slack >= pack_gate:
        return policy
    return "slo"


def choose_round_robin(edges: list[EdgeView], counter: int) -> Decision:
    return Decision(edges[counter % len(edges)].name, None, "round_robin")


def choose_least_outstanding(edges: list[EdgeView], rng: random.Random) -> Decision:
    low = min(e.outstanding for e in edges)
    pick = rng.choice([e for e in edges if e.outstanding == low])
    return Decision(pick.name, None, "least_outstanding")


RULES: dict[str, Callable[[list[EdgeView], RequestView, random.Random, int, Assumptions], Decision]] = {
    "slo": lambda edges, x, rng, counter, a: choose_slo(edges, x, rng, a),
    "slo_pack": lambda edges, x, rng, counter, a: choose_slo(edges, x, rng, a, pack=True),
    "round_robin": lambda edges, x, rng, counter, a: choose_round_robin(edges, counter),
    "least_outstanding": lambda edges, x, rng, counter, a: choose_least_outstanding(edges, rng),
}  # one rule per `routing.policy` (POLICIES), in the same order


def choose(policy: str, edges: list[EdgeView], x: RequestView, rng: random.Random, counter: int = 0,
           a: Assumptions = Assumptions()) -> Decision:
    """The configured policy's rule (`RULES`); `edges` are the routable ones, in config order."""
    if not edges:
        raise ValueError("no edge to choose from")
    if policy not in RULES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return RULES[policy](edges, x, rng, counter, a)
