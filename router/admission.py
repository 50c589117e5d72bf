"""How strict is admission now? The router's admission margin, set from the first tokens it relays.

Admission (`policy.unattainable`) refuses a request when even the soonest edge's estimated TTFT is past
`margin` times its target. No fixed margin is right at every load (docs/benchmarks.md, the margin A/B):
below capacity the estimate is pessimistic inside short spikes, and a margin of 1 refused 5% of the
requests that would have met their SLOs (a margin of 2 served them all); past capacity the short queue
that a margin of 1 keeps is worth 13% more goodput than a margin of 2. What tells the two apart is what
the admitted requests actually got: below capacity their first tokens come with room to spare, past it
they come near or past their targets.

So `AdmissionController` moves the margin between `admission_margin` (the tightest) and
`admission_margin_max` from measured first tokens, the shape of the edges' co-execution controller
(`edge_client/engine/controller.py`): every `period_s` it takes the `quantile` of TTFT / target over
the first tokens of the last `window_s` seconds, slack s = 1 - that;

* s below `slack_low` (the defaults: more than 10% of recent first tokens took over 90% of their
  target): the margin drops to its tightest at once and may not grow for `cool_s` (a queue is
  building, and refusing is what keeps it short);
* s above `slack_high` (under 80%): the margin grows by `step` (loosening is slow, tightening immediate);
* in between, or fewer than `min_requests` fresh first tokens (no evidence): it holds.

Streams the router has sent that have no first token yet count too, by their wait so far (a lower
bound of their TTFT), so a queue that builds shows before its first tokens come late.

A request an edge turned away for its load (429 `queue_full`, or `slo_unattainable`: it waited past its
TTFT target and was shed; not an edge's per-key rate limit) counts as a first token at `SHED_RATIO` times its target: it is
the lateness a queue causes, and an edge that sheds produces no first token to show it. Requests the
router itself refused teach it nothing, so a router that refuses everything cannot talk itself looser;
an idle router keeps the margin it had. The slack is measured even with a fixed margin: it is also what
opens and closes slo_pack's gathering (routing.pack_gate, `policy.policy_now`). Pure and clock-free:
collm-router and collm-sim feed it the same observations and judge by what `update` returns.

Measured (docs/benchmarks.md, 2026-12-05): against a fixed margin of 1 in the same run, a tie on the
steady trace at 0.8, 1.0 and 1.5 x C and 1.03x goodput under bursts (half the refusals, none late).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from collm.common.stats import percentile
from collm.router.config import AdmissionFeedback
from collm.router.policy import policy_now

SHED_RATIO = 2.0  # an edge's 429 after admission counts as a first token at twice its target (a late one)


def routing_policy(policy: str, pack_gate: float | None, admission: AdmissionController, now: float | None = None,
                   waiting: Iterable[tuple[float, float]] = ()) -> str:
    """The rule to route by now (`policy.policy_now` over `admission`'s measured slack): for a gated slo_pack,
    with `now`, the slack is measured first (at most once a period). collm-router and collm-sim both ask here."""
    if now is not None and policy == "slo_pack" and pack_gate is not None:
        admission.update(now, waiting)
    return policy_now(policy, admission.slack, pack_gate)


class AdmissionController:
    """The admission margin from measured TTFT slack: additive loosening, an immediate cut to the tightest."""

    def __init__(self, lo: float = 1.0, hi: float | None = None, feedback: AdmissionFeedback | None = None,
                 max_samples: int = 100_000):
        """`lo`, `hi`: routing.admission_margin and admission_margin_max (None: a fixed margin); `feedback`:
        routing.admission_feedback. collm-router and collm-sim both build it from those settings."""
        self.lo, self.hi = lo, lo if hi is None else max(lo, hi)
        f = feedback or AdmissionFeedback()
        self.period_s, self.window_s, self.min_requests = f.period_s, f.window_s, f.min_requests
        self.quantile, self.slack_low, self.slack_high, self.step = f.quantile, f.slack_low, f.slack_high, f.step
        self.cool_s = f.cool_s
        self._hold_until = -math.inf
        self.margin = lo
        self.slack: float | None = None  # the last measured slack (None: no evidence)
        self.action = "start"  # what the last period did: up | cut | hold | no-evidence | fixed
        self._seen: deque[tuple[float, float]] = deque(maxlen=max_samples)  # pruned by age; the cap bounds memory
        self._tick_at: float | None = None

    @property
    def adaptive(self) -> bool:
        return self.hi > self.lo

    def observe(self, now: float, ttft_s: float, ttft_target_s: float) -> None:
        """A first token relayed at `now`, `ttft_s` after the request was sent, against its own target."""
        if ttft_target_s > 0 and math.isfinite(ttft_s) and ttft_s >= 0:
            self._add(now, ttft_s / ttft_target_s)

    def shed(self, now: float) -> None:
        """An edge answered 429 for its load: its queue was full, or the request was shed as late."""
        self._add(now, SHED_RATIO)

    def _add(self, now: float, ratio: float) -> None:
        self._prune(now)  # also here: with a fixed margin and no gate, nothing may ever call update
        self._seen.append((now, ratio))

    def _prune(self, now: float) -> None:
        while self._seen and now - self._seen[0][0] > self.window_s:
            self._seen.popleft()

    def update(self, now: float, waiting: Iterable[tuple[float, float]] = ()) -> float:
        """The margin to judge a request by at `now` (adjusted at most once a period). `waiting`: (sent at,
        TTFT target) of the requests sent and still without a first token; each counts by its wait so far
        (a lower bound of its TTFT), so a queue that builds shows before its first tokens come late.
        The slack is measured with a fixed margin too: routing.pack_gate reads it (`policy.policy_now`)."""
        if self._tick_at is not None and now - self._tick_at < self.period_s:
            return self.margin
        self._tick_at = now
        self._prune(now)
        fresh = [r for _, r in self._seen]
        # a wait counts as at most a shed request: one stuck entry must not hold the margin down forever
        fresh += [min((now - t) / target, SHED_RATIO) for t, target in waiting if target > 0]
        if len(fresh) < self.min_requests:
            self.slack, self.action = None, "no-evidence" if self.adaptive else "fixed"
            return self.margin
        self.slack = s = 1.0 - percentile(fresh, self.quantile)
        if not self.adaptive:
            self.action = "fixed"
        elif s < self.slack_low:
            self.margin, self.action = self.lo, "cut"
            self._hold_until = now + self.cool_s
        elif s > self.slack_high and now >= self._hold_until:
            self.margin, self.action = min(self.hi, self.margin + self.step), "up"
        else:
            self.action = "hold"
        return self.margin
