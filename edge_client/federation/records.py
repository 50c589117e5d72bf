"""Adapters on the wire: PEFT-keyed tensors <-> Flower ArrayRecords (float32; bf16 cannot go into one)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord


def to_state(arrays: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(arrays[k].numpy(), dtype=np.float32)) for k in arrays.keys()}


def to_arrays(state: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().to("cpu", torch.float32).numpy()) for k, v in state.items()})
