r"""The long-timescale workload balancer: how many training tokens each edge gets this round.

A pure function over plain data: `balance(reports, params) -> decisions`. No Flower, no I/O.
The strategy picks the rule by `balancer.mode` from `BALANCERS` (`uniform` is the baseline).

Objective: the largest expected quality gain per round from the capacity the edges' inference
traffic leaves spare. An edge trains only in time its serving does not need (its co-execution
rule, `edge_client/engine/co_schedule.py`), so the balancer sizes each edge's share by that spare
time; with `target_attainment` set, an edge below it also sits the round out (for edges whose
co-execution is not work-conserving).

For edge i the report gives: request rate λ_i, SLO attainment A_i (None: nothing completed yet),
spare capacity s_i ∈ [0, 1] (fraction of time not serving), queue depth q_i, local training
examples n_i, last quality gain per 1k training tokens g_i (None: unknown), idle training
throughput c_i (tokens/s), k_i, tokens it already trained since its last update (its carry
between rounds, `training.carry_between_rounds`), which its next update sends, and its budget fill
f_i (below). Spare time s_i is time not in serving steps: under the co-execution controller that
includes what training takes beside decodes, so the cap already follows how much slack an edge has. With target attainment A*, round deadline D, round token budget B,
spare-use fraction u and minimum share m:

    eligible_i  =  n_i > 0  and  (A* unset  or  A_i is None  or  A_i ≥ A*)

    cap_i       =  k_i + c_i · s_i · u · D / (1 + q_i)    tokens the edge has carried plus what it
                                                          can train in its spare time before the
                                                          deadline; a waiting queue shrinks that

    ḡ           =  mean of the known g_j (eligible edges), or 1.0 if none is known
    ĝ_i         =  max(g_i if known else ḡ,  ε · ḡ⁺)       ḡ⁺ = mean of max(g_j, 0), or 1.0 if 0;
                                                          ε = 0.01: a plateaued edge still gets some
    w_i         =  ĝ_i · n_i

    maximise    Σ_i w_i · log x_i     subject to   0 ≤ x_i ≤ cap_i,   Σ_i x_i ≤ B

The log makes the gain of each edge concave in its tokens (diminishing returns), so the optimum
spreads the budget in proportion to weight. Its solution is water-filling:

    x_i  =  min(cap_i, θ · w_i)       θ chosen so that   Σ_i x_i = min(B, Σ_i cap_i)

An edge whose x_i < m sits the round out; the water-filling is then solved again without it (its
tokens go to the others), until every remaining edge gets at least m. With `fill_budget` (the
server's default), what the caps leave of B, B - Σ x_i, is then handed out in proportion to w_i
among the edges that kept up last round (budget fill f_i = tokens trained / budget ≥ 0.99, or
unknown): a cap is only an estimate from a window of load, and an edge that reaches its budget
stops training with spare time left, while one that could not train its last budget would only
carry more of it past the deadline (it reports f_i < 1 and gets its cap, no more). Every
participant gets budget ⌊x_i⌋ tokens and the same deadline D.

Partial participation (`fraction_train` < 1): before the rule above, `choose_participants` keeps
k of the N edges that reported, k = max(⌊N · fraction⌋, min_train_nodes): first the edges that can
take part (data, and a cap of at least m tokens), among them those that trained least recently
(never first), then the largest expected gain ĝ_i · cap_i. The least-recent order rotates
participation, so over rounds every edge's non-IID data reaches the global; the cap keeps a slot
from going to an edge too busy to use it. This is a load-aware choice, not a random sample (which
matters for differential privacy: no sampling amplification is claimed, `collm.server.privacy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from collm.common.protocol import LoadReport

GAIN_FLOOR_FRACTION = 0.01  # ε above
KEPT_UP = 0.99  # budget fill at or above which an edge kept up with its last budget


@dataclass(frozen=True)
class BalancerParams:
    """The rule's parameters (the server config's `balancer:` section, `balancer_params`)."""

    target_attainment: float | None  # A* (None: no attainment gate)
    round_deadline_s: float          # D
    round_token_budget: int          # B
    min_edge_tokens: int             # m
    spare_use: float                 # u
    fill_budget: bool                # hand out B - Σ x_i by weight (see the module docstring)


def balancer_params(cfg) -> BalancerParams:
    """The parameters a `server.config.BalancerConfig` sets, field by field (the strategy and collm-sim)."""
    return BalancerParams(**{f.name: getattr(cfg, f.name) for f in fields(BalancerParams)})


@dataclass(frozen=True)
class Decision:
    """What one edge is asked to do this round, and why (one line, for the log)."""

    name: str
    take_part: bool
    budget_tokens: int
    deadline_s: float
    reason: str
    cap_tokens: float = 0.0
    weight: float = 0.0


def capacity(r: LoadReport, p: BalancerParams) -> float:
    """cap_i = k_i + c_i · s_i · u · D / (1 + q_i): tokens carried plus trainable in spare time before the deadline."""
    spare = min(max(r.spare_capacity, 0.0), 1.0)
    tokens_in_spare_time = max(r.train_tokens_per_s, 0.0) * spare * p.spare_use * p.round_deadline_s
    return max(r.carried_tokens, 0) + tokens_in_spare_time / (1.0 + max(r.queue_depth, 0.0))


def gain_estimates(reports: list[LoadReport]) -> dict[str, float]:
    """ĝ_i: the reported gain, or the mean of the known ones, floored at ε · ḡ⁺."""
    known = [r.gain_per_ktok for r in reports if r.gain_per_ktok is not None]
    mean = sum(known) / len(known) if known else 1.0
    positive = sum(max(g, 0.0) for g in known) / len(known) if known else 1.0
    floor = GAIN_FLOOR_FRACTION * (positive if positive > 0 else 1.0)
    return {r.name: max(mean if r.gain_per_ktok is None else r.gain_per_ktok, floor) for r in reports}


def water_fill(weights: dict[str, float], caps: dict[str, float], budget: float) -> dict[str, float]:
    """argmax Σ w_i log x_i s.t. 0 ≤ x_i ≤ cap_i, Σ x_i ≤ budget:  x_i = min(cap_i, θ w_i).

    Edges are saturated in increasing order of cap_i / w_i while that ratio is below the level
    θ = (tokens left) / (weight left) of the unsaturated ones; the rest get θ · w_i.
    """
    x = {k: 0.0 for k in weights}
    active = [k for k in weights if weights[k] > 0 and caps[k] > 0]
    left = min(float(budget), sum(caps[k] for k in active))
    weight_left = sum(weights[k] for k in active)
    for k in sorted(active, key=lambda k: caps[k] / weights[k]):
        theta = left / weight_left
        if caps[k] <= theta * weights[k]:
            x[k] = caps[k]
        else:
            x[k] = theta * weights[k]
        left -= x[k]
        weight_left -= weights[k]
    return x


def balance(reports: list[LoadReport], p: BalancerParams) -> list[Decision]:
    """One decision per report, in the same order (see the module docstring for the rule)."""
    reasons: dict[str, str] = {}
    eligible = []
    for r in reports:
        if r.train_examples <= 0:
            reasons[r.name] = "no local training examples"
        elif (p.target_attainment is not None and r.slo_attainment is not None
              and r.slo_attainment < p.target_attainment):
            reasons[r.name] = f"below SLO target: attainment {r.slo_attainment:.2f} < {p.target_attainment:.2f}"
        else:
            eligible.append(r)

    caps = {r.name: capacity(r, p) for r in eligible}
    gains = gain_estimates(eligible)
    weights = {r.name: gains[r.name] * r.train_examples for r in eligible}
    for r in eligible:
        if caps[r.name] <= 0:
            reasons[r.name] = (f"no spare capacity: spare {r.spare_capacity:.2f}, "
                               f"{r.train_tokens_per_s:g} tok/s idle → cap 0 tokens")

    # water-fill; drop the smallest share below the minimum and solve again until none is left
    taking = {r.name for r in eligible if caps[r.name] > 0}
    while True:
        x = water_fill({k: weights[k] for k in taking}, {k: caps[k] for k in taking}, p.round_token_budget)
        small = [k for k in taking if x[k] < p.min_edge_tokens]
        if not small:
            break
        k = min(small, key=lambda k: x[k])
        reasons[k] = f"share {x[k]:.0f} < minimum {p.min_edge_tokens} tokens (cap {caps[k]:.0f})"
        taking.discard(k)

    left = p.round_token_budget - sum(x[k] for k in taking)
    fill = {r.name: r.budget_fill for r in eligible}
    kept_up = {k for k in taking if fill[k] is None or fill[k] >= KEPT_UP}
    weight_up = sum(weights[k] for k in kept_up)
    extra = {k: (left * weights[k] / weight_up if p.fill_budget and left > 0 and k in kept_up and weight_up > 0
                 else 0.0) for k in taking}

    decisions = []
    for r in reports:
        name = r.name
        if name not in taking:
            decisions.append(Decision(name, False, 0, 0.0, reasons[name],
                                      caps.get(name, 0.0), weights.get(name, 0.0)))
            continue
        tokens = int(x[name] + extra[name])
        if x[name] >= caps[name] - 1e-9:
            why = (f"capacity-bound: spare {r.spare_capacity:.2f}, queue {r.queue_depth:g} "
                   f"→ cap {caps[name]:.0f} tokens")
            if r.carried_tokens > 0:
                why += f" ({r.carried_tokens} carried)"
        else:
            why = (f"share of budget: weight {weights[name]:.3g} (gain {gains[name]:.3g} × "
                   f"{r.train_examples} examples), cap {caps[name]:.0f}")
        if extra[name]:
            why += f", + {extra[name]:.0f} of the budget the caps left"
        elif p.fill_budget and left > 0 and name not in kept_up:
            why += f"; trained {fill[name]:.0%} of its last budget, so none of the budget the caps left"
        if r.train_share > 0:
            why += f"; trains beside serving at {r.train_share:.2f} s/s"
        decisions.append(Decision(name, True, tokens, float(p.round_deadline_s), f"{tokens} tokens; {why}",
                                  caps[name], weights[name]))
    return decisions


@dataclass(frozen=True)
class PlannedEdge:
    """One edge asked in a round: its node, the decision about it, and the load report it was made from."""

    node_id: int
    decision: Decision
    report: LoadReport | None


def plan_round(node_ids: list[int], reports: Mapping[int, LoadReport], no_report: Mapping[int, str],
               decisions: Mapping[str, Decision], known_names: Mapping[int, str]) -> list[PlannedEdge]:
    """Every edge asked, in the order asked, with its decision: the balancer's for an edge that reported
    (`decisions`, by name), a sit-out naming why for one that did not."""
    out = []
    for nid in node_ids:
        if nid in no_report:
            name = known_names.get(nid, f"node-{nid}")
            out.append(PlannedEdge(nid, Decision(name, False, 0, 0.0, no_report[nid]), None))
        else:
            out.append(PlannedEdge(nid, decisions[reports[nid].name], reports[nid]))
    return out


def participants_wanted(available: int, fraction: float, min_nodes: int) -> int:
    """k = max(⌊N · fraction⌋, min_nodes), at most N (Flower's count for fraction_train)."""
    return min(available, max(int(available * fraction), min_nodes))


def choose_participants(reports: list[LoadReport], p: BalancerParams, k: int,
                        last_took_part: Mapping[str, int]) -> tuple[list[LoadReport], dict[str, str]]:
    """The k reports that take part this round (in their order) and why each other edge does not.

    `last_took_part`: edge -> the last round it was sent a TRAIN message (missing: never)."""
    if k >= len(reports):
        return list(reports), {}
    caps = {r.name: capacity(r, p) for r in reports}
    gains = gain_estimates(reports)

    def able(r: LoadReport) -> bool:
        return r.train_examples > 0 and caps[r.name] > 0 and caps[r.name] >= p.min_edge_tokens

    order = sorted(reports, key=lambda r: (not able(r), last_took_part.get(r.name, -1),
                                           -caps[r.name] * gains[r.name], r.name))
    chosen = {r.name for r in order[:k]}
    left_out = {}
    for r in order[k:]:
        last = last_took_part.get(r.name)
        left_out[r.name] = (f"not chosen: {k} of {len(reports)} edges train this round (fraction_train); "
                            f"trained last {'never' if last is None else f'in round {last}'}, "
                            f"cap {caps[r.name]:.0f} tokens")
    return [r for r in reports if r.name in chosen], left_out


def uniform(reports: list[LoadReport], p: BalancerParams) -> list[Decision]:
    """The baseline without a balancer: every edge with data trains B/N tokens, load ignored."""
    with_data = [r for r in reports if r.train_examples > 0]
    share = p.round_token_budget // max(len(with_data), 1)
    return [Decision(r.name, r.train_examples > 0, share if r.train_examples > 0 else 0, p.round_deadline_s,
                     "uniform share (balancer off)" if r.train_examples > 0 else "no local training examples")
            for r in reports]


BALANCERS: dict[str, Callable[[list[LoadReport], BalancerParams], list[Decision]]] = {
    "slo": balance, "uniform": uniform}
