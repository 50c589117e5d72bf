"""Adapters on the wire: PEFT-keyed tensors <-> Flower ArrayRecords, packed (`collm.common.wire`),
float32 (bf16 cannot go into one)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.supercore.differential_privacy import compute_clip_model_update, get_norm

from collm.common import wire


def to_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of a packed or a keyed record."""
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in wire.unpack(arrays).items()}


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
