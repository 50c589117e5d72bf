"""The ServerApp's round facts as Prometheus metrics, read from the run's checkpoints on each scrape.

Flower runs the ServerApp inside a process the SuperLink starts for the run and ends with it, so it
has no port an operator could rely on. What it does leave is durable: one `metrics.json` per
complete round (the RoundRecord) and `status.json`. `collm-server exporter CHECKPOINT_DIR` serves
`/metrics` from them: during the run, after it, and across a resumed run, with nothing kept in
memory that a restart would lose (a round's file is read again only when it changes; while one is
being rewritten, its last good content stands, so no total steps back).

`server_families` is the pure part: checkpoints' dicts in, metric families out.
"""

from __future__ import annotations

import json
import math
import threading
from datetime import datetime
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from collm.common import metric_names as M
from collm.common import protocol as P
from collm.common.rounds import METRICS_FILE, complete_rounds, read_status, round_dir

# Why an update was left out, by the first words of the reason the round record gives (server/replies.py,
# server/robust.py, server/rules.py); every reason is exported, with 0 until it happens, so a rate() of
# each is defined from the first scrape.
NO_REPLY = "no reply"  # chosen to train, no reply in time (it left, or timed out)
DROP_REASONS = (
    ("no_reply", (NO_REPLY,)),
    ("error", ("error reply",)),
    ("malformed", ("malformed reply", "expected one", "metrics lack")),
    ("no_examples", ("trained on",)),
    ("shape", ("keys/shapes differ", "rank ")),
    ("non_finite", ("non-finite",)),
    ("norm", ("update norm",)),
    ("rule", ("lora_aggregation", "dp:")),
    ("other", ("",)),
)


def drop_reason(why: str) -> str:
    """The `reason` label of a dropped update's recorded reason."""
    return next(label for label, prefixes in DROP_REASONS if any(why.startswith(p) for p in prefixes))


def round_end(m: dict) -> float | None:
    """When the round was complete (its start plus its wall time), in Unix seconds."""
    try:
        return datetime.fromisoformat(m["started_at"]).timestamp() + float(m["wall_s"])
    except (KeyError, TypeError, ValueError):
        return None


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def server_families(rounds: dict[int, dict], status: dict | None) -> list:
    """Metric families of a run: `rounds` is each complete round's metrics.json by number, `status`
    the run's status.json (None before the first round starts)."""
    out = []

    def gauge(name, doc, value, labels=None):
        g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
        if value is not None:
            g.add_metric(list((labels or {}).values()), value)
        out.append(g)
        return g

    last = rounds[max(rounds)] if rounds else {}
    gauge(M.SERVER_ROUND, "Last complete round", float(max(rounds, default=0)))
    c = CounterMetricFamily(M.SERVER_ROUNDS.removesuffix("_total"), "Rounds complete in this run's checkpoints")
    c.add_metric([], float(len(rounds)))
    out.append(c)
    active = status is not None and status.get("phase") != "finished"
    gauge(M.SERVER_RUN_ACTIVE, "1 while the run has rounds to go (status.json phase is not 'finished')",
          float(active))
    gauge(M.SERVER_STATUS_TIME, "When the run last moved: a round started training or completed (Unix s)",
          _num((status or {}).get("at")))
    gauge(M.SERVER_ROUND_TIMEOUT, "round_timeout_s: the longest one phase of a round waits for replies (s)",
          _num((status or {}).get("round_timeout_s")))
    gauge(M.SERVER_ROUND_END, "When the last complete round ended (Unix s)", round_end(last) if last else None)
    gauge(M.SERVER_ROUND_DURATION, "Wall time of the last complete round (s)", _num(last.get("wall_s")))
    deadlines = [_num(d.get("deadline_s")) for d in last.get("balancer") or []]
    deadlines = [d for d in deadlines if d]
    gauge(M.SERVER_ROUND_DEADLINE, "Longest training deadline the balancer gave in the last round (s)",
          max(deadlines) if deadlines else None)

    edges = GaugeMetricFamily(M.SERVER_ROUND_EDGES, "Edges per stage of the last complete round: asked for a load "
                              "report, selected to train, replied with an update, aggregated, dropped (any reason, "
                              "no reply included)", labels=["stage"])
    if last:
        drops = dropped_updates(last)
        selected = [d.get("edge") for d in last.get("balancer") or [] if d.get("take_part")]
        counts = {"asked": len(last.get("balancer") or []), "selected": len(selected),
                  "replied": sum(drop_reason(drops.get(e, "")) not in ("no_reply", "error") for e in selected),
                  "aggregated": len(last.get("kept") or []), "dropped": len(drops)}
        for stage in M.SERVER_ROUND_EDGE_STAGES:
            edges.add_metric([stage], float(counts[stage]))
    out.append(edges)

    dropped = {label: 0 for label, _ in DROP_REASONS}
    tokens_total = refused = 0.0
    for m in rounds.values():
        for why in dropped_updates(m).values():
            dropped[drop_reason(str(why))] += 1
        tokens_total += _aggregated_tokens(m)
        refused += len(m.get("refused_by") or [])
    c = CounterMetricFamily(M.SERVER_DROPPED.removesuffix("_total"), "Updates left out of the aggregate, by reason",
                            labels=["reason"])
    for label, n in dropped.items():
        c.add_metric([label], float(n))
    out.append(c)
    gauge(M.SERVER_AGG_TOKENS, "Training tokens behind the last round's aggregate (the kept edges')",
          _aggregated_tokens(last) if last else None)
    c = CounterMetricFamily(M.SERVER_AGG_TOKENS_TOTAL.removesuffix("_total"), "Training tokens aggregated, all rounds")
    c.add_metric([], tokens_total)
    out.append(c)
    c = CounterMetricFamily(M.SERVER_CANARY_REFUSED.removesuffix("_total"),
                            "Edges whose canary gate refused a round's new global adapter, all rounds")
    c.add_metric([], refused)
    out.append(c)

    norms = GaugeMetricFamily(M.SERVER_UPDATE_NORM, "Update norm |local - global| of each edge's last screened "
                              "update", labels=["edge"])
    for edge, v in sorted((last.get("norms") or {}).items()):
        if (v := _num(v)) is not None:
            norms.add_metric([edge], v)
    out.append(norms)
    evaluated = next((m for _, m in sorted(rounds.items(), reverse=True) if m.get("eval_aggregate")), {})
    gauge(M.SERVER_HOLDOUT_LOSS, "Holdout loss of the newest evaluated global adapter (mean over the edges)",
          _num((evaluated.get("eval_aggregate") or {}).get(P.EVAL_LOSS)))
    per_edge = GaugeMetricFamily(M.SERVER_EDGE_HOLDOUT_LOSS, "Holdout loss of the newest evaluated global adapter "
                                 "on each edge's held-out records", labels=["edge"])
    for edge, e in sorted((evaluated.get("eval") or {}).items()):
        if (v := _num((e or {}).get(P.EVAL_LOSS))) is not None:
            per_edge.add_metric([edge], v)
    out.append(per_edge)

    privacy = next((m["privacy"] for _, m in sorted(rounds.items(), reverse=True) if m.get("privacy")), None)
    noised = bool(privacy) and (_num(privacy.get("noise_multiplier")) or 0) > 0  # clipping alone claims no privacy
    gauge(M.SERVER_PRIVACY_ENABLED, "1 when the run's aggregates are differentially private (noise on)", float(noised))
    if privacy:
        gauge(M.SERVER_EPSILON, "Privacy spent so far (epsilon at the run's delta, RDP accountant)",
              _num(privacy.get("epsilon")))
        gauge(M.SERVER_MAX_EPSILON, "dp.max_epsilon: no round may bring epsilon past it",
              _num(privacy.get("max_epsilon")))
    return out


def dropped_updates(m: dict) -> dict[str, str]:
    """Edge -> why its update is not in the round's aggregate: the recorded reasons, and the edges chosen to
    train whose reply never came (the SuperLink answers nothing for an edge that timed out)."""
    out = {str(e): str(why) for e, why in (m.get("dropped") or {}).items()}
    for d in m.get("balancer") or []:
        if d.get("take_part") and d.get("edge") not in (m.get("train") or {}) and d.get("edge") not in out:
            out[str(d.get("edge"))] = NO_REPLY
    return out


def _aggregated_tokens(m: dict) -> float:
    train = m.get("train") or {}
    return float(sum(_num((train.get(e) or {}).get(P.TRAIN_TOKENS)) or 0 for e in m.get("kept") or []))


class CheckpointCollector:
    """`server_families` over a checkpoint folder; a round's metrics.json is read again only when it changes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._rounds: dict[int, tuple[tuple, dict]] = {}  # round -> (its metrics.json's mtime, inode, size; content)
        self._lock = threading.Lock()

    def rounds(self) -> dict[int, dict]:
        with self._lock:
            for r in complete_rounds(self.directory):
                path = round_dir(self.directory, r) / METRICS_FILE
                try:
                    st = path.stat()
                    key = (st.st_mtime_ns, st.st_ino, st.st_size)
                    if r not in self._rounds or self._rounds[r][0] != key:
                        self._rounds[r] = (key, json.loads(path.read_text()))
                except (OSError, ValueError):
                    continue  # torn or being replaced: the last good content stands until it reads back
            # a round whose folder is gone (a new run in this directory) is forgotten; one whose metrics.json is
            # being rewritten (its folder is there) keeps its last good content, so no total steps back
            self._rounds = {r: v for r, v in self._rounds.items() if round_dir(self.directory, r).is_dir()}
            return {r: v for r, (_, v) in sorted(self._rounds.items())}

    def collect(self):
        yield from server_families(self.rounds(), read_status(self.directory))


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - one line per scrape would drown the log
        pass


def serve(directory: str | Path, host: str, port: int) -> None:
    """Serve /metrics (and nothing else) for the run under `directory` until interrupted."""
    registry = CollectorRegistry()
    registry.register(CheckpointCollector(directory))
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics here\n"]
        return metrics(environ, start_response)

    with make_server(host, port, app, handler_class=_QuietHandler) as httpd:
        print(f"collm-server exporter: http://{host}:{port}/metrics for {directory}", flush=True)
        httpd.serve_forever()
