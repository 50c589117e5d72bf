"""When may a training (or evaluation) micro-batch run without costing any request its SLO?

The rule, evaluated by the engine after every serving step. A micro-batch predicted to take
`tau` seconds runs only if `tau <= allowance`, where `allowance` is the minimum over:

* every decoding request i (first token at f_i, g_i tokens out so far, TPOT target P_i):
      a_i = s * P_i * g_i - (now - f_i) - t_step
  i.e. even if i stops right after its next token, which would come after the micro-batch and
  one more step, its time per output token (now + tau + t_step - f_i) / g_i stays <= s * P_i;
* every request still before its first token j (arrived a_j, TTFT target T_j):
      a_j = s * T_j - (now - a_j) - ceil((ahead_j + left_j) / B) * t_step
  where ahead_j + left_j is the prompt work queued up to and including j and B the step token
  budget: its first token, delayed by the micro-batch, still comes within s * T_j;
* a request that may arrive during the micro-batch (default TTFT target T, typical prompt p).
  Background passes are preemptible at decoder-layer boundaries (`preemption`), so an arrival
  waits for at most one of the model's n_layers layers of background work, tau / n_layers:
      a_new = n_layers * (s * T - t_prefill(p) - t_step)

`s` is the safety factor (slo.safety). `t_step` and `t_prefill` come from the online cost model.
While it runs, the micro-batch is preempted if a request arrives or `allowance` seconds pass,
so a wrong cost prediction cannot take more than the slack it was given.

Which micro-batch: the largest option whose predicted time fits both the allowance and the
expected gap to the next arrival (1 / arrival rate), so it is unlikely to be preempted; if only
the arrival gap is too short, the smallest option that fits the allowance (preemption bounds the
cost of guessing wrong); if nothing fits the allowance, the job waits.
With no requests at all only `a_new` applies, so an idle replica trains back to back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSlack:
    """What the rule needs to know about one admitted or waiting request (times in seconds)."""

    arrival: float
    first_token_at: float | None
    tokens_out: int
    ttft_slo: float
    tpot_slo: float
    prefill_left: int  # prompt tokens not yet run through the model


@dataclass(frozen=True)
class Allowance:
    seconds: float
    binding: str  # which constraint set it (for telemetry and logs)


def allowance(now: float, requests: list[RequestSlack], *, step_s: float, step_token_budget: int,
              default_ttft_slo: float, new_arrival_prefill_s: float, safety: float,
              n_layers: int = 1) -> Allowance:
    """How long background work may hold the replica right now (see the module docstring)."""
    best = Allowance(n_layers * (safety * default_ttft_slo - new_arrival_prefill_s - step_s), "new-arrival")
    ahead = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        if r.first_token_at is not None:
            a = safety * r.tpot_slo * max(r.tokens_out, 1) - (now - r.first_token_at) - step_s
            why = "tpot"
        else:
            ahead += r.prefill_left
            steps = max(1, math.ceil(ahead / step_token_budget))
            a = safety * r.ttft_slo - (now - r.arrival) - steps * step_s
            why = "ttft"
        if a < best.seconds:
            best = Allowance(a, why)
    return best


def pick_microbatch(options: list[tuple[object, float]], allowance_s: float,
                    arrival_gap_s: float = float("inf")) -> object | None:
    """Choose among (option, predicted seconds), given most preferred first (see module docstring)."""
    fitting = [(o, t) for o, t in options if t <= allowance_s]
    if not fitting:
        return None
    for o, t in fitting:
        if t <= arrival_gap_s:
            return o
    return min(fitting, key=lambda ot: ot[1])[0]
