"""Ends a child process once the process that started it is gone, even after a SIGKILL of that parent.

The SuperNode launcher (`executor._SUPERNODE_LAUNCHER`) runs it: an orphaned SuperNode would keep its node
online with nobody answering its messages, and the server would wait each phase's full timeout for it. The
guard first asks for a graceful shutdown (SIGTERM, as flwr's own handler expects), and if that has not ended
the process `grace_s` later (a handler that stalls, or none that exits), it exits at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _watch(parent: int, grace_s: float, period_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(period_s)
    signal.raise_signal(signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(1)


def guard(parent: int, grace_s: float = 10.0, period_s: float = 0.5) -> threading.Thread:
    """Watch (on a daemon thread) for `parent` to stop being this process's parent, then shut down."""
    t = threading.Thread(target=_watch, args=(parent, grace_s, period_s), name="orphan-guard", daemon=True)
    t.start()
    return t
