"""Edges bound to their federation: every instruction the CoLLM ServerApp sends carries a proof that it knows
the federation key, for this run and round; an edge configured with the key refuses any other.

Why: the SuperLink's Control API accepts runs from whoever reaches it (Flower 1.42's open-source SuperLink has
no account authentication), and every SuperNode takes messages of every run. Without a proof, a foreign run's
TRAIN message with a large round number and an adapter that passes the canary would become the edge's
served global and hold back every real round after it (issue #34).

    proof = HMAC-SHA256(key, "collm-run:<run id>:<round>")   in the message's config, key `collm-run-proof`
"""

from __future__ import annotations

import hashlib
import hmac

from collm.common.auth import matches

PROOF_KEY = "collm-run-proof"


def proof(key: str, run_id: int, server_round: int) -> str:
    return hmac.new(key.encode(), f"collm-run:{int(run_id)}:{int(server_round)}".encode(), hashlib.sha256).hexdigest()


def refusal(keys: tuple[str, ...], run_id: int, server_round: int, given: object) -> str | None:
    """None if the message may be acted on (no key configured, or a proof made with one of `keys`), else why not."""
    if not keys:
        return None
    if not isinstance(given, str):
        return (f"the message of run {run_id} carries no {PROOF_KEY}: it is not from this federation's ServerApp "
                "(federation.run_key)")
    ok = matches(given, tuple(proof(k, run_id, server_round) for k in keys))  # constant time, every key
    return None if ok else (f"the message of run {run_id} round {server_round} has a {PROOF_KEY} made with another "
                            "key: it is not from this federation's ServerApp (federation.run_key)")
