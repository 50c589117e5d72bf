"""server/polling.py: the ServerApp's grid pulls replies every reply_poll_s seconds instead of flwr's 3 s,
collects every reply, and still gives up at the timeout with the replies it has."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from flwr.serverapp import Grid

from collm.server.polling import QuickGrid


class ScriptedGrid(Grid):
    """flwr's Grid interface over a script: the reply to message i can be pulled from pull number arrive[i] on."""

    def __init__(self, arrive: list[int]):
        self.arrive, self.pulls, self.pushed = arrive, 0, []

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def get_node_ids(self):
        return [1, 2, 3]

    def push_messages(self, messages):
        self.pushed = list(messages)
        for i, m in enumerate(self.pushed):  # as flwr's grids do: the id is set on the message as it is pushed
            m.metadata.message_id = f"m{i}"
        return [m.metadata.message_id for m in self.pushed]

    def pull_messages(self, message_ids):
        self.pulls += 1
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in sorted(message_ids)
                if self.pulls > self.arrive[int(m[1:])]]

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("QuickGrid has its own")


def _to(*nodes: int) -> list:
    """Messages as the grid sees them: only their destination matters here."""
    return [SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for n in nodes]


class Clock:
    def __init__(self):
        self.t, self.slept = 0.0, []

    def time(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def test_replies_are_pulled_every_poll_interval_until_all_came():
    grid, clock = ScriptedGrid([0, 3, 1]), Clock()
    quick = QuickGrid(grid, 0.25, sleep=clock.sleep, clock=clock.time)
    messages = _to(1, 2, 3)
    replies = quick.send_and_receive(messages, timeout=60)
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert grid.pushed == messages and grid.pulls == 4
    assert clock.slept == [0.25] * 3  # none after the last reply (flwr's loop waits 3 s each time)
    assert list(quick.get_node_ids()) == [1, 2, 3]


def test_the_timeout_returns_the_replies_that_came():
    grid, clock = ScriptedGrid([0, 10**6]), Clock()
    replies = QuickGrid(grid, 0.5, sleep=clock.sleep, clock=clock.time).send_and_receive(_to(1, 2), timeout=2.0)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert clock.t == pytest.approx(2.0) and grid.pulls == 4


def test_a_poll_interval_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="poll_s"):
        QuickGrid(ScriptedGrid([]), 0.0)


def test_a_long_wait_names_the_edges_it_waits_for(caplog):
    grid, clock = ScriptedGrid([0, 10**6, 10**6]), Clock()
    names = {2: "edge1", 3: "edge2"}
    quick = QuickGrid(grid, 1.0, sleep=clock.sleep, clock=clock.time, names=names.__getitem__, report_every_s=30)
    with caplog.at_level(logging.INFO, logger="flwr"):
        quick.send_and_receive(_to(1, 3, 2), timeout=100)
    reports = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert reports == [f"still waiting for 2 replies (edge1, edge2): {t} s of 100 s" for t in (30, 60, 90)]
