"""What an edge keeps on disk so that a crash or a restart loses nothing, under `state_dir`:

    serving -> serving@<n>/   the serving adapter (PEFT format) and serving.json (its version, round, eval
                              loss, when it was published), one generation: both flip together
    training -> training@<n>/ the training adapter and optimizer.pt, written at shutdown

Each is a generation of `common/durable.py`: written and synced in full, then made current by one rename,
with the previous one kept. Reading tries the current generation, then the previous ones: a torn or
unreadable one is logged and skipped, never a reason to stay down. The layout before generations
(`serving/` beside `serving.json`) is still read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from collm.common.adapter_io import load_adapter, save_adapter
from collm.common.config import LoraConfig
from collm.common.durable import generations, publish_generation

log = logging.getLogger("collm.edge")
SERVING, TRAINING, META, OPTIMIZER = "serving", "training", "serving.json", "optimizer.pt"


def write_serving(state_dir: Path, state: dict, info: dict, lora: LoraConfig, model_name: str) -> Path:
    """The serving adapter and its version info as one generation."""
    def fill(d: Path) -> None:
        save_adapter(d, state, lora, model_name, metadata={"version": info["version"]})
        (d / META).write_text(json.dumps(info))

    return publish_generation(state_dir, SERVING, fill)


def read_serving(state_dir: Path, problems: Callable[[dict], list[str]]) -> tuple[dict, dict] | None:
    """(adapter state, version info) of the newest readable serving generation whose shapes fit
    (`problems(state)` empty), or None."""
    def read(d: Path) -> tuple[dict, dict]:
        old_layout = d.name in (SERVING, f"{SERVING}@0")  # it kept serving.json beside the folder
        meta_path = d.parent / META if old_layout and not (d / META).is_file() else d / META
        meta = json.loads(meta_path.read_text())
        int(meta["version"])
        return load_adapter(d)[0], meta

    return _newest_readable(state_dir, SERVING, read, problems)


def write_training(state_dir: Path, state: dict, optimizer: dict, lora: LoraConfig, model_name: str) -> Path:
    def fill(d: Path) -> None:
        save_adapter(d, state, lora, model_name)
        torch.save(optimizer, d / OPTIMIZER)

    return publish_generation(state_dir, TRAINING, fill)


def read_training(state_dir: Path, problems: Callable[[dict], list[str]]) -> tuple[dict, dict | None] | None:
    """(training adapter state, optimizer state or None) of the newest readable generation, or None."""
    def read(d: Path) -> tuple[dict, dict | None]:
        opt = torch.load(d / OPTIMIZER, weights_only=True) if (d / OPTIMIZER).is_file() else None
        return load_adapter(d)[0], opt

    return _newest_readable(state_dir, TRAINING, read, problems)


def _newest_readable(state_dir: Path, name: str, read: Callable[[Path], tuple], problems: Callable[[dict], list[str]]):
    """`read(generation)` of the newest generation of `name` that reads whole and whose adapter fits, or None: a
    torn, missing or foreign one is logged and the one before it tried."""
    for d in generations(state_dir, name):
        try:
            found = read(d)
        except Exception as e:  # noqa: BLE001 - torn, missing or foreign files: try the one before
            log.warning("saved %s state %s is unreadable (%s: %s); trying the one before", name, d, type(e).__name__,
                        str(e)[:200])
            continue
        if why := problems(found[0]):
            log.warning("saved %s state %s does not fit this model (%s); trying the one before", name, d, why[0])
            continue
        return found
    return None
