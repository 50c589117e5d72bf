"""What the engine loop did and when (`engine.timeline: PATH`): for finding where a request's time went.

A request's TTFT and TPOT say that it was slow, not why. The timeline records every serving step,
every unit of background work and every adapter the shadow published, one JSON line each, with
wall-clock times, so a slow request can be laid beside what its replica was doing
(`benchmarks/timeline_report.py`). Events:

    {"ev": "step", "t": start, "s": seconds, "dec": decoding rows, "pf": prefill tokens, "att": KV tokens attended,
     "run": running, "wait": waiting}
    {"ev": "unit", "t": start, "s": seconds, "job": train|eval, "unit": forward|backward|head, "tok": tokens, "why": verdict}
    {"ev": "publish", "t": start, "s": seconds, "version": v, "source": ...}
    {"ev": "share", "t": when, "f": the co-execution rule's share beside serving, "slack": measured, "act": why}

Off by default. On, it costs a small dict per event and a buffered write about once a second; any
thread may record (publishes come from the federation client). A write that fails (a full disk)
turns the timeline off with one warning: a diagnostic must never take serving down.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("collm.timeline")


def open_timeline(path: str | Path | None) -> Timeline | None:
    """The timeline at `path`, or None when it is off or cannot be opened (a warning names the setting):
    like a failed write, a path that cannot be written must not keep the edge from serving."""
    if not path:
        return None
    try:
        return Timeline(path)
    except OSError as e:
        log.warning("engine.timeline %s cannot be opened (%s); the edge serves without a timeline "
                    "(set engine.timeline to a writable file path)", path, e)
        return None


class Timeline:
    """Buffered JSON-lines event log: `record` from any thread, `flush` when due, `close` (idempotent) at the end."""

    def __init__(self, path: str | Path, flush_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1 << 16)  # an edge restarted with the same path appends
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

    def flush(self) -> None:
        """Write what is buffered if the last write is older than `flush_s` (the engine calls this when idle,
        so a quiet replica's last events reach the file without waiting for the next one)."""
        with self._lock:
            if not self._file.closed and self._buf and time.monotonic() - self._flushed_at >= self._flush_s:
                self._flush_locked()

    def _flush_locked(self) -> None:
        try:
            if self._buf:
                self._file.write("\n".join(self._buf) + "\n")
            self._file.flush()
        except OSError as e:
            log.warning("engine timeline %s: writing failed (%s); the timeline is off from here", self.path, e)
            try:
                self._file.close()
            except OSError:
                pass
        self._buf.clear()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._flushed_at = -float("inf")
                self._flush_locked()
                if not self._file.closed:
                    try:
                        self._file.close()
                    except OSError:
                        pass


def read_timeline(path: str | Path) -> list[dict]:
    """The events of a timeline file (a line cut short by a crash is skipped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
