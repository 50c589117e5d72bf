"""`collm-lab`: a whole local CoLLM lab in one command, stopped cleanly at the end.

It starts, as local processes, the same topology as the Compose lab:

    flower-superlink  ──  collm-server (the ServerApp: strategy + balancer)
          │
    collm-edge × N (one Dolly category split each, federation on)  ──  collm-router (optional)

then sends open-loop Poisson requests through the router (or round-robin to the edges) while the
federated rounds run, and prints each edge's holdout loss per round and what the requests saw.
Everything it writes goes under `--out` (configs, logs, checkpoints, edge state); a non-empty
`--out` is refused unless `--overwrite`, and even then only an earlier lab run's folder is replaced.

An edge that dies is reported and the run goes on while enough edges remain (the server needs
only half of them after round 1); with `--restart-edges` the lab starts it again, and the
restarted edge serves the latest global adapter (read from the checkpoints) before it reports
ready to the router.

With `--keys` the HTTP APIs need keys, generated for this run into `--out`/keys (mode 0600):
`client.key` for `/v1/*` (the router checks it; the edges accept it too), the router's own key
towards the edges (`router.key`), and `admin.key` for each edge's `/admin/*`, which is then on
(adapter loads confined to the lab's checkpoints). Without a key nothing but `/health` and
`/metrics` answers; the keys are never printed, only where they are.

Churn on purpose: `--join edge2@2` starts edge2 only while round 1 trains, so it is connected for
round 2 (it serves the latest global from the checkpoints, then each new one from the federation);
`--leave edge1@3` stops edge1 (SIGTERM) when round 3's training starts, and the round completes
without it. Both repeat; the router lists every edge and sends requests only to those that are up.

With `--prometheus` it also starts `collm-server exporter` (the rounds as metrics, from the
checkpoints) and a real Prometheus on loopback scraping every process each second, with the alert
rules (`collm.lab.monitoring`, docs/monitoring.md); `--linger S` keeps everything up S seconds after
the last round, to look at it.

With `--tls` the Flower traffic is TLS with SuperNode authentication, as in the Compose security
profile: it makes a CA, the SuperLink's certificate and one ECDSA key pair per edge in
`--out`/certs (`collm.lab.certs`), starts the SuperLink with `--ssl-*` and
`--enable-supernode-auth`, registers each edge's public key over the Control API, gives each
edge `federation: {insecure: false, root_certificates, auth_private_key}` and runs
`collm-server --root-certificates`. Every port stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from pathlib import Path

import httpx

from collm.common.config import dump_config, load_config
from collm.common.data import categories, load_records, partition_by_category
from collm.common.errors import cli_entry
from collm.common.procs import BIN_DIR, usable_cpus
from collm.edge_client.config import EdgeConfig
from collm.lab.certs import make_certs, register_nodes
from collm.lab.loadgen import BackgroundLoad, Planned
from collm.lab.lab_cli import build_parser, check_args
from collm.lab.lab_follow import Churn, follow
from collm.lab.monitoring import start_monitoring
from collm.lab.topology import (COORDINATOR_NICE, BASE_MODEL_NAMES, ProcessGroup, edge_config, edge_url, free_port,
                                prepare_out, start_router, stop_on_signals, wait_http, write_config)
from collm.server.config import ServerConfig, round_timeout_for

PROMPTS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
           "Summarize what photosynthesis is in one sentence.", "Name two planets with rings.",
           "What is a good name for a black cat?", "Classify: apple, carrot, banana - which is a vegetable?"]


def make_keys(d: Path) -> dict[str, Path]:
    """This run's keys, one file each (mode 0600): client (for /v1/*), router (its key towards the
    edges), admin (for /admin/*), federation (the ServerApp signs its instructions with it, the edges
    obey only those: common/run_proof.py) and edge-api.keys (the two keys an edge accepts on /v1/*)."""
    d.mkdir(parents=True, exist_ok=True)
    keys = {name: f"collm-{name}-{secrets.token_urlsafe(24)}" for name in ("client", "router", "admin", "federation")}
    paths = {}
    for name, text in [*keys.items(), ("edge-api", f"{keys['client']}\n{keys['router']}")]:
        path = d / f"{name}.key{'s' if name == 'edge-api' else ''}"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(text + "\n")
        paths[name] = path
    return paths


def lab_edge_configs(model: str, n: int, superlink: str, out: Path, cache_dir: str | None = None,
                     certs: dict[str, Path] | None = None, keys: dict[str, Path] | None = None,
                     eval_records: int | None = None, ranks: list[int] | None = None,
                     quantization: list[str] | None = None) -> list[EdgeConfig]:
    """One config per edge: own name, ports, Dolly categories (non-IID) and state dir; the N edges
    share this machine's cores (oversubscribed torch threads spin and stall each other).

    With `certs` (from `make_certs`), each edge talks TLS to the SuperLink and signs in with its
    own key, `certs[name]`. With `keys` (from `make_keys`), /v1/* needs a key and /admin/* (on) the admin
    token. `ranks`: each edge's LoRA rank (a mixed-rank fleet); `quantization`: each edge's base precision
    (none, nf4, int8: bitsandbytes). Every edge catches up from the lab's
    checkpoints when it (re)starts."""
    parts = partition_by_category(load_records(), n)
    threads = max(1, len(usable_cpus()) // n)
    configs = []
    for i, part in enumerate(parts):
        name = f"edge{i}"
        fed: dict = {"bootstrap_from": str(out / "checkpoints")}
        if certs:
            fed.update({"insecure": False, "root_certificates": str(certs["ca"]), "auth_private_key": str(certs[name])})
        overrides = {"federation": fed, "model": {"threads": threads}}
        if eval_records:
            overrides["training"] = {"max_eval_records": eval_records}
        if keys:
            fed["run_key"] = {"file": str(keys["federation"])}
            overrides["auth"] = {"api_keys": {"file": str(keys["edge-api"])}, "admin_tokens": {"file": str(keys["admin"])}}
            overrides["api"] = {"admin": True, "adapter_dir": str(out / "checkpoints")}
        if cache_dir:
            overrides["model"]["cache_dir"] = cache_dir
        if ranks:
            overrides["lora"] = {"r": ranks[i]}
        if quantization:
            overrides["model"]["quantization"] = quantization[i]
        configs.append(edge_config(model, name, out, categories=categories(part), superlink=superlink,
                                   overrides=overrides))
    return configs


def server_config(args, out: Path, edges: list[EdgeConfig], keys: dict[str, Path] | None = None) -> ServerConfig:
    """The ServerApp's config: --server-config with what the lab decides (rounds, edges, paths)."""
    at_start = args.edges - len(getattr(args, "joins", {}))
    overrides: dict = {"rounds": args.rounds, "checkpoint_dir": str(out / "checkpoints"), "min_nodes": at_start,
                       "min_round_nodes": max(1, (at_start + 1) // 2), "base_model_name": BASE_MODEL_NAMES[args.model],
                       "lora": edges[0].lora.model_dump(), "balancer": {}}
    if getattr(args, "ranks", None):
        overrides["lora"] = {**overrides["lora"], "r": max(args.ranks)}
        overrides["lora_aggregation"] = "product"
    if args.strategy:
        overrides["strategy"] = args.strategy
    if args.round_deadline:
        overrides["balancer"]["round_deadline_s"] = args.round_deadline
        overrides["round_timeout_s"] = round_timeout_for(args.round_deadline)
    if args.round_tokens is not None:
        overrides["balancer"]["round_token_budget"] = args.round_tokens
    if keys:
        overrides["federation_key"] = {"file": str(keys["federation"])}
    return load_config(ServerConfig, args.server_config, overrides)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if threading.current_thread() is threading.main_thread():
        stop_on_signals(interrupt_on_signal)  # the lab's processes stop on these too, not only on ^C
    out = prepare_out(Path(args.out), args.overwrite)
    superlink = f"127.0.0.1:{free_port()}"
    certs = make_certs(out / "certs", [f"edge{i}" for i in range(args.edges)]) if args.tls else None
    keys = make_keys(out / "keys") if args.keys else None
    client_key = keys["client"].read_text().strip() if keys else None
    auth = {"Authorization": f"Bearer {client_key}"} if keys else {}
    edges = lab_edge_configs(args.model, args.edges, superlink, out, args.cache_dir, certs, keys, args.eval_records,
                             args.ranks, args.quantization)
    server_cfg = server_config(args, out, edges, keys)
    (out / "server.yaml").write_text(dump_config(server_cfg))
    paths = {e.name: write_config(out / f"{e.name}.yaml", e) for e in edges}
    group = ProcessGroup(out)
    group.superlink = superlink
    t_start = time.time()
    try:
        print(f"[lab] SuperLink on {superlink}; logs in {out / 'logs'}", flush=True)
        start_superlink(group, superlink, certs, edges)
        urls = start_edges(group, edges, paths, args.joins, 600 if args.model == "bundled" else 120)
        targets = [lab_router(group, out, urls, keys)] if args.router else list(urls.values())
        if args.prometheus:
            prom = start_monitoring(group, out, urls, targets[0] if args.router else None, server_cfg.checkpoint_dir)
            print(f"[lab] Prometheus: {prom} (alerts: {prom}/alerts; round exporter: logs/server-metrics.log)",
                  flush=True)
        if keys:
            print(f"[lab] keys: /v1/* needs {keys['client']}, the edges' /admin/* {keys['admin']}", flush=True)
        model_id = httpx.get(targets[0] + "/v1/models", headers=auth).json()["data"][0]["id"]
        loads = [BackgroundLoad(url, args.load / len(targets), _request_maker(model_id), seed=k,
                                api_key=client_key).start()
                 for k, url in enumerate(targets)] if args.load > 0 else []
        print(f"[lab] all up in {time.time() - t_start:.0f} s; running {args.rounds} rounds"
              + (f" under {args.load:g} req/s" if loads else ""), flush=True)
        server_tls = ["--root-certificates", str(certs["ca"])] if certs else ["--insecure"]
        server = group.spawn("server", [str(BIN_DIR / "collm-server"), *server_tls, "--superlink", superlink,
                                        "-c", f'config="{out / "server.yaml"}"'], nice=COORDINATOR_NICE)
        schedule = Churn(args.joins, args.leaves, out / "checkpoints")
        events = follow(group, server, paths, args.restart_edges, server_cfg.nodes_after_first_round, schedule)
        outcomes = [o for load in loads for o in load.stop()]
        rc = server.returncode
        report = {"server_exit": rc, "wall_s": round(time.time() - t_start, 1), "edge_events": events,
                  "load": _load_summary(outcomes) if loads else None, "edges": _adapters(urls, auth)}
        (out / "lab.json").write_text(json.dumps(report, indent=2, default=str))
        _print_report(report, out)
        if args.linger > 0:
            print(f"[lab] --linger: everything stays up {args.linger:g} s more (^C to stop)", flush=True)
            time.sleep(args.linger)
        return 0 if rc == 0 else 1
    finally:
        print("[lab] stopping", flush=True)
        group.stop()


def start_superlink(group: ProcessGroup, superlink: str, certs: dict | None, edges: list[EdgeConfig]) -> None:
    """flower-superlink on loopback (with --tls: its certificate, SuperNode auth, each edge's key registered)."""
    tls = ["--insecure"]
    if certs:
        tls = ["--ssl-ca-certfile", str(certs["ca"]), "--ssl-certfile", str(certs["superlink_cert"]),
               "--ssl-keyfile", str(certs["superlink_key"]), "--enable-supernode-auth"]
    group.spawn("superlink", [str(BIN_DIR / "flower-superlink"), *tls, "--host", "127.0.0.1", "--port",
                              superlink.split(":")[1], "--disable-runtime-dependency-installation"], nice=COORDINATOR_NICE)
    scheme = "https" if certs else "http"
    wait_http(f"{scheme}://{superlink}/health", group, 120, "flower-superlink", ca=certs["ca"] if certs else None)
    if certs:
        pubs = [f"{certs[e.name]}.pub" for e in edges]
        for name, (node_id, _) in register_nodes(superlink, certs["ca"], pubs, wait_s=10).items():
            print(f"[lab] TLS + SuperNode auth: {name} registered as node {node_id} "
                  f"(key {certs[name]})", flush=True)


def start_edges(group: ProcessGroup, edges: list[EdgeConfig], paths: dict[str, Path], joins: dict[str, int],
                ready_s: float) -> dict[str, str]:
    """Every edge but the late joiners, each ready within `ready_s`; {name: URL} of all of them."""
    for e in edges:
        if e.name not in joins:
            group.spawn(e.name, [str(BIN_DIR / "collm-edge"), "--config", str(paths[e.name])])
    urls = {e.name: edge_url(e) for e in edges}
    for e in edges:
        late = f"  (joins for round {joins[e.name]})" if e.name in joins else ""
        print(f"[lab] {e.name}: {urls[e.name]}  categories={e.data.categories}{late}", flush=True)
    for name, url in urls.items():
        if name not in joins:
            wait_http(url + "/health", group, ready_s, f"edge {name}")
    group.expendable.update(urls)  # from now on an edge that dies is reported, not fatal
    return urls


def lab_router(group: ProcessGroup, out: Path, urls: dict[str, str], keys: dict[str, Path] | None) -> str:
    """collm-router in front of every edge (with the lab's keys when it has them); its URL."""
    auth = ({"auth": {"api_keys": {"file": str(keys["client"])}}, "edge_key": {"file": str(keys["router"])}}
            if keys else {})
    url = start_router(group, out, urls, auth)
    print(f"[lab] router: {url}", flush=True)
    return url


def _adapters(urls: dict[str, str], auth: dict) -> dict[str, dict]:
    """Each edge's /v1/adapters at the end (what it serves), or the error that kept it from answering."""
    out = {}
    for name, url in urls.items():
        try:
            out[name] = httpx.get(url + "/v1/adapters", headers=auth, timeout=10).json()
        except (httpx.HTTPError, ValueError) as e:
            out[name] = {"error": str(e)}
    return out


def _print_report(report: dict, out: Path) -> None:
    summary = {k: v for k, v in (report["load"] or {}).items() if k != "requests"}  # per request: lab.json
    print(f"[lab] requests during the rounds: {summary or None}", flush=True)
    for name, view in report["edges"].items():
        if "serving_version" in view:
            print(f"[lab] {name}: serving adapter version {view['serving_version']} "
                  f"(round {view['round']}, holdout loss {view['eval_loss']})", flush=True)
    print(f"[lab] done in {report['wall_s']} s; report {out / 'lab.json'}", flush=True)


def _request_maker(model_id: str, max_tokens: int = 24):
    def make(i: int) -> Planned:
        body = {"model": model_id, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
                # the lab's load checks that every request is served across swaps and failures, not
                # latency: its generous target keeps the router's admission from refusing any of it
                "slo": {"ttft_ms": 60_000, "tpot_ms": 60_000}}
        # not streamed: the router can retry it on another edge until it is complete (an edge may die)
        return Planned(0.0, body, ttft_slo_s=60.0, tpot_slo_s=60.0, stream=False)

    return make


def _load_summary(outcomes) -> dict:
    ok = [o for o in outcomes if o.completed]
    versions = sorted({o.adapter_version for o in ok if o.adapter_version is not None})
    return {"sent": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok),
            "adapter_versions_seen": versions, "edges_seen": sorted({o.edge for o in ok if o.edge}),
            "failures": sorted({str(o.status) for o in outcomes if not o.completed}),
            "requests": [{"edge": o.edge, "version": o.adapter_version, "status": o.status} for o in outcomes]}


def interrupt_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
