"""The processes of one collm-bench mode (`ModeRun`: SuperLink, edges, router and, if it trains, the ServerApp,
with each mode's roles and variant settings), and the check of every mode's configs before a run starts."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import httpx
import yaml

from collm.common import metric_names as M
from collm.common.config import deep_merge, validate_config
from collm.common.data import categories, load_records, partition_by_category
from collm.common.errors import UserError
from collm.common.procs import BIN_DIR
from collm.common.rounds import complete_rounds, read_status
from collm.lab.bench_config import BenchConfig, edge_policy, is_collm, mode_roles, router_policy, variant_of
from collm.lab.topology import (COORDINATOR_NICE, BASE_MODEL_NAMES, ProcessGroup, edge_config, edge_url, free_port,
                                replica_cores, repo_file, start_router, wait_http, write_config)
from collm.router.state import parse_prometheus
from collm.server.config import ServerConfig, round_timeout_for


class ModeRun:
    """The processes of one mode: SuperLink, edges, router and (if it trains) the ServerApp."""

    def __init__(self, cfg: BenchConfig, mode: str, out: Path):
        self.cfg, self.mode, self.out = cfg, mode, out
        out.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(out)
        self.roles = mode_roles(mode, cfg.replicas)
        self.trains = any("train" in r for r in self.roles)
        self.superlink = f"127.0.0.1:{free_port()}" if self.trains else None
        self.group.superlink = self.superlink  # so stop() also ends the ServerApp the SuperLink detached
        parts = [categories(p) for p in partition_by_category(load_records(), cfg.replicas)]
        if mode == "isolated":  # the training half holds all the training data, two domains each
            half = cfg.replicas // 2
            parts = [parts[i] + parts[i + half] for i in range(half)] * 2
        self.edges = []
        self.admin_token = secrets.token_urlsafe(24)  # the isolated serving replicas' admin API: this run only
        for i, role in enumerate(self.roles):
            cores = replica_cores(i, cfg.replicas)
            training = {"co_schedule": edge_policy(mode, cfg.co_schedule),
                        "busy_share": cfg.busy_share if is_collm(mode) else 0.0,
                        "max_eval_records": cfg.federation.eval_records}
            name = f"{role.replace('+', '-')}{i}"
            self.edges.append(edge_config(
                cfg.model, name, out, categories=parts[i],
                superlink=self.superlink if "train" in role else None,
                overrides=deep_merge(deep_merge(cfg.edge, {
                    "slo": {"ttft_ms": cfg.ttft_ms, "tpot_ms": cfg.tpot_ms}, "training": training,
                    "model": {"cpu_affinity": cores, "threads": len(cores)},
                    **({"engine": {"timeline": str(out / f"timeline-{name}.jsonl")}} if cfg.timeline else {}),
                    "api": {"admin": mode == "isolated" and role == "serve", "adapter_dir": str(out / "checkpoints")},
                    "auth": {"admin_tokens": {"keys": [self.admin_token]}}}),
                    variant_of(mode, cfg.variants).edge)))  # last: a variant may change what the bench sets
        self.urls = {e.name: edge_url(e) for e in self.edges}
        self.reloads: list[dict] = []
        self._stop = threading.Event()
        self.router = ""
        self.model_id = self.base_model = BASE_MODEL_NAMES[cfg.model]

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def start(self) -> None:
        g = self.group
        if self.trains:
            g.spawn("superlink", [str(BIN_DIR / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                  "--port", self.superlink.split(":")[1], "--disable-runtime-dependency-installation"], nice=COORDINATOR_NICE)
        for e in self.edges:
            g.spawn(e.name, [str(BIN_DIR / "collm-edge"), "--config", str(write_config(self.out / f"{e.name}.yaml", e))])
        for name, url in self.urls.items():
            wait_http(url + "/health", g, 900 if self.cfg.model == "bundled" else 120, f"edge {name}")
        serving = [e for e, role in zip(self.edges, self.roles) if "serve" in role]
        self.router = start_router(g, self.out, {e.name: self.urls[e.name] for e in serving}, self.router_settings())
        served = httpx.get(self.router + "/v1/models").json()["data"][0]  # the default: the global adapter
        self.model_id, self.base_model = served["id"], served.get("root") or served["id"]
        if self.trains:
            self._start_server()
            self._wait_first_round()
        if self.mode == "isolated":
            threading.Thread(target=self._reload_serving_replicas, daemon=True).start()

    def router_settings(self) -> dict:
        """What the mode's router config sets: its policy, then the variant's settings."""
        return deep_merge({"routing": {"policy": router_policy(self.mode, self.cfg.collm_routing)}},
                          variant_of(self.mode, self.cfg.variants).router)

    def server_config(self, base_model: str) -> dict:
        """The ServerApp's config: configs/server.yaml with the bench's federation settings, the variant's last."""
        f = self.cfg.federation
        trainers = [e for e, role in zip(self.edges, self.roles) if "train" in role]
        server = yaml.safe_load(repo_file("configs/server.yaml").read_text())
        server.update({"rounds": f.rounds, "min_nodes": len(trainers), "checkpoint_dir": str(self.ckpt_dir),
                       "round_timeout_s": round_timeout_for(f.round_deadline_s), "query_timeout_s": 60,
                       "base_model_name": base_model, "lora": trainers[0].lora.model_dump()})
        server["balancer"].update({"round_deadline_s": f.round_deadline_s, "round_token_budget": f.round_token_budget,
                                   "lr": f.lr, "lr_decay": f.lr_decay, "lr_min": f.lr_min,
                                   "mode": "slo" if is_collm(self.mode) else "uniform"})
        return deep_merge(server, variant_of(self.mode, self.cfg.variants).server)

    def _start_server(self) -> None:
        wait_http(f"http://{self.superlink}/health", self.group, 120, "flower-superlink")
        (self.out / "server.yaml").write_text(yaml.safe_dump(self.server_config(self.base_model)))
        self.group.spawn("server", [str(BIN_DIR / "collm-server"), "--insecure", "--superlink", self.superlink,
                                    "-c", f'config="{self.out / "server.yaml"}"'], nice=COORDINATOR_NICE)

    def _wait_first_round(self, timeout: float = 300) -> None:
        """Start measuring only once round 1 is planned (the ServerApp's start-up takes seconds)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.group.check_alive(ignore=("server",))
            server = self.group.get("server")
            if server.poll() is not None:
                raise UserError(f"the ServerApp exited with status {server.returncode} before round 1 "
                                f"(see {self.group.log_path('server')})")
            if (read_status(self.ckpt_dir) or {}).get("round", 0) >= 1:
                return
            time.sleep(0.25)
        raise UserError(f"the ServerApp did not start round 1 within {timeout:.0f} s "
                        f"(see {self.group.log_path('server')})")

    def _reload_serving_replicas(self) -> None:
        """The isolated deployment: after each round, the serving replicas load the new adapter from disk."""
        seen = 0
        while not self._stop.wait(0.5):
            for r in [r for r in complete_rounds(self.ckpt_dir) if r > seen]:
                for e, role in zip(self.edges, self.roles):
                    if role == "serve":
                        t0 = time.time()
                        resp = httpx.post(self.urls[e.name] + "/admin/adapters",
                                          json={"path": str(self.ckpt_dir / f"round-{r:04d}"), "version": r},
                                          headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60)
                        self.reloads.append({"round": r, "edge": e.name, "status": resp.status_code,
                                             "at": time.time(), "seconds": time.time() - t0})
                seen = r

    def training_tokens(self) -> float:
        """Training tokens all replicas have processed so far (their /metrics counters)."""
        total = 0.0
        for url in self.urls.values():
            try:
                total += parse_prometheus(httpx.get(url + "/metrics", timeout=10).text).get(M.TRAIN_TOKENS, 0.0)
            except (httpx.HTTPError, ValueError):
                pass
        return total

    def stop(self) -> None:
        self._stop.set()
        self.group.stop()



def check_mode_configs(cfg: BenchConfig) -> None:
    """Every mode's edge, server and router configs (the variants' settings merged in), validated before anything
    runs: a typo in a variant is one line now, not a failed start after serve-only's capacity search."""
    import tempfile

    from collm.router.config import RouterConfig

    with tempfile.TemporaryDirectory(prefix="collm-bench-check-") as tmp:
        for mode in dict.fromkeys(cfg.modes):
            run = ModeRun(cfg, mode, Path(tmp) / mode)  # builds and validates each edge's config
            if run.trains:
                validate_config(ServerConfig, run.server_config(run.base_model), f"{mode}'s server config")
            edges = [{"name": "e", "url": "http://127.0.0.1:1"}]
            validate_config(RouterConfig, {**run.router_settings(), "edges": edges}, f"{mode}'s router config")
