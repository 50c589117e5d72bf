"""`collm-lab`: a whole local CoLLM lab in one command, stopped cleanly at the end.

It starts, as local processes, the same topology as the Compose lab:

    flower-superlink  ──  collm-server (the ServerApp: strategy + balancer)
          │
    collm-edge × N (one Dolly category split each, federation on)  ──  collm-router (optional)

then sends requests through the router (or round-robin to the edges) while the federated rounds
run, and prints each edge's holdout loss per round and what the requests saw. Everything it
writes goes under `--out` (configs, logs, checkpoints, edge state).

With `--tls` the Flower traffic is TLS with SuperNode authentication, as in the Compose security
profile: it makes a CA, the SuperLink's certificate and one ECDSA key pair per edge in
`--out`/certs (`collm.lab.certs`), starts the SuperLink with `--ssl-*` and
`--enable-supernode-auth`, registers each edge's public key over the Control API, gives each
edge `federation: {insecure: false, root_certificates, auth_private_key}` and runs
`collm-server --root-certificates`. Every port stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from collm.common.config import load_config
from collm.edge_client.config import EdgeConfig
from collm.common.data import categories, load_records, partition_by_category
from collm.common.errors import UserError, cli_entry
from collm.common.procs import BIN_DIR, child_env, end_stragglers, usable_cpus

from collm.lab.certs import make_certs, register_nodes

BASE_CONFIGS = {"tiny": "configs/edge-tiny.yaml", "bundled": "configs/edge-smollm2.yaml"}
PROMPTS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
           "Summarize what photosynthesis is in one sentence.", "Name two planets with rings.",
           "What is a good name for a black cat?", "Classify: apple, carrot, banana - which is a vegetable?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """Owns the lab's processes; `stop()` ends them all (edges gracefully, then the SuperLink)."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.superlink: str | None = None  # host:port, for the processes the SuperLink detaches
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        log = open(self.out / "logs" / f"{name}.log", "w")
        env = child_env(**kw.pop("env", {}))
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, **kw)
        self.procs.append((name, p))
        return p

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None and name != "server":
                raise UserError(f"{name} exited with status {p.returncode}; see {self.out / 'logs' / (name + '.log')}")

    def stop(self) -> None:
        for name, p in reversed(self.procs):  # edges and router first, the SuperLink last
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 45
        for name, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self.superlink:
            end_stragglers(self.superlink, 15)


def edge_configs(model: str, n: int, superlink: str, out: Path, cache_dir: str | None,
                 certs: dict[str, Path] | None = None) -> list[dict]:
    """One config per edge: own name, ports, Dolly categories (non-IID) and state dir.

    With `certs` (from `make_certs`), each edge talks TLS to the SuperLink and signs in with its
    own key, `certs[name]`."""
    base = yaml.safe_load(Path(BASE_CONFIGS[model]).read_text())
    parts = partition_by_category(load_records(), n)
    configs = []
    for i, part in enumerate(parts):
        cfg = json.loads(json.dumps(base))
        cfg["name"] = f"edge{i}"
        cfg.setdefault("api", {}).update({"host": "127.0.0.1", "port": free_port(), "admin": True})
        cfg["data"] = {**cfg.get("data", {}), "categories": categories(part)}
        cfg["federation"] = {"enabled": True, "superlink": superlink, "runtime_port": free_port()}
        if certs:
            cfg["federation"].update({"insecure": False, "root_certificates": str(certs["ca"]),
                                      "auth_private_key": str(certs[cfg["name"]])})
        cfg["state_dir"] = str(out / "state" / f"edge{i}")
        if cache_dir:
            cfg["model"]["cache_dir"] = cache_dir
        # N edges share this machine's cores: oversubscribed torch threads spin and stall each other
        cfg["model"]["threads"] = max(1, len(usable_cpus()) // n)
        configs.append(cfg)
    return configs


def wait_http(url: str, lab: Lab, timeout: float, what: str, ca: Path | None = None) -> None:
    """Wait until `url` answers 200 (`ca`: verify an https server with this CA file)."""
    verify = ssl.create_default_context(cafile=str(ca)) if ca else True
    deadline = time.time() + timeout
    while time.time() < deadline:
        lab.check_alive()
        try:
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise UserError(f"{what} did not become ready within {timeout:.0f} s (see {lab.out / 'logs'})")


class Load:
    """Open-loop Poisson requests at `rate` per second, each to the next target in turn."""

    def __init__(self, targets: list[str], rate: float, model: str, max_tokens: int = 24):
        self.targets, self.rate, self.model, self.max_tokens = targets, rate, model, max_tokens
        self.stop = threading.Event()
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, i: int) -> None:
        url = self.targets[i % len(self.targets)]
        body = {"model": self.model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": self.max_tokens, "temperature": 0.7, "seed": i}
        t0 = time.time()
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            ok = r.status_code == 200
            res = {"status": r.status_code, "version": r.headers.get("X-CoLLM-Adapter-Version"),
                   "edge": r.headers.get("X-CoLLM-Edge"), "slo_met": ok and r.json()["collm"]["slo_met"]}
        except httpx.HTTPError as e:
            ok, res = False, {"status": type(e).__name__}
        res["e2e_s"] = time.time() - t0
        with self.lock:
            self.results.append(res)

    def _run(self) -> None:
        rng, i = random.Random(0), 0
        while not self.stop.wait(rng.expovariate(self.rate)):
            threading.Thread(target=self._one, args=(i,), daemon=True).start()
            i += 1

    def summary(self) -> dict:
        with self.lock:
            res = list(self.results)
        ok = [r for r in res if r["status"] == 200]
        versions = sorted({int(r["version"]) for r in ok if r.get("version") is not None})
        return {"sent": len(res), "ok": len(ok), "failed": len(res) - len(ok),
                "slo_met": sum(1 for r in ok if r["slo_met"]), "adapter_versions_seen": versions}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-lab", description="Run a local CoLLM lab: SuperLink, ServerApp, "
                                "N edges (and a router), federated rounds under request load.")
    p.add_argument("--model", choices=sorted(BASE_CONFIGS), default="tiny")
    p.add_argument("--edges", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-config", default="configs/server.yaml")
    p.add_argument("--strategy", choices=["fedavg", "fedprox", "fedadam"])
    p.add_argument("--round-deadline", type=float, help="seconds of training per round (balancer.round_deadline_s)")
    p.add_argument("--round-tokens", type=int, help="training tokens per round, all edges (balancer budget)")
    p.add_argument("--load", type=float, default=1.0, help="requests per second during the rounds (0: none)")
    p.add_argument("--router", action=argparse.BooleanOptionalAction, default=True,
                   help="send the load through collm-router (default) or straight to the edges")
    p.add_argument("--out", default="runs/lab")
    p.add_argument("--cache-dir", help="model cache (default: the edge config's)")
    p.add_argument("--tls", action="store_true", help="TLS to the SuperLink and SuperNode authentication: "
                   "certificates and edge keys in OUT/certs, each edge's key registered before it starts")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt_on_signal)  # stop the lab's processes on SIGTERM too, not only on ^C
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    superlink = f"127.0.0.1:{free_port()}"

    server_cfg = yaml.safe_load(Path(args.server_config).read_text())
    server_cfg.update({"rounds": args.rounds, "checkpoint_dir": str(out / "checkpoints"),
                       "min_nodes": args.edges})
    if args.strategy:
        server_cfg["strategy"] = args.strategy
    if args.round_deadline:
        server_cfg["balancer"]["round_deadline_s"] = args.round_deadline
        server_cfg["round_timeout_s"] = max(server_cfg.get("round_timeout_s", 0), 3 * args.round_deadline + 120)
    if args.round_tokens:
        server_cfg["balancer"]["round_token_budget"] = args.round_tokens
    certs = make_certs(out / "certs", [f"edge{i}" for i in range(args.edges)]) if args.tls else None
    edges = edge_configs(args.model, args.edges, superlink, out, args.cache_dir, certs)
    server_cfg["base_model_name"] = "smollm2-135m-instruct" if args.model == "bundled" else "collm-tiny"
    server_cfg["lora"] = {k: v for k, v in edges[0].get("lora", {}).items()}
    (out / "server.yaml").write_text(yaml.safe_dump(server_cfg))
    for cfg in edges:
        path = out / f"{cfg['name']}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        load_config(EdgeConfig, path)  # fail here, on one line, rather than in a child process

    lab = Lab(out)
    lab.superlink = superlink
    t_start = time.time()
    try:
        print(f"[lab] SuperLink on {superlink}; logs in {out / 'logs'}", flush=True)
        tls = ["--insecure"]
        if certs:
            tls = ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["superlink_cert"]),
                   "--ssl-keyfile", str(certs["superlink_key"]), "--enable-supernode-auth"]
        lab.spawn("superlink", [str(BIN_DIR / "flower-superlink"), *tls, "--host", "127.0.0.1", "--port",
                                superlink.split(":")[1], "--disable-runtime-dependency-installation"])
        if certs:
            wait_http(f"https://{superlink}/health", lab, 60, "flower-superlink (TLS)", ca=certs["ca"])
            pubs = [f"{certs[cfg['name']]}.pub" for cfg in edges]
            for name, (node_id, _) in register_nodes(superlink, certs["ca"], pubs, wait_s=10).items():
                print(f"[lab] TLS + SuperNode auth: {name} registered as node {node_id} "
                      f"(key {certs[name]})", flush=True)
        for cfg in edges:
            lab.spawn(cfg["name"], [str(BIN_DIR / "collm-edge"), "--config", str(out / f"{cfg['name']}.yaml")])
        urls = [f"http://127.0.0.1:{cfg['api']['port']}" for cfg in edges]
        for cfg, url in zip(edges, urls):
            print(f"[lab] {cfg['name']}: {url}  categories={cfg['data']['categories']}", flush=True)
        for url in urls:
            wait_http(url + "/health", lab, 600 if args.model == "bundled" else 120, f"edge {url}")
        targets = urls
        if args.router:
            router_port = free_port()
            rcfg = {"api": {"host": "127.0.0.1", "port": router_port},
                    "edges": [{"name": c["name"], "url": u} for c, u in zip(edges, urls)]}
            (out / "router.yaml").write_text(yaml.safe_dump(rcfg))
            lab.spawn("router", [str(BIN_DIR / "collm-router"), "--config", str(out / "router.yaml")])
            targets = [f"http://127.0.0.1:{router_port}"]
            wait_http(targets[0] + "/health", lab, 60, "collm-router")
            print(f"[lab] router: {targets[0]}", flush=True)
        model_id = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        load = Load(targets, args.load, model_id) if args.load > 0 else None
        if load:
            load.thread.start()
        print(f"[lab] all up in {time.time() - t_start:.0f} s; running {args.rounds} rounds"
              + (f" under {args.load:g} req/s" if load else ""), flush=True)
        server_tls = ["--root-certificates", str(certs["ca"])] if certs else ["--insecure"]
        server = lab.spawn("server", [str(BIN_DIR / "collm-server"), *server_tls, "--superlink", superlink,
                                      "-c", f'config="{out / "server.yaml"}"'])
        _follow(out / "logs" / "server.log", server, lab)
        if load:
            load.stop.set()
            time.sleep(1.0)
        rc = server.returncode
        report = {"server_exit": rc, "wall_s": round(time.time() - t_start, 1),
                  "load": load.summary() if load else None,
                  "edges": {c["name"]: httpx.get(u + "/v1/adapters").json() for c, u in zip(edges, urls)}}
        (out / "lab.json").write_text(json.dumps(report, indent=2, default=str))
        print(f"[lab] requests during the rounds: {report['load']}", flush=True)
        for name, view in report["edges"].items():
            print(f"[lab] {name}: serving adapter version {view['serving_version']} "
                  f"(round {view['round']}, holdout loss {view['eval_loss']})", flush=True)
        print(f"[lab] done in {report['wall_s']} s; report {out / 'lab.json'}", flush=True)
        return 0 if rc == 0 else 1
    finally:
        print("[lab] stopping", flush=True)
        lab.stop()


def interrupt_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt


def _follow(path: Path, proc: subprocess.Popen, lab: Lab) -> None:
    """Echo the ServerApp's log (rounds, balancer decisions, the loss table) until it exits."""
    pos = 0
    while True:
        time.sleep(0.5)
        text = path.read_text(errors="replace")
        if len(text) > pos:
            sys.stdout.write(text[pos:])
            sys.stdout.flush()
            pos = len(text)
        if proc.poll() is not None:
            text = path.read_text(errors="replace")
            sys.stdout.write(text[pos:])
            return
        lab.check_alive()


if __name__ == "__main__":
    sys.exit(main())
