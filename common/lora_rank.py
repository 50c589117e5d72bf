"""LoRA adapters of different ranks in one federation: exact sums of products, and the best rank-r
factors of a sum (pure numpy; the server aggregates with it, each edge fits what it receives to its
own rank with it).

A LoRA pair adds `scale · B·A` to a weight (`scale = alpha / r`). Averaging A's and B's apart is not the
average of the products, and cannot mix ranks. Stacking can (FLoRA, Wang et al. 2024): the weighted sum
Σ c_k·scale_k·B_k·A_k equals [c_1·scale_1·B_1, …] · [A_1; …], exactly, whatever each rank. The stacked
rank grows with every update, so a sum is brought back to a rank `r` by its truncated SVD (the best
rank-r approximation, Eckart–Young), computed through two thin QRs, never the dense d_out x d_in
product. `energy` is the share of the sum's squared singular values the rank-r factors keep (1.0: exact;
a sum whose rank is at most r is kept exactly). The base weights are never touched.

Directions the sum does not use (singular value 0) would give a pair whose A row and B column are both
zero, which no gradient can move again; `fill` puts a trainable A row there (the edge's seeded
initial A), with B's column zero, so the product is unchanged. With a `fill`, every A row also gets
the seeded rows' norm and B carries the magnitude (A = c·Vᵀ, B = U·S/(scale·c)), the regime LoRA
trains in; a balanced split (√S on each side) would leave a weak direction with a tiny A row that
barely trains.

Edges of a lower rank start from the global cut to their rank, so the server aggregates each edge's
change from its own start (global + Σ w·(local − start)), never the locals themselves: averaging
those would pull the global toward the low-rank edges' cut-down copies even if nobody trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

State = Mapping[str, np.ndarray]
A_TAG, B_TAG = "lora_A", "lora_B"


def pairs(state: State) -> dict[str, tuple[str, str]]:
    """Module -> (A key, B key) for every LoRA pair in a PEFT state dict (ValueError if one half is missing)."""
    out = {}
    for k in state:
        if A_TAG in k:
            b = k.replace(A_TAG, B_TAG)
            if b not in state:
                raise ValueError(f"{k} has no {B_TAG} partner")
            out[k.replace(A_TAG, "")] = (k, b)
    if len(out) * 2 != len(state):
        extra = sorted(k for k in state if A_TAG not in k and k.replace(B_TAG, A_TAG) not in state)
        raise ValueError(f"keys that are not LoRA pairs: {extra[:3]}")
    return out


def rank_of(state: State) -> int:
    """The rank of a PEFT state dict (every pair must agree; ValueError otherwise)."""
    ranks = set()
    for a, b in pairs(state).values():
        A, B = np.asarray(state[a]), np.asarray(state[b])
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(f"{a}: shapes {A.shape} and {B.shape} are not a LoRA pair")
        ranks.add(A.shape[0])
    if len(ranks) != 1:
        raise ValueError(f"pairs of different ranks {sorted(ranks)} in one adapter")
    return ranks.pop()


def _fit(Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], coefs: Sequence[float], r: int, scale: float,
         fill: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Rank-r (B, A) with scale·B·A the best approximation of Σ coef·B·A; also kept and total energy."""
    Bst = np.concatenate([c * np.asarray(B, np.float64) for B, c in zip(Bs, coefs)], axis=1)  # d_out x R
    Ast = np.concatenate([np.asarray(A, np.float64) for A in As], axis=0)  # R x d_in
    qb, rb = np.linalg.qr(Bst)
    qa, ra = np.linalg.qr(Ast.T)
    u, s, vt = np.linalg.svd(rb @ ra.T)
    total = float(np.sum(s ** 2))
    live = int(np.sum(s > max(s[0] if len(s) else 0.0, 1e-30) * 1e-10)) if total > 0 else 0
    k = min(r, live)
    B = np.zeros((Bst.shape[0], r))
    A = np.zeros((r, Ast.shape[1]))
    c = float(np.median(np.linalg.norm(np.asarray(fill, np.float64), axis=1))) if fill is not None else 0.0
    if c > 0:  # A rows at the seeded norm, B carries the magnitude
        B[:, :k] = (qb @ u[:, :k]) * (s[:k] / (scale * c))
        A[:k] = c * (vt[:k] @ qa.T)
    else:  # balanced
        root = np.sqrt(s[:k] / scale)
        B[:, :k] = (qb @ u[:, :k]) * root
        A[:k] = root[:, None] * (vt[:k] @ qa.T)
    if fill is not None and k < r:
        A[k:] = np.asarray(fill, np.float64)[k:r]
    return B, A, float(np.sum(s[:k] ** 2)), total


def combine(terms: Sequence[tuple[State, float]], r: int, alpha: float,
            fill: State | None = None) -> tuple[dict[str, np.ndarray], float]:
    """Rank-r factors (float32, LoRA alpha `alpha`) of Σ coef·B·A over `terms` ((state, coef): coef includes
    each state's own alpha/rank and its weight), pair by pair, and the energy they keep over all pairs.
    Every state must have the same pairs; `fill`: a rank-r state whose A rows fill unused directions."""
    keys = pairs(terms[0][0])
    for state, _ in terms[1:]:
        if pairs(state).keys() != keys.keys():
            raise ValueError("the adapters target different modules")
    out, kept, total = {}, 0.0, 0.0
    for a, b in keys.values():
        B, A, k, t = _fit([s[b] for s, _ in terms], [s[a] for s, _ in terms], [c for _, c in terms], r,
                          alpha / r, None if fill is None else fill[a])
        out[a], out[b] = A.astype(np.float32), B.astype(np.float32)
        kept, total = kept + k, total + t
    return out, (kept / total if total > 0 else 1.0)


def fit_rank(state: State, alpha_in: float, r: int, alpha: float,
             fill: State | None = None) -> tuple[dict[str, np.ndarray], float]:
    """The same adapter at rank `r` with LoRA alpha `alpha` (exact when its rank is at most r), and the energy kept."""
    return combine([(state, alpha_in / rank_of(state))], r, alpha, fill)


def align(state: State, reference: State) -> dict[str, np.ndarray]:
    """The same products in the basis closest to `reference`'s (same rank): A → R·A, B → B·Rᵀ with R the
    orthogonal Procrustes rotation of A onto the reference's A. A refactored adapter then stays near the
    factors an optimizer's moments and a proximal term were computed on."""
    out = {}
    for a, b in pairs(state).values():
        A, B = np.asarray(state[a], np.float64), np.asarray(state[b], np.float64)
        u, _, vt = np.linalg.svd(np.asarray(reference[a], np.float64) @ A.T)
        R = u @ vt
        out[a], out[b] = (R @ A).astype(np.float32), (B @ R.T).astype(np.float32)
    return out


def product_distance(x: State, alpha_x: float, y: State, alpha_y: float) -> float:
    """‖Σ over pairs of (scale_x·B_x·A_x − scale_y·B_y·A_y)‖ (Frobenius, all pairs together) from the factors'
    Gram matrices; an empty `y` counts as zero."""
    sx = alpha_x / rank_of(x)
    sy = alpha_y / rank_of(y) if y else 0.0
    total = 0.0
    for a, b in pairs(x).values():
        Bs = [sx * np.asarray(x[b], np.float64)]
        As = [np.asarray(x[a], np.float64)]
        if y:
            Bs.append(-sy * np.asarray(y[b], np.float64))
            As.append(np.asarray(y[a], np.float64))
        Bst, Ast = np.concatenate(Bs, axis=1), np.concatenate(As, axis=0)
        total += float(np.sum((Bst.T @ Bst) * (Ast @ Ast.T)))
    return float(np.sqrt(max(total, 0.0)))
