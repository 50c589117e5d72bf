"""Adapters on the wire: PEFT-keyed tensors <-> Flower ArrayRecords, packed (`collm.common.wire`),
float32 (bf16 cannot go into one)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord

from collm.common import wire


def to_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of a packed or a keyed record."""
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in wire.unpack(arrays).items()}


def to_arrays(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return wire.pack({k: v.detach().to("cpu", torch.float32).numpy() for k, v in state.items()})
