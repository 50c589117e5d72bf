"""A shorter idle wait for the SuperNode's Fleet loop, applied inside the child `flower-supernode`.

flwr 1.42's SuperNode pulls the SuperLink for a message and, when there is none, sleeps a hard-coded
3 s (`flwr.supernode.start_client_internal`: `time.sleep(3)`) before the next pull. Every one of a
round's three exchanges (query, train, evaluate) therefore reached the edge on average 1.5 s after the
server sent it, up to 3 s. `shorten_fleet_wait(poll_s)` caps that module's sleeps at `poll_s`; its other
sleeps are 0.5 s already. The flwr pin is exact, and tests/test_flower_executor.py checks that the
wait is still where this expects it.
"""

from __future__ import annotations

import time


class _CappedWaits:
    """The `time` module as `start_client_internal` sees it, with `sleep` capped at `poll_s`."""

    def __init__(self, poll_s: float):
        self.poll_s = poll_s

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.poll_s))


def shorten_fleet_wait(poll_s: float) -> None:
    """Cap the SuperNode Fleet loop's idle wait at `poll_s` seconds (this process only)."""
    if not poll_s > 0:
        raise ValueError(f"poll_s must be positive, got {poll_s!r}")
    import flwr.supernode.start_client_internal as fleet_loop

    fleet_loop.time = _CappedWaits(poll_s)
