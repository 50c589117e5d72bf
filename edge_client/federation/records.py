"""Adapters on the wire: PEFT-keyed tensors <-> Flower ArrayRecords, packed (`collm.common.wire`),
float32 (bf16 cannot go into one)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.supercore.differential_privacy import compute_clip_model_update, get_norm

from collm.common import lora_rank, wire


def to_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of a packed or a keyed record."""
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in wire.unpack(arrays).items()}


def fit_to_rank(state: dict[str, torch.Tensor], alpha_in: float, r: int, alpha: float,
                fill: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
    """A global (any rank, LoRA alpha `alpha_in`) as this edge's rank-`r` adapter (common/lora_rank.py): its
    truncated SVD, unused directions given `fill`'s A rows; and the share of its energy kept."""
    out, energy = lora_rank.fit_rank(_np(state), alpha_in, r, alpha, _np(fill))
    return _torch(out), energy


def product_rebase(r: int, alpha: float, fill: dict[str, torch.Tensor]):
    """A carry's rebase under lora_aggregation product: the new global plus what the carry trained, as products
    (global + now - base; the factors are in different bases), back at rank `r` and turned to the basis of the
    new global's factors (what a proximal term pulls toward)."""
    s = alpha / r

    def rebase(global_state, now, base):
        start = _np(global_state)
        out, _ = lora_rank.combine([(start, s), (_np(now), s), (_np(base), -s)], r, alpha, _np(fill))
        return _torch(lora_rank.align(out, start))
    return rebase


def _np(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu", torch.float32).numpy() for k, v in state.items()}


def _torch(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()}


def to_arrays(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return wire.pack({k: v.detach().to("cpu", torch.float32).numpy() for k, v in state.items()})


def clipped_update(local: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                   clipping_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """DP's client-side clipping (Flower's `compute_clip_model_update`): start + the update
    local - start scaled to L2 norm at most `clipping_norm`. Returns it and the norm before clipping."""
    keys = sorted(local)
    mine = [local[k].detach().to("cpu", torch.float32).numpy().copy() for k in keys]
    base = [start[k].detach().to("cpu", torch.float32).numpy() for k in keys]
    norm = get_norm([m - b for m, b in zip(mine, base)])
    compute_clip_model_update(mine, base, clipping_norm)
    return {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in zip(keys, mine)}, norm
