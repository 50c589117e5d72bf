"""The learning rate the server sends each round: high while the adapter is far from the data, lower as it
settles (a per-round decay with a floor, the usual FL schedule).

A pure function over plain numbers: the strategy, benchmarks/federation_step.py and the tests call it.
Averaged edges gain most from a high rate in the first rounds (two trajectories averaged move less than
one); one trainer's later rounds oscillate at a rate that suits its first (docs/benchmarks.md, 'The
learning rate'). The floor keeps the federation adapting forever: the rate never decays to nothing.
The rate steps with the rounds that trained, not with the clock: a deployment whose rounds are often empty
(every edge busy serving) keeps its rate for the rounds in which it does train.
"""

from __future__ import annotations


def round_lr(lr: float, decay: float, floor: float, step: int) -> float:
    """lr x decay^(step - 1), never below `floor`. `step` is 1 + the rounds that have changed the global so far
    (the strategy's count): a round in which no edge trained does not decay the rate. decay 1: always `lr`."""
    if step < 1:
        raise ValueError(f"step must be 1 or more, got {step}")
    return max(floor, lr * decay ** (step - 1))
