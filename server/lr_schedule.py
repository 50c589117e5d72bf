"""The learning rate the server sends each round: high while the adapter is far from the data, lower as it
settles (a per-round decay with a floor, the usual FL schedule).

A pure function over plain numbers: the strategy, benchmarks/federation_step.py and the tests call it.
Averaged edges gain most from a high rate in the first rounds (two trajectories averaged move less than
one); one trainer's later rounds oscillate at a rate that suits its first (docs/benchmarks.md, 'The
learning rate'). The floor keeps the federation adapting forever: the rate never decays to nothing.
"""

from __future__ import annotations


def round_lr(lr: float, decay: float, floor: float, round_: int) -> float:
    """lr x decay^(round - 1), never below `floor` (round 1 trains at `lr`; decay 1: every round at `lr`)."""
    if round_ < 1:
        raise ValueError(f"round must be 1 or more, got {round_}")
    return max(floor, lr * decay ** (round_ - 1))
