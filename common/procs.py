"""Environment for the child processes CoLLM starts (SuperLink, SuperNode, edges, server app).

`flower-superlink` starts `flower-superexec` by name from PATH, so a SuperLink launched from a
virtual environment that is not activated (CI runs `.venv/bin/python -m pytest`) fails at startup
unless this interpreter's bin folder comes first on PATH.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN_DIR = Path(sys.executable).parent  # console scripts and flwr binaries of this environment


def child_env(**extra: str) -> dict[str, str]:
    """Our environment with this environment's binaries first on PATH, Flower's telemetry and update
    check off unless set explicitly, unbuffered output, passive OpenMP waiting and two malloc arenas
    (benchmarks/bench_engine.py section 4: a serving + training edge peaks 21% lower with them)."""
    env = dict(os.environ)
    path = env.get("PATH", "")
    if str(BIN_DIR) not in path.split(os.pathsep):
        env["PATH"] = f"{BIN_DIR}{os.pathsep}{path}" if path else str(BIN_DIR)
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
