"""The on-disk layout of a federated run, shared by the server (writes it), the edges and the tools (read it).

    <checkpoint_dir>/round-0003/...            the global adapter after round 3 (PEFT format) and its
                                               metrics.json, written last: without it the round is incomplete
    <checkpoint_dir>/status.json               where the run is now: {"round", "phase", ...}
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from collm.common.durable import write_atomic

METRICS_FILE = "metrics.json"
STATUS_FILE = "status.json"
_ROUND_DIR = re.compile(r"^round-(\d{4,})$")


def round_dir(directory: str | Path, r: int) -> Path:
    return Path(directory) / f"round-{r:04d}"


def complete_rounds(directory: str | Path) -> list[int]:
    """Round numbers whose directory has metrics.json, ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    rounds = []
    for p in d.iterdir():
        m = _ROUND_DIR.match(p.name)
        if m and p.is_dir() and (p / METRICS_FILE).is_file():
            rounds.append(int(m.group(1)))
    return sorted(rounds)


def write_status(directory: str | Path, status: dict) -> None:
    """Replace the run's status.json (atomically: a reader never sees half of it)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / STATUS_FILE, json.dumps(json_safe(status)))


def read_status(directory: str | Path) -> dict | None:
    """The run's last status ({"round", "phase", ...}), or None before the first round starts."""
    try:
        return json.loads((Path(directory) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def latest_complete_round(directory: str | Path) -> int:
    """The last complete round under `directory`, or 0 if there is none."""
    rounds = complete_rounds(directory)
    return rounds[-1] if rounds else 0


def json_safe(x):
    """NaN/inf become null (strict JSON); numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
