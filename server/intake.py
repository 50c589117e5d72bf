"""A round's updates from read to kept, as pure functions over plain data and the round record: each rule
brings an update to the global's form (or says why it cannot), the robust screen runs with the rules' norm
and bound, then each rule may object. What is left out is recorded in `rec.dropped` with why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Message

from collm.server.replies import with_arrays
from collm.server.robust import Update, screen_updates
from collm.server.rules import Rule

Arrays = Mapping[str, np.ndarray]


def prepare_updates(updates: list[Update], candidates: list[Message], rules: Sequence[Rule], global_: Arrays,
                    rec) -> tuple[list[Update], list[Message]]:
    """Each update as the rules want it (mixed ranks written at the server's rank), with its reply to match;
    one a rule cannot take, or that makes it raise, is recorded as dropped."""
    out_u, out_c = [], []
    for u, c in zip(updates, candidates, strict=True):
        v: Update | str = u
        for rule in rules:
            try:
                v = rule.prepare(v, global_)
            except Exception as e:  # noqa: BLE001 - an untrusted reply the rule cannot take is left out
                v = f"malformed reply ({type(e).__name__}: {str(e)[:300]})"
            if isinstance(v, str):
                rec.dropped[u.name] = v
                break
        else:
            out_u.append(v)
            out_c.append(c if v.arrays is u.arrays else with_arrays(c, dict(v.arrays)))
    return out_u, out_c


def screen_round(updates: list[Update], rules: Sequence[Rule], global_: Arrays, norm_k: float,
                 history: Sequence[float], rec) -> list[int]:
    """The updates kept (indices): those the robust screen passes (`history`: norms the last rounds kept) and
    no rule objects to. Records every update's norm, the dropped ones with why, and the kept names."""
    for rule in rules:
        norm_k = rule.screen_norm_k(norm_k)
    norm = next((rule.norm for rule in rules if type(rule).norm is not Rule.norm), None)
    screening = screen_updates(updates, global_, norm_k, list(history), norm)
    passed = [updates[i] for i in screening.kept]
    for i in list(screening.kept):
        if why := next((w for rule in rules if (w := rule.breaks(updates[i], passed, global_))), None):
            screening.dropped[i] = why
            screening.kept.remove(i)
    rec.norms = {updates[i].name: float(v) for i, v in screening.norms.items()}
    for i, why in screening.dropped.items():
        rec.dropped[updates[i].name] = why
    rec.kept = [updates[i].name for i in screening.kept]
    return screening.kept
