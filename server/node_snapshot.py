"""One count of the connected edges per sampling, so a round never waits for an edge that just left.

flwr 1.42's FedAvg counts the connected nodes (`grid.get_node_ids()`) to size its sample, then
`sample_nodes` asks again and waits, with no limit, until that many are connected. An edge that dies
between the two calls (it was killed; its SuperNode is still deregistering) leaves the round waiting
for a node that will never come back, unless a replacement happens to connect: a lab run with
`--restart-edges` hung this way in CI. `NodeSnapshot` answers both calls with one list, taken once at
least `min_nodes` are connected (the wait flwr means: the first round waits for every edge). A sampled
node that is gone by the time its message is pushed gets the SuperLink's Node Unavailable reply, which
the strategy already leaves out of the round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import INFO

from flwr.common.logger import log
from flwr.serverapp import Grid


class NodeSnapshot:
    """What flwr's sampling reads of `grid` (only `get_node_ids`), fixed at its first reading."""

    def __init__(self, grid: Grid, min_nodes: int, *, sleep: Callable[[float], None] = time.sleep,
                 log_every_s: float = 10.0):
        self.grid, self.min_nodes, self._sleep, self._log_every_s = grid, min_nodes, sleep, log_every_s
        self._nodes: list[int] | None = None

    def get_node_ids(self) -> list[int]:
        if self._nodes is None:
            self._nodes = self._wait_for_enough()
        return list(self._nodes)

    def _wait_for_enough(self) -> list[int]:
        waited = 0.0
        while len(nodes := list(self.grid.get_node_ids())) < self.min_nodes:
            if waited % self._log_every_s == 0:
                log(INFO, "waiting for edges to connect: %d connected, %d needed", len(nodes), self.min_nodes)
            self._sleep(1.0)
            waited += 1.0
        return nodes
