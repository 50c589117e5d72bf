"""`collm-router --config router.yaml`: the OpenAI-compatible front of several edge replicas.

It binds its port first (a clash is one line at once), polls the edges, and serves until
SIGTERM/SIGINT; then it stops accepting, lets in-flight requests and streams finish within
`api.shutdown_grace_s`, and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from collm.common.config import dump_config, load_config
from collm.common.errors import cli_entry
from collm.common.listen import bind_listen_socket
from collm.common.logs import setup_logging

from collm.router.config import RouterConfig

log = logging.getLogger("collm.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-router", description="Route OpenAI-compatible requests to CoLLM edges.")
    p.add_argument("--config", required=True, help="router YAML config (see configs/router.yaml)")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("--port", type=int, help="override api.port")
    p.add_argument("--policy", help="override routing.policy (slo_pack, slo, round_robin, least_outstanding)")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict = {}
    if args.port is not None:
        overrides["api"] = {"port": args.port}
    if args.policy is not None:
        overrides["routing"] = {"policy": args.policy}
    cfg = load_config(RouterConfig, args.config, overrides or None)
    if args.check:
        sys.stdout.write(dump_config(cfg))
        return 0
    setup_logging()
    return serve(cfg)


def serve(cfg: RouterConfig) -> int:
    import uvicorn

    from collm.router.app import create_app

    sock = bind_listen_socket(cfg.api.host, cfg.api.port)  # before anything slow: a clash is one line
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.api.host, port=cfg.api.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=int(cfg.api.shutdown_grace_s) or None, lifespan="on",
        timeout_keep_alive=int(cfg.api.keepalive_s), **cfg.api.tls.uvicorn_args()))
    # uvicorn handles SIGTERM/SIGINT while serving and re-raises the signal when it returns; these
    # handlers receive that re-raise, so the process exits 0 after a graceful stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("router %s: listening on %s://%s:%d, policy %s, edges: %s", cfg.name,
             "https" if cfg.api.tls.enabled else "http", cfg.api.host, cfg.api.port,
             cfg.routing.policy, ", ".join(f"{e.name}={e.url}" for e in cfg.edges))
    server.run(sockets=[sock])
    log.info("router %s: stopped", cfg.name)
    return 0


if __name__ == "__main__":
    main()
