"""Writes monitoring/grafana/dashboards/collm.json, CoLLM's Grafana dashboard, from the panel list below.

    python -m collm.monitoring.grafana.make_dashboard    # after editing PANELS; a test checks the JSON is current

Every query uses the names the processes export (common/metric_names.py, router/metrics.py); the live
monitoring test asks a real Prometheus each of them during a lab run and wants a non-empty answer.
"""

from __future__ import annotations

import json
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "collm-prometheus"}
OUT = Path(__file__).parent / "dashboards" / "collm.json"

# (row, title, unit, description, [(legend, query), ...])
PANELS = [
    ("Serving (per edge)", "SLO attainment", "percentunit",
     "Share of the edge's finished requests (sliding window) that met their TTFT and TPOT targets.",
     [("{{edge}}", "collm_slo_attainment")]),
    ("Serving (per edge)", "Goodput", "reqps",
     "Requests per second that met every SLO, per edge and for the fleet.",
     [("{{edge}}", "collm_goodput_rps"), ("fleet", "sum(collm_goodput_rps)")]),
    ("Serving (per edge)", "TTFT p50 / p90", "s",
     "Time to first token percentiles from the edges' histograms over the last minute.",
     [("p50 {{edge}}", "histogram_quantile(0.5, sum by (edge, le) (rate(collm_ttft_seconds_bucket[1m])))"),
      ("p90 {{edge}}", "histogram_quantile(0.9, sum by (edge, le) (rate(collm_ttft_seconds_bucket[1m])))")]),
    ("Serving (per edge)", "TPOT p50 / p90", "s",
     "Time per output token after the first, percentiles over the last minute.",
     [("p50 {{edge}}", "histogram_quantile(0.5, sum by (edge, le) (rate(collm_tpot_seconds_bucket[1m])))"),
      ("p90 {{edge}}", "histogram_quantile(0.9, sum by (edge, le) (rate(collm_tpot_seconds_bucket[1m])))")]),
    ("Serving (per edge)", "Queue and batch", "short",
     "Requests waiting for admission, requests running, and the mean batch per engine step.",
     [("queued {{edge}}", "collm_queue_depth"), ("running {{edge}}", "collm_running_requests"),
      ("batch {{edge}}", "collm_batch_size_mean")]),
    ("Co-execution (per edge)", "Training tokens/s", "short",
     "LoRA training throughput on each replica, beside its serving.",
     [("{{edge}}", "collm_training_tokens_per_second")]),
    ("Co-execution (per edge)", "Time spent training", "percentunit",
     "Fraction of the replica's time spent training, and the part of it while requests were running or waiting "
     "(what stretches serving).",
     [("training {{edge}}", "collm_training_busy_fraction"),
      ("beside serving {{edge}}", "collm_training_beside_serving_fraction")]),
    ("Co-execution (per edge)", "Serving adapter version", "none",
     "The global adapter version each edge serves; steps line up when the fleet has converged on a round.",
     [("{{edge}}", "collm_adapter_version")]),
    ("Co-execution (per edge)", "Version skew across edges", "none",
     "Newest minus oldest served version: the width of each step above zero is how long the fleet took to "
     "converge on a new global adapter.",
     [("skew", "max(collm_adapter_version) - min(collm_adapter_version)")]),
    ("Router", "Routed requests/s", "reqps",
     "Requests the router sent to each edge (a retry counts again).",
     [("{{edge}}", "sum by (edge) (rate(collm_router_routed_total[1m]))")]),
    ("Router", "Refused and unroutable", "reqps",
     "Requests refused by admission (no edge could meet the TTFT target) and those with no healthy edge.",
     [("refused", "sum(rate(collm_router_refused_total[1m]))"),
      ("no healthy edge", "sum(rate(collm_router_no_healthy_edge_total[1m]))")]),
    ("Router", "Healthy edges", "short", "Edges the router routes to.",
     [("healthy", "collm_router_healthy_edges")]),
    ("Router", "Admission margin and gathering", "none",
     "Admission refuses a request whose soonest estimated TTFT is past this many times its target; it loosens "
     "while first tokens come with room and drops back when they come late (routing.admission_margin_max). The "
     "measured TTFT slack (1 - the 0.9 quantile of TTFT / target over recent first tokens) opens slo_pack's "
     "gathering at routing.pack_gate or above (gathering 1) and closes it below (0: the router spreads).",
     [("margin", "collm_router_admission_margin"), ("measured TTFT slack", "collm_router_ttft_slack"),
      ("gathering (slo_pack gate open)", "collm_router_gathering")]),
    ("Federation", "Round", "none", "Last complete round, and whether the run still has rounds to go.",
     [("round", "collm_server_round"), ("run active", "collm_server_run_active")]),
    ("Federation", "Round duration", "s", "Wall time of the last complete round and its training deadline.",
     [("duration", "collm_server_round_duration_seconds"), ("deadline", "collm_server_round_deadline_seconds")]),
    ("Federation", "Participants", "short", "Edges asked, selected to train, replied, aggregated and dropped (no reply included) in the last round.",
     [("{{stage}}", "collm_server_round_edges")]),
    ("Federation", "Updates dropped by reason", "short", "Updates left out of the aggregate, all rounds, by why.",
     [("{{reason}}", "collm_server_updates_dropped_total")]),
    ("Federation", "Aggregated training tokens", "short", "Training tokens behind each round's aggregate.",
     [("last round", "collm_server_round_aggregated_tokens")]),
    ("Federation", "Update norms", "none", "Each edge's update norm |local - global| in the last round.",
     [("{{edge}}", "collm_server_update_norm")]),
    ("Federation", "Holdout loss", "none",
     "Loss of the newest evaluated global adapter on each edge's held-out records, and their mean.",
     [("mean", "collm_server_holdout_loss"), ("{{edge}}", "collm_server_edge_holdout_loss")]),
    ("Federation", "Canary refusals", "short", "Edges whose canary gate refused a new global adapter, all rounds.",
     [("refusals", "collm_server_canary_refusals_total")]),
    ("Federation", "Privacy budget", "none",
     "Epsilon spent so far against dp.max_epsilon (only with DP on; 'enabled' is 0 without it).",
     [("enabled", "collm_server_privacy_enabled"), ("epsilon", "collm_server_privacy_epsilon"),
      ("max epsilon", "collm_server_privacy_max_epsilon")]),
]


def dashboard() -> dict:
    panels, y, pid, row_now = [], 0, 1, None
    x = 0
    for row, title, unit, desc, targets in PANELS:
        if row != row_now:
            y += 8 if x else 0
            panels.append({"id": pid, "type": "row", "title": row, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            pid, y, x, row_now = pid + 1, y + 1, 0, row
        if x >= 24:
            x, y = 0, y + 8
        panels.append({
            "id": pid, "type": "timeseries", "title": title, "description": desc, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q, "legendFormat": legend}
                        for i, (legend, q) in enumerate(targets)],
        })
        pid, x = pid + 1, x + 8
    return {"uid": "collm-fleet", "title": "CoLLM fleet", "tags": ["collm"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-30m", "to": "now"}, "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
