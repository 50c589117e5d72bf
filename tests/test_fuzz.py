"""Hostile input against real processes: a tiny collm-edge and collm-router in front of it (lab/fuzz.py).

CI sends a bounded, seeded number of calls; `python -m collm.lab.fuzz --self --calls 1000` sends more.
"""

import pytest

from collm.lab.fuzz import SelfTopology, run, still_serves

CALLS = 250


@pytest.fixture(scope="module")
def topology():
    t = SelfTopology().start()
    yield t
    t.stop()


@pytest.mark.parametrize("target", ["edge", "router"])
def test_fuzzed_calls_get_no_5xx_no_hang_and_the_server_keeps_serving(topology, target):
    url = topology.edge_url if target == "edge" else topology.router_url
    rep = run(url, CALLS, seed=7, timeout_s=60)
    print(f"{target}: {rep.line()}")
    assert rep.calls == CALLS
    assert not rep.server_errors, rep.server_errors[:5]
    assert not rep.hangs and not rep.transport_errors, (rep.hangs[:5], rep.transport_errors[:5])
    assert rep.statuses[200] > 0 and sum(n for s, n in rep.statuses.items() if s == 400) > CALLS // 3
    assert still_serves(url)
