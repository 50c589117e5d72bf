"""LoRA adapters in PEFT's own on-disk format (`adapter_config.json` + `adapter_model.safetensors`).

Everywhere in CoLLM (engine, Flower messages, checkpoints) an adapter is a flat state dict with
PEFT's keys, so what CoLLM writes loads with `PeftModel.from_pretrained` and vLLM's
`--lora-modules` unchanged:

    base_model.model.<module path>.lora_A.weight   shape [r, in_features]
    base_model.model.<module path>.lora_B.weight   shape [out_features, r]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from collm.common.config import LoraConfig
from collm.common.durable import replace_synced, write_atomic
from collm.common.errors import UserError

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_key(module_path: str, which: str) -> str:
    """PEFT state-dict key of LoRA matrix `which` ("A" or "B") on the module at `module_path`."""
    return f"{PREFIX}{module_path}.lora_{which}.weight"


def adapter_config_dict(lora: LoraConfig, base_model_name: str) -> dict:
    """The adapter_config.json that PEFT writes for an equivalent `peft.LoraConfig`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_adapter(directory: str | Path, state: dict[str, torch.Tensor], lora: LoraConfig,
                 base_model_name: str, metadata: dict | None = None) -> Path:
    """Write the adapter file by file, each atomically and durably (temp file, fsync, rename, fsync the folder):
    a crash never leaves half a file. Both files together flip only inside a generation (`common/durable.py`)
    or behind a completion marker (a round's metrics.json)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    tmp_w = d / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}})
    replace_synced(tmp_w, d / WEIGHTS_FILE)
    write_atomic(d / CONFIG_FILE, json.dumps(adapter_config_dict(lora, base_model_name), indent=2))
    return d


def load_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict with PEFT keys, adapter_config.json contents)."""
    d = Path(directory)
    if not (d / WEIGHTS_FILE).is_file() or not (d / CONFIG_FILE).is_file():
        raise UserError(f"{d}: not a PEFT adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{d / CONFIG_FILE}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{d / CONFIG_FILE}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{d}: peft_type {cfg.get('peft_type')!r} is not LORA")
    try:
        return load_file(str(d / WEIGHTS_FILE)), cfg
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a corrupt file
        raise UserError(f"{d / WEIGHTS_FILE}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def check_compatible(state: dict, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Problems (wrong keys, shapes, non-finite values) of `state` against `expected` shapes."""
    problems = []
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing key(s), e.g. {missing[0]}")
    if extra:
        problems.append(f"{len(extra)} unexpected key(s), e.g. {extra[0]}")
    for k in sorted(set(state) & set(expected)):
        v = state[k]
        shape = tuple(v.shape)
        if shape != tuple(expected[k]):
            problems.append(f"{k}: shape {shape}, expected {tuple(expected[k])}")
            continue
        arr = v.detach().float() if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v, np.float32))
        if not torch.isfinite(arr).all():
            problems.append(f"{k}: non-finite values")
    return problems
