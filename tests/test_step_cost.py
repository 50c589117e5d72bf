"""The step-cost formula is written once (common/step_cost.py): what an edge's cost model predicts from
its fit, the router predicts from the published coefficients and the simulator's profile replays."""

import random

import numpy as np

from collm.common.step_cost import step_features, step_seconds
from collm.edge_client.engine.cost_model import CostModels
from collm.sim.profile import EdgeProfile

SHAPES = [(1, 0, 40), (8, 0, 900), (3, 64, 2500), (0, 96, 96), (16, 5, 12000)]


def fitted_costs() -> CostModels:
    """An edge's step model fitted on noisy steps of a known truth."""
    rng = random.Random(3)
    truth = (0.012, 0.004, 0.0003, 0.02)
    costs = CostModels()
    for _ in range(120):
        d, p, kv = rng.randint(0, 16), rng.choice([0, 0, 32, 96]), rng.randint(0, 8000)
        costs.step.observe(step_features(d, p, kv), step_seconds(truth, d, p, kv) * rng.uniform(0.95, 1.05))
    return costs


def test_the_router_and_the_simulator_predict_what_the_edge_predicts():
    costs = fitted_costs()
    costs.step_time(1, 0, 0)  # the model refits when asked, as it does before the edge publishes its coefficients
    coef = tuple(float(c) for c in costs.step.coef)
    assert coef[1] > 0 and coef[3] > 0  # a real fit, not the prior
    profile = EdgeProfile(name="p", coef=coef, overhead_s=0.0, noise_sigma=0.0, max_running=16, step_token_budget=512,
                          max_context=2048, max_queue=64, train_tokens=256, train_s=0.5, train_units=4,
                          eval_tokens=256, eval_s=0.2, eval_units=4, eval_batch=8)
    for d, p, kv in SHAPES:
        edge = costs.step_time(d, p, kv)
        assert abs(step_seconds(coef, d, p, kv) - edge) < 1e-9
        assert abs(profile.step_s(d, p, kv) - edge) < 1e-9


def test_the_formula_runs_over_the_router_s_columns():
    coef = (np.array([0.01, 0.02]), np.array([0.003, 0.001]), np.array([1e-4, 2e-4]), np.array([0.01, 0.03]))
    got = step_seconds(coef, np.array([4, 2]), 32, np.array([800, 1600]))
    for i in range(2):
        assert abs(got[i] - step_seconds(tuple(c[i] for c in coef), [4, 2][i], 32, [800, 1600][i])) < 1e-12
