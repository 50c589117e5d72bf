"""Checks that keep a round's bad adapter updates out of the aggregate. Pure functions over numpy.

An update is left out, with its reason, when

* it trained on no examples (its FedAvg weight would be 0);
* any value is NaN or infinite;
* its keys or shapes differ from the reference: the current global adapter's, or, when the
  global is still empty (round 1: edges start from their identical seeded adapter), the key set
  and shapes that most updates agree on;
* its update norm ‖local − global‖ (all tensors together; an empty global counts as zeros) is
  above k × the median of the reference norms: this round's update norms together with the
  norms of the updates the last rounds kept (`history`). The check needs at least 3 reference
  norms. With 3 or more edges one round has them; with 2 edges the median of two norms cannot
  tell which one is the outlier, so round 1 goes unchecked and from round 2 on the history
  decides (a 100x update is then caught; an update scaled by less than k passes, as it would
  with any number of edges: the screen bounds how far one update can pull, it cannot prove one
  honest).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_UPDATES_FOR_NORM_CHECK = 3

Signature = frozenset  # of (key, shape) pairs


@dataclass(frozen=True)
class Update:
    """One edge's reply to a TRAIN instruction, as plain data."""

    name: str
    num_examples: float
    arrays: Mapping[str, np.ndarray]
    lora_alpha: float | None = None  # the edge's LoRA alpha, when it reports one (lora_aggregation product)


@dataclass
class Screening:
    """The outcome of `screen_updates`: indices into the updates passed in."""

    kept: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    norms: dict[int, float] = field(default_factory=dict)
    median_norm: float | None = None
    reference: str = ""  # where the expected keys/shapes came from


def signature(arrays: Mapping[str, np.ndarray]) -> Signature:
    return frozenset((k, tuple(np.shape(v))) for k, v in arrays.items())


def majority_signature(updates: Sequence[Update]) -> Signature:
    """The key set and shapes most updates agree on (ties: the one carrying more examples)."""
    counts: Counter = Counter()
    examples: Counter = Counter()
    for u in updates:
        sig = signature(u.arrays)
        counts[sig] += 1
        examples[sig] += max(float(u.num_examples), 0.0) if np.isfinite(u.num_examples) else 0.0
    return max(counts, key=lambda s: (counts[s], examples[s]))


def shape_problem(arrays: Mapping[str, np.ndarray], expected: Signature) -> str | None:
    """A one-line description of how `arrays` differs from `expected`, or None."""
    want = dict(expected)
    missing = sorted(set(want) - set(arrays))
    extra = sorted(set(arrays) - set(want))
    if missing:
        return f"{len(missing)} missing key(s), e.g. {missing[0]}"
    if extra:
        return f"{len(extra)} unexpected key(s), e.g. {extra[0]}"
    for k in sorted(want):
        if tuple(np.shape(arrays[k])) != want[k]:
            return f"{k}: shape {tuple(np.shape(arrays[k]))}, expected {want[k]}"
    return None


def update_norm(arrays: Mapping[str, np.ndarray], global_arrays: Mapping[str, np.ndarray]) -> float:
    """‖local − global‖ over all tensors together (a missing global tensor counts as zeros)."""
    total = 0.0
    for k, v in arrays.items():
        d = np.asarray(v, np.float64)
        if k in global_arrays:
            d = d - np.asarray(global_arrays[k], np.float64)
        total += float(np.sum(d * d))
    return float(np.sqrt(total))


def screen_updates(updates: Sequence[Update], global_arrays: Mapping[str, np.ndarray],
                   norm_k: float, history: Sequence[float] = (), norm=None) -> Screening:
    """Which updates to aggregate, and why each of the others was left out (`history`: update
    norms the last rounds kept; `norm(update, global)`: the update norm, `update_norm` of its arrays unless given)."""
    out = Screening()
    if global_arrays:
        expected, out.reference = signature(global_arrays), "global adapter"
    elif updates:
        expected = majority_signature(updates)
        agree = sum(signature(u.arrays) == expected for u in updates)
        out.reference = f"majority of updates ({agree}/{len(updates)}; global is empty)"
    else:
        return out

    survivors = []
    for i, u in enumerate(updates):
        if not np.isfinite(u.num_examples) or u.num_examples <= 0:
            out.dropped[i] = f"trained on {u.num_examples:g} examples"
        elif problem := shape_problem(u.arrays, expected):
            out.dropped[i] = f"keys/shapes differ from the {out.reference}: {problem}"
        elif bad := next((k for k, v in u.arrays.items() if not np.isfinite(v).all()), None):
            out.dropped[i] = f"non-finite values in {bad}"
        else:
            survivors.append(i)

    norm = norm or (lambda u, g: update_norm(u.arrays, g))
    out.norms = {i: norm(updates[i], global_arrays) for i in survivors}
    reference = [out.norms[i] for i in survivors] + [float(h) for h in history]
    if len(reference) >= MIN_UPDATES_FOR_NORM_CHECK:
        out.median_norm = float(np.median(reference))
        limit = norm_k * out.median_norm
        for i in survivors:
            if out.median_norm > 0 and out.norms[i] > limit:
                out.dropped[i] = (f"update norm {out.norms[i]:.4g} > {norm_k:g} × median "
                                  f"{out.median_norm:.4g}")
    out.kept = [i for i in survivors if i not in out.dropped]
    return out


def capped_weights(claims: Sequence[float], ratio: float | None) -> list[float]:
    """Each edge's own claim of examples trained on, as its FedAvg weight, at most `ratio` x the median of the
    other claims (None: as claimed). An edge reports its own count: uncapped, claiming 1e30 makes its update
    the whole average (and wins every tie broken by weight). Claims that are not finite and positive stay as
    they are (the screen drops them); a lone claim stands."""
    ok = [float(c) for c in claims if np.isfinite(c) and c > 0]
    out = []
    for c in claims:
        others = list(ok)
        if np.isfinite(c) and c > 0:
            others.remove(float(c))
        if ratio is None or not others or not (np.isfinite(c) and c > 0):
            out.append(float(c))
        else:
            out.append(min(float(c), ratio * float(np.median(others))))
    return out

