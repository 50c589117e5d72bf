"""The operator's view (monitoring/, server/exporter.py, `collm-lab --prometheus`).

promtool checks the alert rules, runs their unit tests (alerts_test.yml: each alert fires when it
should and not before) and checks both scrape configs (the lab's and the Compose lab's). The round
exporter is read from real checkpoint files. The live test runs a tiny lab with a real Prometheus
and asks its HTTP API every dashboard panel's query: each must return a series. Without
`prometheus`/`promtool` (Debian's package; `.ci/run` installs it) those tests skip with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from collm.common import metric_names as M
from collm.common.durable import write_atomic
from collm.common.procs import processes_mentioning
from collm.common.rounds import write_status
from collm.monitoring import (ALERT_TESTS, ALERTS, COMPOSE_CONFIG, DASHBOARD, panel_queries, scrape_config)
from collm.monitoring.grafana import make_dashboard
from collm.router import metrics as router_metrics
from collm.server.exporter import DROP_REASONS, CheckpointCollector, drop_reason, server_families
from collm.server.round_record import RoundRecord

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
# .ci/run installs Debian's prometheus and sets COLLM_REQUIRE_PROMETHEUS=1: there a missing binary fails the
# tests below instead of skipping them, so CI cannot pass without the proof
REQUIRED = os.environ.get("COLLM_REQUIRE_PROMETHEUS") == "1"
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not REQUIRED,
                                    reason="promtool is not installed (apt-get install prometheus)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None and not REQUIRED,
                                      reason="prometheus is not installed (apt-get install prometheus)")


def promtool(*args, cwd=None) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is not installed (COLLM_REQUIRE_PROMETHEUS=1)"
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


# ---------------------------------------------------------------------------- rules and configs
@needs_promtool
def test_alert_rules_check_and_every_alert_has_a_passing_unit_test():
    r = promtool("check", "rules", ALERTS)
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("test", "rules", ALERT_TESTS)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    alerts = {rule["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"]
              if "alert" in rule}
    tested = {t["alertname"] for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    firing = {t["alertname"] for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    assert alerts == tested == firing, "every alert needs a case where it fires and one where it does not yet"


@needs_promtool
def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests can fail: an edge alert that fires at once breaks the 'not before' case."""
    shutil.copyfile(ALERT_TESTS, tmp_path / "alerts_test.yml")
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text().replace(
        'expr: up{job="collm-edge"} == 0\n        for: 1m', 'expr: up{job="collm-edge"} == 0\n        for: 0m'))
    r = promtool("test", "rules", tmp_path / "alerts_test.yml")
    assert r.returncode != 0 and "CollmEdgeDown" in r.stdout + r.stderr


@needs_promtool
def test_the_lab_and_compose_scrape_configs_pass_promtool(tmp_path):
    shutil.copyfile(ALERTS, tmp_path / "alerts.yml")
    cfg = scrape_config({"edge0": "127.0.0.1:8081"}, "127.0.0.1:8090", "127.0.0.1:9105", interval_s=1,
                        rule_files=["alerts.yml"])
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    for path in (tmp_path / "prometheus.yml", COMPOSE_CONFIG):
        r = promtool("check", "config", path.name, cwd=path.parent)
        assert r.returncode == 0, r.stdout + r.stderr


def test_the_compose_config_is_the_lab_shape_for_the_compose_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    monitoring = yaml.safe_load((ROOT / "docker-compose.monitoring.yml").read_text())["services"]
    edges = {n: f"{n}:{yaml.safe_load((ROOT / f'configs/lab/{n}.yaml').read_text())['api']['port']}"
             for n in compose if n.startswith("edge")}
    server = monitoring["server-metrics"]["command"]
    want = scrape_config(edges, "router:8090", f"server-metrics:{server[server.index('--port') + 1]}",
                         interval_s=5, rule_files=["alerts.yml"])
    assert yaml.safe_load(COMPOSE_CONFIG.read_text()) == want
    assert "./monitoring/prometheus:/etc/prometheus:ro" in monitoring["prometheus"]["volumes"]
    assert monitoring["server-metrics"]["volumes"] == ["checkpoints:/data/checkpoints:ro"]
    for svc in ("prometheus", "grafana"):  # published on loopback unless COLLM_BIND says otherwise
        assert all(p.startswith("${COLLM_BIND:-127.0.0.1}:") for p in monitoring[svc]["ports"])


# ---------------------------------------------------------------------------- the dashboard
def test_the_dashboard_json_is_the_generator_output():
    assert DASHBOARD.read_text() == make_dashboard.render(), \
        "run python -m collm.monitoring.grafana.make_dashboard after editing its PANELS"


def test_every_dashboard_query_names_only_metrics_the_processes_export():
    exported = {v for k, v in vars(M).items() if isinstance(v, str) and v.startswith("collm_")}
    exported |= {v for k, v in vars(router_metrics).items() if isinstance(v, str) and v.startswith("collm_router_")}
    queries = panel_queries()
    assert len(queries) >= 20
    for title, q in queries:
        for name in re.findall(r"\bcollm_[a-z0-9_]+", q):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in exported or base in exported, f"panel {title!r}: {name} is exported by nobody"
    ds = json.loads(DASHBOARD.read_text())
    provisioned = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert {p["datasource"]["uid"] for p in ds["panels"] if p["type"] != "row"} == \
        {d["uid"] for d in provisioned["datasources"]}


# ---------------------------------------------------------------------------- the round exporter
def a_round(r: int, **kw) -> dict:
    rec = RoundRecord(round=r, strategy="CollmFedAvg", started_at=f"2026-12-04T10:0{r}:00+00:00", wall_s=30.0,
                      balancer=[{"edge": e, "deadline_s": 6.0, "take_part": e != "edge2"}
                                for e in ("edge0", "edge1", "edge2")],
                      train={"edge0": {"train-tokens": 100}, "edge1": {"train-tokens": 50}},
                      kept=["edge0", "edge1"], norms={"edge0": 0.5, "edge1": 0.25},
                      eval={"edge0": {"eval-loss": 2.0}, "edge1": {"eval-loss": 3.0}},
                      eval_aggregate={"eval-loss": 2.5})
    for k, v in kw.items():
        setattr(rec, k, v)
    return rec.as_dict()


def samples(families) -> dict:
    reg = CollectorRegistry()

    class C:
        def collect(self):
            yield from families
    reg.register(C())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples}


def test_round_facts_as_metrics():
    dp = {"epsilon": 3.5, "max_epsilon": 4.0, "noise_multiplier": 0.5}
    rounds = {1: a_round(1, dropped={"edge2": "update norm 9 > 3 × median 1"}, refused_by=["edge1"]),
              2: a_round(2, dropped={"edge2": "error reply: boom"}, privacy=dp),
              3: a_round(3, train={"edge0": {"train-tokens": 100}}, kept=["edge0"])}  # edge1 never replied
    s = samples(server_families(dict(list(rounds.items())[:2]), {"round": 2, "phase": "complete", "at": 5.0,
                                                                  "round_timeout_s": 60}))
    assert s[(M.SERVER_ROUND, ())] == 2 and s[(M.SERVER_ROUNDS, ())] == 2 and s[(M.SERVER_RUN_ACTIVE, ())] == 1
    assert s[(M.SERVER_STATUS_TIME, ())] == 5 and s[(M.SERVER_ROUND_TIMEOUT, ())] == 60
    assert s[(M.SERVER_ROUND_END, ())] == 1796378520 + 30  # 2026-12-04T10:02:00Z + wall_s
    assert s[(M.SERVER_ROUND_DEADLINE, ())] == 6 and s[(M.SERVER_ROUND_DURATION, ())] == 30
    # round 2: 3 asked, edge0 and edge1 selected (take_part), both replied, both aggregated; edge2's error counts
    assert [s[(M.SERVER_ROUND_EDGES, (("stage", st),))] for st in M.SERVER_ROUND_EDGE_STAGES] == [3, 2, 2, 2, 1]
    dropped = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == M.SERVER_DROPPED}
    assert dropped == {**{label: 0 for label, _ in DROP_REASONS}, "norm": 1, "error": 1}
    s3 = samples(server_families(rounds, None))
    assert [s3[(M.SERVER_ROUND_EDGES, (("stage", st),))] for st in M.SERVER_ROUND_EDGE_STAGES] == [3, 2, 1, 1, 1]
    assert s3[(M.SERVER_DROPPED, (("reason", "no_reply"),))] == 1  # chosen to train, never answered
    assert s[(M.SERVER_AGG_TOKENS, ())] == 150 and s[(M.SERVER_AGG_TOKENS_TOTAL, ())] == 300
    assert s[(M.SERVER_CANARY_REFUSED, ())] == 1
    assert s[(M.SERVER_UPDATE_NORM, (("edge", "edge1"),))] == 0.25
    assert s[(M.SERVER_HOLDOUT_LOSS, ())] == 2.5 and s[(M.SERVER_EDGE_HOLDOUT_LOSS, (("edge", "edge0"),))] == 2.0
    assert s[(M.SERVER_EPSILON, ())] == 3.5 and s[(M.SERVER_MAX_EPSILON, ())] == 4.0
    assert s[(M.SERVER_PRIVACY_ENABLED, ())] == 1
    clip_only = samples(server_families({1: a_round(1, privacy={**dp, "noise_multiplier": 0.0})}, None))
    assert clip_only[(M.SERVER_PRIVACY_ENABLED, ())] == 0  # clipping alone claims no privacy
    done = samples(server_families(rounds, {"round": 2, "phase": "finished"}))
    assert done[(M.SERVER_RUN_ACTIVE, ())] == 0
    before = samples(server_families({}, None))
    assert before[(M.SERVER_ROUND, ())] == 0 and before[(M.SERVER_RUN_ACTIVE, ())] == 0
    assert (M.SERVER_EPSILON, ()) not in before and before[(M.SERVER_PRIVACY_ENABLED, ())] == 0


def test_every_recorded_drop_reason_has_its_label():
    cases = {"error reply: x": "error", "malformed reply: x": "malformed", "expected one ArrayRecord, got 2": "malformed",
             "metrics lack a numeric 'num-examples'": "malformed", "trained on 0 examples": "no_examples",
             "keys/shapes differ from the global: 1 missing key(s)": "shape", "non-finite values in a.b": "non_finite",
             "update norm 5 > 3 × median 1": "norm", "dp: update norm 2 is above clipping_norm 1": "rule",
             "lora_aggregation ffa: the update changed x": "rule", "rank 32 is above the server's lora.r 16": "shape",
             "no reply": "no_reply", "something new": "other"}
    assert {why: drop_reason(why) for why in cases} == cases


def test_the_collector_reads_checkpoint_files_and_follows_a_rewrite(tmp_path):
    c = CheckpointCollector(tmp_path / "ckpt")  # not there yet: the run has not started
    assert samples(c.collect())[(M.SERVER_ROUND, ())] == 0
    for r in (1, 2):
        (tmp_path / "ckpt" / f"round-{r:04d}").mkdir(parents=True)
        write_atomic(tmp_path / "ckpt" / f"round-{r:04d}" / "metrics.json", json.dumps(a_round(r)))
    (tmp_path / "ckpt" / "round-0003").mkdir()  # incomplete: no metrics.json yet
    write_status(tmp_path / "ckpt", {"round": 3, "phase": "train"})
    s = samples(c.collect())
    assert s[(M.SERVER_ROUND, ())] == 2 and s[(M.SERVER_RUN_ACTIVE, ())] == 1
    (tmp_path / "ckpt" / "round-0002" / "metrics.json").unlink()  # a rewrite (write_round) starts by removing it
    s = samples(c.collect())
    assert s[(M.SERVER_ROUND, ())] == 2 and s[(M.SERVER_AGG_TOKENS_TOTAL, ())] == 300  # no total steps back
    write_atomic(tmp_path / "ckpt" / "round-0002" / "metrics.json", json.dumps(a_round(2, kept=["edge0"])))
    assert samples(c.collect())[(M.SERVER_AGG_TOKENS, ())] == 100


# ---------------------------------------------------------------------------- live: a lab with --prometheus
SERVER_YAML = """
dp: {clipping_norm: 10.0, noise_multiplier: 0.5, max_epsilon: 1.0e+9}
lora: {r: 8, alpha: 16}
balancer: {round_deadline_s: 4}
round_timeout_s: 140
query_timeout_s: 20
"""


@pytest.mark.slow
@needs_prometheus
def test_a_lab_with_prometheus_answers_every_dashboard_query(tmp_path):
    assert PROMETHEUS, "prometheus is not installed (COLLM_REQUIRE_PROMETHEUS=1)"
    (tmp_path / "server.yaml").write_text(SERVER_YAML)
    out, log_path = tmp_path / "run", tmp_path / "lab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([str(BIN / "collm-lab"), "--model", "tiny", "--edges", "2", "--rounds", "2", "--load", "2",
                             "--round-deadline", "4", "--server-config", str(tmp_path / "server.yaml"),
                             "--prometheus", "--linger", "600", "--out", str(out)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        while "--linger" not in log_path.read_text():
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        text = log_path.read_text()
        prom = re.search(r"\[lab\] Prometheus: (http://127\.0\.0\.1:\d+)", text).group(1)
        time.sleep(3)  # a few scrapes after the last round's checkpoint

        def query(q: str) -> list:
            r = httpx.get(prom + "/api/v1/query", params={"query": q}, timeout=30).json()
            assert r["status"] == "success", (q, r)
            return r["data"]["result"]

        def finite(result) -> bool:
            return any(math.isfinite(float(s["value"][1])) for s in result)

        empty = [(title, q) for title, q in panel_queries() if not finite(query(q))]
        assert not empty, f"dashboard queries with no series or only NaN: {empty}"
        targets = httpx.get(prom + "/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
        assert sorted(t["labels"]["job"] for t in targets) == ["collm-edge", "collm-edge", "collm-router",
                                                              "collm-server"]
        assert all(t["health"] == "up" for t in targets), targets
        rules = httpx.get(prom + "/api/v1/rules", timeout=30).json()["data"]["groups"]
        assert sum(len(g["rules"]) for g in rules) == 15 and all(r["health"] == "ok" for g in rules for r in g["rules"])
        assert float(query(M.SERVER_ROUND)[0]["value"][1]) == 2
        assert float(query(M.SERVER_RUN_ACTIVE)[0]["value"][1]) == 0  # the run has finished
        assert sorted(s["metric"]["edge"] for s in query(M.ADAPTER_VERSION)) == ["edge0", "edge1"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(120)
    assert not processes_mentioning(str(out)), "the lab left processes behind"
