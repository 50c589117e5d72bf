"""One count of the connected edges per sampling, so a round never waits for an edge that just left.

flwr 1.42's FedAvg counts the connected nodes (`grid.get_node_ids()`) to size its sample, then
`sample_nodes` asks again and waits, with no limit, until that many are connected. An edge that dies
between the two calls (it was killed; its SuperNode is still deregistering) leaves the round waiting
for a node that will never come back, unless a replacement happens to connect. `NodeSnapshot` answers
every call of one sampling with the first list that holds at least `min_nodes` nodes; below that it
answers afresh, so flwr's own wait for the minimum (the first round waits for every edge) is unchanged.
A sampled node that is gone by the time its message is pushed gets the SuperLink's Node Unavailable
reply, which the strategy already leaves out of the round.
"""

from __future__ import annotations

from flwr.serverapp import Grid


class NodeSnapshot:
    """What flwr's sampling reads of `grid` (only `get_node_ids`), fixed once it holds `min_nodes`."""

    def __init__(self, grid: Grid, min_nodes: int):
        self.grid, self.min_nodes = grid, min_nodes
        self._nodes: list[int] | None = None

    def get_node_ids(self) -> list[int]:
        if self._nodes is None:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) < self.min_nodes:
                return nodes  # flwr's sample_nodes waits and asks again
            self._nodes = nodes
        return list(self._nodes)
