"""What collm-lab does while the rounds run: echo the ServerApp's log, start and stop edges on purpose
(--join, --leave), report an edge that dies and start it again (--restart-edges)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from collm.common.errors import UserError
from collm.common.procs import BIN_DIR
from collm.common.rounds import read_status
from collm.lab.topology import ProcessGroup


class Churn:
    """When the lab starts and stops edges on purpose (--join, --leave), from the strategy's round status."""

    def __init__(self, joins: dict[str, int], leaves: dict[str, int], checkpoint_dir: Path):
        self.joins, self.leaves, self.checkpoint_dir = dict(joins), dict(leaves), checkpoint_dir

    def due(self) -> tuple[list[str], list[str]]:
        """(edges to start now, edges to stop now), each returned once: a joining edge starts once
        the round before its own has begun training, a leaving one stops once its round has."""
        begun = int((read_status(self.checkpoint_dir) or {}).get("round", 0))  # the last round that began training
        start = [n for n, j in self.joins.items() if begun >= j - 1]
        stop = [n for n, leave in self.leaves.items() if begun >= leave]
        for n in start:
            del self.joins[n]
        for n in stop:
            del self.leaves[n]
        return start, stop

    def expected(self, edges) -> set[str]:
        """The edges that should be running now."""
        return {n for n in edges if n not in self.joins}


def follow(group: ProcessGroup, server, edge_paths: dict[str, Path], restart: bool, min_edges: int,
            churn: Churn) -> list[dict]:
    """Echo the ServerApp's log (rounds, balancer decisions, the loss table) until it exits; meanwhile
    start and stop edges as --join/--leave ask, report an edge that dies, and restart it if asked.
    Returns what happened to the edges."""
    path = group.log_path("server")
    pos, events, reported, left = 0, [], set(), set()
    while True:
        time.sleep(0.5)
        text = path.read_text(errors="replace") if path.is_file() else ""
        if len(text) > pos:
            sys.stdout.write(text[pos:])
            sys.stdout.flush()
            pos = len(text)
        if server.poll() is not None:
            text = path.read_text(errors="replace")
            sys.stdout.write(text[pos:])
            return events
        group.check_alive(ignore=("server",))
        joining, leaving = churn.due()
        for name in joining:
            group.spawn(name, [str(BIN_DIR / "collm-edge"), "--config", str(edge_paths[name])], expendable=True)
            events.append({"edge": name, "joined": True, "at": time.time()})
            print(f"[lab] {name} joins: started; it serves the latest global adapter once it is ready", flush=True)
        for name in leaving:
            rc = group.retire(name)
            left.add(name)
            events.append({"edge": name, "left": True, "exited": rc, "at": time.time()})
            print(f"[lab] {name} leaves: stopped (status {rc}); the round goes on without it", flush=True)
        for name, rc in group.casualties():
            if name in reported:
                continue
            reported.add(name)
            events.append({"edge": name, "exited": rc, "at": time.time()})
            print(f"[lab] {name} exited with status {rc}; see {group.log_path(name)}", flush=True)
            if restart:
                group.spawn(name, [str(BIN_DIR / "collm-edge"), "--config", str(edge_paths[name])], expendable=True)
                events.append({"edge": name, "restarted": True, "at": time.time()})
                reported.discard(name)
                print(f"[lab] {name} restarted: it serves the latest global adapter once it is ready", flush=True)
        alive = sum(1 for n in churn.expected(edge_paths) - left if (p := group.get(n)) is not None and p.poll() is None)
        if alive < min_edges:
            raise UserError(f"only {alive} of {len(edge_paths)} edges are left, fewer than the {min_edges} each round "
                            "needs; pass --restart-edges to restart edges that die")
