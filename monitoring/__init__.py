"""The operator's view: Prometheus scrape configs, alert rules and the Grafana dashboard.

Assets (shipped with the package, mounted by the Compose lab's `prometheus` and `grafana` services):

* `prometheus/alerts.yml`: the alert rules; `prometheus/alerts_test.yml`: `promtool test rules` cases;
* `prometheus/prometheus.yml`: the Compose lab's scrape config;
* `grafana/dashboards/collm.json`: the dashboard (written by `grafana/make_dashboard.py`), and
  `grafana/provisioning/`: its datasource and dashboard provider.

`scrape_config` builds a run's Prometheus config (the lab's, `collm-lab --prometheus`) from the
processes it started. Every edge target carries an `edge` label (the edges export none of their own);
the router's series already carry `edge`, so its target gets none.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
ALERTS = HERE / "prometheus" / "alerts.yml"
ALERT_TESTS = HERE / "prometheus" / "alerts_test.yml"
COMPOSE_CONFIG = HERE / "prometheus" / "prometheus.yml"
DASHBOARD = HERE / "grafana" / "dashboards" / "collm.json"

EDGE_JOB, ROUTER_JOB, SERVER_JOB = "collm-edge", "collm-router", "collm-server"


def scrape_config(edges: dict[str, str], router: str | None, server: str | None, *, interval_s: float = 5,
                  rule_files: list[str] = (), scheme: str = "http") -> dict:
    """A Prometheus config: `edges` maps each edge's name to its host:port, `router` and `server` (the
    exporter) are host:port or None."""
    interval = f"{interval_s:g}s"
    jobs = [{"job_name": EDGE_JOB, "scheme": scheme,
             "static_configs": [{"targets": [addr], "labels": {"edge": name}} for name, addr in edges.items()]}]
    if router:
        jobs.append({"job_name": ROUTER_JOB, "scheme": scheme, "static_configs": [{"targets": [router]}]})
    if server:
        jobs.append({"job_name": SERVER_JOB, "static_configs": [{"targets": [server]}]})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": list(rule_files), "scrape_configs": jobs}


def panel_queries(dashboard: dict | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard."""
    d = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in d["panels"] if p.get("type") != "row" for t in p.get("targets", [])]
