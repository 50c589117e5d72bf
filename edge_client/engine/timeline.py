"""What the engine loop did and when (`engine.timeline: PATH`): for finding where a request's time went.

A request's TTFT and TPOT say that it was slow, not why. The timeline records every serving step,
every unit of background work and every adapter the shadow published, one JSON line each, with
wall-clock times, so a slow request can be laid beside what its replica was doing
(`benchmarks/timeline_report.py`). Events:

    {"ev": "step", "t": start, "s": seconds, "dec": decoding rows, "pf": prefill tokens, "run": running, "wait": waiting}
    {"ev": "unit", "t": start, "s": seconds, "job": train|eval, "unit": fwd|bwd|loss|..., "tok": tokens}
    {"ev": "publish", "t": time, "version": v, "source": ...}

Off by default. On, it costs a small dict per event and a buffered write every second; any thread
may record (publishes come from the federation client).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Timeline:
    """Buffered JSON-lines event log; `record` from any thread, `close` flushes."""

    def __init__(self, path: str | Path, flush_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1 << 16)
        self._lock = threading.Lock()
        self._buf: list[str] = []
        self._flush_s = flush_s
        self._flushed_at = time.monotonic()

    def record(self, ev: str, **fields) -> None:
        fields = {k: round(v, 5) if isinstance(v, float) else v for k, v in fields.items()}  # 10 us is plenty
        line = json.dumps({"ev": ev, **fields}, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return
            self._buf.append(line)
            if time.monotonic() - self._flushed_at >= self._flush_s:
                self._flush_locked()

    def _flush_locked(self) -> None:
        self._file.write("\n".join(self._buf) + "\n" if self._buf else "")
        self._file.flush()
        self._buf.clear()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flush_locked()
                self._file.close()


def read_timeline(path: str | Path) -> list[dict]:
    """The events of a timeline file (a line cut short by a crash is skipped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
