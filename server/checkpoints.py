"""One directory per finished round, so a restarted server resumes where it stopped.

    <checkpoint_dir>/round-0003/adapter_config.json         the global adapter after round 3,
    <checkpoint_dir>/round-0003/adapter_model.safetensors   in PEFT format (loads with PeftModel)
    <checkpoint_dir>/round-0003/server-state.safetensors    optimizer state (FedAdam), if any
    <checkpoint_dir>/round-0003/metrics.json                that round's decisions and metrics

metrics.json is written last (temp file + rename): a round directory without it is incomplete
and ignored. The layout itself (and status.json, where the run is now) lives in `collm.common.rounds`,
since edges and tools read it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from collm.common.adapter_io import load_adapter, save_adapter
from collm.common.config import LoraConfig
from collm.common.durable import fsync_dir, replace_synced, write_atomic
from collm.common.errors import UserError
from collm.common.rounds import METRICS_FILE, complete_rounds, json_safe, round_dir

SERVER_STATE_FILE = "server-state.safetensors"


@dataclass
class RoundCheckpoint:
    round: int
    arrays: dict[str, np.ndarray]
    metrics: dict
    adapter_config: dict
    server_state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # e.g. {"m_t": {...}}


def write_round(directory: str | Path, r: int, arrays: dict[str, np.ndarray], metrics: dict,
                lora: LoraConfig, base_model_name: str,
                server_state: dict[str, dict[str, np.ndarray]] | None = None) -> Path:
    """Write round `r`'s global adapter, optimizer state and metrics; metrics.json last."""
    d = round_dir(directory, r)
    d.mkdir(parents=True, exist_ok=True)
    (d / METRICS_FILE).unlink(missing_ok=True)  # a rewrite is incomplete until it finishes
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in arrays.items()}
    save_adapter(d, state, lora, base_model_name, metadata={"collm-round": r})
    if server_state:
        flat = {f"{group}/{k}": torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
                for group, tensors in server_state.items() for k, v in tensors.items()}
        tmp = d / f".{SERVER_STATE_FILE}.tmp"
        save_file(flat, str(tmp))
        replace_synced(tmp, d / SERVER_STATE_FILE)
    write_atomic(d / METRICS_FILE, json.dumps(json_safe(metrics), indent=2, sort_keys=False))  # complete from here
    fsync_dir(d.parent)
    return d


def load_latest_good(directory: str | Path, warn=None) -> RoundCheckpoint | None:
    """The newest complete round that reads back whole, or None: a round whose files are torn (a disk that lost
    a write, a file edited by hand) is reported through `warn(message)` and the one before it is tried."""
    for r in reversed(complete_rounds(directory)):
        try:
            return load_round(directory, r)
        except (UserError, OSError, ValueError) as e:
            if warn is not None:
                warn(f"round {r}'s checkpoint is unreadable ({e}); trying round {r - 1}")
    return None


def load_round(directory: str | Path, r: int) -> RoundCheckpoint:
    """Read a complete round back (UserError if it is missing or incomplete)."""
    d = round_dir(directory, r)
    if not (d / METRICS_FILE).is_file():
        raise UserError(f"{d}: no complete checkpoint for round {r} (missing {METRICS_FILE})")
    state, cfg = load_adapter(d)
    server_state: dict[str, dict[str, np.ndarray]] = {}
    if (d / SERVER_STATE_FILE).is_file():
        try:
            saved = load_file(str(d / SERVER_STATE_FILE))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a torn file
            raise UserError(f"{d / SERVER_STATE_FILE}: not readable ({type(e).__name__}: {e})") from None
        for key, t in saved.items():
            group, name = key.split("/", 1)
            server_state.setdefault(group, {})[name] = t.numpy()
    return RoundCheckpoint(
        round=r,
        arrays={k: v.numpy().astype(np.float32) for k, v in state.items()},
        metrics=json.loads((d / METRICS_FILE).read_text()),
        adapter_config=cfg,
        server_state=server_state,
    )


def load_all_metrics(directory: str | Path) -> dict[int, dict]:
    """metrics.json of every complete round that reads back, by round number (an unreadable one is left out)."""
    out = {}
    for r in complete_rounds(directory):
        try:
            out[r] = json.loads((round_dir(directory, r) / METRICS_FILE).read_text())
        except (OSError, ValueError):
            continue
    return out


def check_lora_matches(ckpt: RoundCheckpoint, lora: LoraConfig, where: str) -> None:
    """UserError if the checkpoint was trained with a different LoRA shape than the config."""
    cfg = ckpt.adapter_config
    for field_name, ours, theirs in (("lora.r", lora.r, cfg.get("r")),
                                     ("lora.alpha", lora.alpha, cfg.get("lora_alpha")),
                                     ("lora.target_modules", sorted(lora.target_modules),
                                      sorted(cfg.get("target_modules") or []))):
        if theirs is not None and ours != theirs:
            raise UserError(f"{where}: {field_name} is {ours!r} but round {ckpt.round} was trained with "
                            f"{theirs!r}; use the same LoRA settings or a new checkpoint_dir")
