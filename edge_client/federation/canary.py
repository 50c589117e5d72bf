"""The canary gate: may a new global adapter replace the one this edge serves?

Before the swap the edge evaluates the new global on its holdout slice (through the co-scheduler,
like any evaluation). It is served only if

    candidate_loss  <=  (1 + margin) * serving_loss

A candidate whose loss is not finite never passes; with no loss known for the serving version
(none could be measured) it passes. A pure function, so the edge and the tests share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CanaryVerdict:
    accept: bool
    reason: str


def canary_verdict(candidate_loss: float | None, serving_loss: float | None, margin: float) -> CanaryVerdict:
    if candidate_loss is None or not math.isfinite(candidate_loss):
        return CanaryVerdict(False, f"holdout loss of the new global is {candidate_loss}")
    if serving_loss is None or not math.isfinite(serving_loss):
        return CanaryVerdict(True, "no holdout loss known for the serving version")
    limit = (1 + margin) * serving_loss
    if candidate_loss <= limit:
        return CanaryVerdict(True, f"holdout loss {candidate_loss:.4f} <= {limit:.4f} "
                                   f"(serving {serving_loss:.4f} x {1 + margin:g})")
    return CanaryVerdict(False, f"holdout loss {candidate_loss:.4f} > {limit:.4f} "
                                f"(serving {serving_loss:.4f} x {1 + margin:g})")
