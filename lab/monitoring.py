"""`collm-lab --prometheus`: the round exporter and a real Prometheus on loopback, scraping the run.

Prometheus is Debian's package (`apt-get install prometheus`), run as the lab's own process with its
config, the alert rules and its data under OUT/prometheus; it scrapes every second so a short lab
fills the dashboard's queries (collm.monitoring).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from collm.common.errors import UserError
from collm.common.procs import BIN_DIR
from collm.lab.topology import COORDINATOR_NICE, ProcessGroup, free_port, wait_http
from collm.monitoring import ALERTS, scrape_config

INSTALL_HINT = "install Debian's package (apt-get install prometheus) or put a prometheus binary on PATH"


def prometheus_binary() -> str:
    """The `prometheus` to run, or a UserError saying how to get one."""
    found = shutil.which("prometheus")
    if not found:
        raise UserError(f"--prometheus: no `prometheus` on PATH; {INSTALL_HINT}")
    return found


def host_port(url: str) -> str:
    return urlsplit(url).netloc


def start_monitoring(group: ProcessGroup, out: Path, edges: dict[str, str], router: str | None,
                     checkpoint_dir: str | Path, interval_s: float = 1.0) -> str:
    """Start `collm-server exporter` over the run's checkpoints and Prometheus scraping it, every edge
    (`edges`: name -> URL) and the router (URL or None); returns Prometheus's URL once it is ready."""
    binary = prometheus_binary()
    exporter_port = free_port()
    group.spawn("server-metrics", [str(BIN_DIR / "collm-server"), "exporter", str(checkpoint_dir),
                                   "--port", str(exporter_port)], nice=COORDINATOR_NICE)
    d = out / "prometheus"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ALERTS, d / "alerts.yml")
    cfg = scrape_config({n: host_port(u) for n, u in edges.items()}, host_port(router) if router else None,
                        f"127.0.0.1:{exporter_port}", interval_s=interval_s, rule_files=["alerts.yml"])
    (d / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = free_port()
    group.spawn("prometheus", [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                               f"--web.listen-address=127.0.0.1:{port}"], nice=COORDINATOR_NICE)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"http://127.0.0.1:{exporter_port}/metrics", group, 60, "collm-server exporter")
    wait_http(url + "/-/ready", group, 60, "prometheus")
    return url
