"""The ServerApp's grid, collecting replies sooner: the same messages, pulled every `poll_s` seconds.

flwr 1.42's `send_and_receive` pushes a phase's messages, then pulls the replies and sleeps a hard-coded
3 s between pulls (the grid `flwr-serverapp` hands a ServerApp; the simulation's in-memory grid polls
every 0.1 s, and collm does not run on it), so each of a round's three exchanges (query, train, evaluate)
ends on average 1.5 s after its last reply arrived, up to 3 s. A round of about a minute
loses up to 9 s to it, and the served model gets each new global that much later. `QuickGrid` keeps
the grid's own push and pull and only shortens the wait between pulls; a pull is one loopback call to
the SuperLink's ServerAppIo API.

While replies are missing it logs, every `report_every_s`, which edges the exchange still waits for and for
how long of its timeout: a round held up by one busy or lost edge says so, instead of going quiet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO

from flwr.app import Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid


class QuickGrid(Grid):
    """`grid` with `send_and_receive` polling every `poll_s` seconds; everything else is `grid`'s."""

    def __init__(self, grid: Grid, poll_s: float, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time, names: Callable[[int], str] = lambda nid: f"node-{nid}",
                 report_every_s: float = 30.0) -> None:
        if not poll_s > 0 or not report_every_s > 0:
            raise ValueError(f"poll_s and report_every_s must be positive, got {poll_s!r} and {report_every_s!r}")
        self.grid, self.poll_s, self._sleep, self._clock = grid, poll_s, sleep, clock
        self.names, self.report_every_s = names, report_every_s

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push `messages`, then pull their replies until all came or `timeout` seconds passed (None: no
        limit), as flwr's does, but waiting `poll_s` between pulls instead of 3 s."""
        messages = list(messages)
        waiting = set(self.push_messages(messages))
        to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}  # the grid set the ids as it pushed
        start = self._clock()
        end = start + (timeout if timeout is not None else 0.0)
        next_report = start + self.report_every_s
        replies: list[Message] = []
        while waiting and (timeout is None or self._clock() < end):
            got = list(self.pull_messages(waiting))
            replies.extend(got)
            waiting.difference_update(m.metadata.reply_to_message_id for m in got)
            if waiting:
                if self._clock() >= next_report:
                    next_report = self._clock() + self.report_every_s
                    self._report(sorted(self.names(to[mid]) for mid in waiting if mid in to), start, timeout)
                self._sleep(self.poll_s)
        return replies

    def _report(self, names: list[str], start: float, timeout: float | None) -> None:
        limit = "no limit" if timeout is None else f"{timeout:g} s"
        log(INFO, "still waiting for %d repl%s (%s): %.0f s of %s", len(names), "y" if len(names) == 1 else "ies",
            ", ".join(names), self._clock() - start, limit)
