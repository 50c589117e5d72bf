"""Environment for the child processes CoLLM starts (SuperLink, SuperNode, edges, server app).

`flower-superlink` starts `flower-superexec` by name from PATH, so a SuperLink launched from a
virtual environment that is not activated (CI runs `.venv/bin/python -m pytest`) fails at startup
unless this interpreter's bin folder comes first on PATH.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

BIN_DIR = Path(sys.executable).parent  # console scripts and flwr binaries of this environment
FLOWER_QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}  # unless set explicitly


def usable_cpus() -> list[int]:
    """The cores this process may run on (a container's cpuset, not the host's core count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def lower_priority(nice: int):
    """A `preexec_fn` that runs the child at `nice` (None for 0): background work (federation
    coordination, message transport) gets the CPU time serving leaves.

    With the kernel's autogroup scheduling (on by default), a process in a session of its own
    competes as a whole group, whatever its nice value, so the group's nice is set too
    (/proc/self/autogroup); otherwise a coordinator in its own session still took half of an
    edge's core while it moved a round's messages."""
    if nice <= 0:
        return None

    def apply() -> None:
        os.nice(nice)
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass  # no autogroup (kernel option off, or not Linux): nice alone applies

    return apply


def quiet_flower() -> None:
    """Flower's telemetry and update check off in this process (flwr code called in-process)."""
    for k, v in FLOWER_QUIET.items():
        os.environ.setdefault(k, v)


def child_env(**extra: str) -> dict[str, str]:
    """Our environment with this environment's binaries first on PATH, Flower's telemetry and update
    check off unless set explicitly, unbuffered output, passive OpenMP waiting and two malloc arenas
    (benchmarks/bench_engine.py section 4: a serving + training edge peaks 21% lower with them)."""
    env = dict(os.environ)
    path = env.get("PATH", "")
    if str(BIN_DIR) not in path.split(os.pathsep):
        env["PATH"] = f"{BIN_DIR}{os.pathsep}{path}" if path else str(BIN_DIR)
    env.update({k: v for k, v in FLOWER_QUIET.items() if k not in env})
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def processes_mentioning(text: str) -> list[int]:
    """Live processes (not zombies, not this one) whose command line contains `text`: how a lab
    finds what the SuperLink detached into sessions of its own (SuperExec, ServerApp)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                if (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(cmdline.parent.name))
        except (OSError, IndexError):
            continue
    return pids


def end_stragglers(text: str, grace_s: float) -> list[int]:
    """Wait up to `grace_s` for the processes mentioning `text` to end (they watch their parent),
    then SIGKILL the rest; returns those that had to be killed."""
    deadline = time.time() + grace_s
    while (left := processes_mentioning(text)) and time.time() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
