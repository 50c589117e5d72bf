"""One replica core for the engine and the simulator: the same events give the same decisions.

A real tiny-model engine runs its loop pass by pass on a virtual clock that a step advances by a
fixed 50 ms and a training unit by 20 ms (the forward and the unit really run; only the time they
take is fixed), and its cost model predicts the same constants. The simulator runs one `SimEdge` on
a profile with those costs. Both get the same arrivals and one long training job; the replica core
in each writes down every decision (sheds, admissions, steps, verdicts with their reasons, request
ends, job starts), and the two lists must be the same. Idle-time verdicts are left out: the engine
asks once per unit, the simulator once per stretch of units (its exact fast-forward: the rule always
admits idle work, and they change no state).
"""

from __future__ import annotations

import heapq

import pytest
from helpers import tiny_config

from collm.common.slo import SLO
from collm.edge_client.engine import Engine
from collm.edge_client.engine.co_schedule import make_policy
from collm.edge_client.engine.cost_model import FixedCosts
from collm.edge_client.engine.requests import FinishEvent
from collm.edge_client.model.loading import load_model
from collm.edge_client.model.sampling import SamplingParams
from collm.edge_client.training.data import load_edge_data
from collm.edge_client.training.jobs import TrainBudget
from collm.sim.edge import SimEdge, SimRequest
from collm.sim.jobs import SimJob
from collm.sim.profile import EdgeProfile

STEP_S, UNIT_S = 0.05, 0.02
# (arrival s, prompt tokens, output tokens): a trickle, a burst that queues past the 4 slots (and
# sheds: its TTFT target is short), decodes long enough for the controller to grant a share
SCRIPT = ([(0.0137 + 0.31 * i, 20 + 3 * (i % 4), 6 + i % 5) for i in range(10)]
          + [(3.1371 + 0.004 * i, 60, 12) for i in range(8)]
          + [(4.0173 + 0.23 * i, 12, 25) for i in range(12)])
OVERRIDES = {"engine": {"max_running": 4, "max_queue": 64, "step_token_budget": 64, "warmup": False,
                        "shed_late": True},
             "slo": {"ttft_ms": 400, "tpot_ms": 200},
             "training": {"feedback": {"min_requests": 4, "window_requests": 8, "cool_s": 1.0}}}


class VirtualClock:
    """Time that moves only when a step or unit says how long it took; arrivals due by then are
    handed to the engine at once, as its submitting threads would have."""

    def __init__(self):
        self.t = 0.0
        self.on_advance = None

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
        self.on_advance()


def engine_decisions() -> list[tuple]:
    cfg = tiny_config(**OVERRIDES)
    log: list = []
    clock = VirtualClock()
    eng = Engine(load_model(cfg.model), cfg, load_edge_data(cfg.data), costs=FixedCosts(STEP_S, UNIT_S),
                 clock=clock, decision_log=log)
    real_forward = eng.runner.forward

    def forward(segments, pool):  # the real forward, on the virtual clock
        out = real_forward(segments, pool)
        clock.advance(STEP_S)
        return out

    eng.runner.forward = forward
    eng.train(TrainBudget(tokens=10**9))
    job = eng._new_jobs[-1]
    real_unit = job.run_unit

    def run_unit():
        out = real_unit()
        clock.advance(UNIT_S)
        return out

    job.run_unit = run_unit
    pending = list(SCRIPT)
    finished: list = []

    def submit_due():
        while pending and pending[0][0] <= clock.t:
            at, prompt, out = pending.pop(0)
            req = eng.submit([7] * prompt, SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True),
                             lambda ev: finished.append(ev) if isinstance(ev, FinishEvent) else None)
            req.arrival = at  # arrived at its scripted time; the engine takes it at its next boundary

    clock.on_advance = submit_due
    submit_due()
    while len(finished) < len(SCRIPT):
        assert eng._pass() and clock.t < 60, "the engine stopped making progress"
    return log


def sim_decisions() -> list[tuple]:
    cfg = tiny_config(**OVERRIDES)
    e = cfg.engine
    profile = EdgeProfile("fixed", (STEP_S, 0.0, 0.0, 0.0), 0.0, 0.0, max_running=e.max_running,
                          step_token_budget=e.step_token_budget, max_context=512, max_queue=e.max_queue,
                          train_tokens=100, train_s=10 * UNIT_S, train_units=10, eval_tokens=100, eval_s=0.1,
                          eval_units=5, eval_batch=4)
    log: list = []

    class World:  # what a SimEdge needs of collm-sim's world: a clock and somewhere to report to
        def __init__(self):
            self.heap, self.seq, self.done = [], 0, 0

        def wake_at(self, t, edge, epoch):
            self.seq += 1
            heapq.heappush(self.heap, (t, self.seq, "wake", epoch))

        def first_token(self, r, edge, now):  # the world's router learns TTFTs; no router here
            pass

        def finished(self, r, edge, now, status, ttft, tpot):
            self.done += 1

    world = World()
    slo = SLO(cfg.slo.ttft_ms / 1000, cfg.slo.tpot_ms / 1000)
    edge = SimEdge(0, "e", profile, "serve+train", make_policy(cfg.training), world, 0, slo, cfg.slo.safety, log)
    edge.queue_job(SimJob("train", profile, 10**9), 0.0)
    for i, (at, prompt, out) in enumerate(SCRIPT):
        world.seq += 1
        heapq.heappush(world.heap, (at, world.seq, "arrive", i))
    while world.done < len(SCRIPT):
        t, _, kind, x = heapq.heappop(world.heap)
        if kind == "wake":
            edge.wake(t, x)
        else:
            at, prompt, out = SCRIPT[x]
            assert edge.arrive(SimRequest(x, 0, at, prompt, out, slo), t)
    return log


def comparable(log: list[tuple]) -> list[tuple]:
    """Decisions with times rounded (the two clocks sum the same durations, maybe in another order),
    idle verdicts left out (the module docstring)."""
    return [tuple(round(x, 6) if isinstance(x, float) else x for x in d) for d in log
            if not (d[0] == "verdict" and d[3] == "idle")]


def test_the_engine_and_the_simulator_make_the_same_decisions_on_the_same_events():
    sim = comparable(sim_decisions())
    eng = comparable(engine_decisions())
    kinds = {d[0] for d in sim}
    reasons = {d[3] for d in sim if d[0] == "verdict"}
    ends = {d[3] for d in sim if d[0] == "end"}
    # the script reaches every kind of decision: sheds, admissions, steps, busy-time verdicts both ways
    assert {"drop", "admit", "step", "verdict", "end", "job"} <= kinds, kinds
    assert {"busy-share", "serving-first"} <= reasons and {"bucket", "per-step-cap", "slack"} & reasons, reasons
    assert ends == {"length", "expired"}, ends
    for i, (a, b) in enumerate(zip(eng, sim)):
        assert a == b, f"decision {i} differs: engine {a}, simulator {b}; before it: {sim[max(0, i - 5):i]}"
    assert len(eng) == len(sim)


@pytest.mark.parametrize("driver", [engine_decisions, sim_decisions])
def test_each_driver_is_deterministic(driver):
    assert comparable(driver()) == comparable(driver())
