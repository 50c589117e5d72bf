"""How much CPU does each process of a running lab use? Samples /proc once a second, prints shares of one core.

    collm-lab --model bundled --edges 2 --rounds 3 --load 1.0 --linger 40 --out runs/lab-cpu &
    python benchmarks/process_cpu.py --seconds 200

For the question "is the federation's step slowdown the Flower processes' CPU?": every process's user + system
time over the window, as a share of one core, with its command line (the top `--top`). Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot() -> dict[int, tuple[float, str]]:
    """pid -> (CPU seconds so far, command line) of every process readable now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()
        except OSError:  # it ended between listdir and open
            continue
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / HZ, cmd)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    if not os.path.isdir("/proc") or a.seconds <= 0:
        print("process_cpu: needs Linux's /proc and --seconds > 0", file=sys.stderr)
        return 2
    used: dict[int, float] = {}
    cmds: dict[int, str] = {}
    t0 = time.monotonic()
    prev = snapshot()
    while time.monotonic() - t0 < a.seconds:
        time.sleep(1.0)
        cur = snapshot()
        for pid, (cpu, cmd) in cur.items():
            if pid in prev:
                used[pid] = used.get(pid, 0.0) + cpu - prev[pid][0]
                cmds[pid] = cmd
        prev = cur
    window = time.monotonic() - t0
    print(f"CPU over {window:.0f} s, as a share of one core:")
    for pid, cpu in sorted(used.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{100 * cpu / window:6.1f}%  {pid:>7}  {cmds[pid][:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
