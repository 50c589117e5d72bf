"""`collm-edge status` and `collm-edge adapters ...`: look at and steer a running edge, for the people who run it.

    collm-edge status   [--url URL | --config edge.yaml]                 health, load, serving version, rounds
    collm-edge adapters [--url ...] list                                  servable models and the swap history
    collm-edge adapters [--url ...] rollback VERSION                      serve a retained version again (admin)

`pin` is another name for `rollback`. The API key and the admin token come from --key/--token or
the COLLM_API_KEY / COLLM_ADMIN_TOKEN environment variables. Every failure is one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from collm.common.errors import UserError

COMMANDS = ("status", "adapters")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-edge", description="Look at and steer a running collm-edge.")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--url", help="the edge's base URL (default: from --config, else http://127.0.0.1:8080)")
    where.add_argument("--config", help="the edge's YAML config, to find its host and port")
    where.add_argument("--key", default=os.environ.get("COLLM_API_KEY"), help="API key (env COLLM_API_KEY)")
    where.add_argument("--token", default=os.environ.get("COLLM_ADMIN_TOKEN"),
                       help="admin token (env COLLM_ADMIN_TOKEN)")
    where.add_argument("--json", action="store_true", help="print the raw JSON")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[where], help="health, load, serving adapter and federation rounds")
    ad = sub.add_parser("adapters", parents=[where], help="list servable adapters, or roll back to one")
    ad_sub = ad.add_subparsers(dest="action")
    ad_sub.add_parser("list", help="servable models and the swap history (the default)")
    for name in ("rollback", "pin"):
        rb = ad_sub.add_parser(name, help="serve a retained version again (needs the admin token)")
        rb.add_argument("version", type=int)
    return p


def _base_url(args) -> str:
    if args.url:
        return args.url.rstrip("/")
    if args.config:
        from collm.common.config import load_config
        from collm.edge_client.config import EdgeConfig

        cfg = load_config(EdgeConfig, args.config)
        host = "127.0.0.1" if cfg.api.host in ("0.0.0.0", "::") else cfg.api.host
        return f"http://{host}:{cfg.api.port}"
    return "http://127.0.0.1:8080"


def _call(method: str, url: str, token: str | None, **kw) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.request(method, url, headers=headers, timeout=30, **kw)
    except httpx.HTTPError as e:
        raise UserError(f"{url}: cannot reach the edge ({type(e).__name__}: {e}); is it running, and is --url right?")
    try:
        body = r.json()
    except ValueError:
        raise UserError(f"{url}: answered {r.status_code} with a body that is not JSON") from None
    if r.status_code >= 400 and "error" in body:
        err = body["error"]
        hint = {401: " (give --key / --token)", 403: " (give the admin --token)"}.get(r.status_code, "")
        raise UserError(f"{url}: {r.status_code} {err.get('message')}{hint}")
    return body


def status(base: str, args) -> dict:
    return _call("GET", base + "/health", args.key)


def _print_status(h: dict) -> None:
    fed = h.get("federation") or {}
    print(f"edge {h.get('edge')}: {h.get('status')}, model {h.get('model')}, serving adapter version "
          f"{h.get('adapter_version')}, uptime {h.get('uptime_s')} s")
    print(f"  running {h.get('running')}, waiting {h.get('waiting')}, background jobs {h.get('jobs')}")
    if fed:
        last = fed.get("last_eval") or {}
        print(f"  federation: {fed.get('rounds_trained')} rounds trained, last round {fed.get('last_round')}, "
              f"last holdout loss {last.get('loss')}" + (f", refused {fed['refused']}" if fed.get("refused") else ""))


def _print_adapters(models: dict, view: dict) -> None:
    print(f"serving version {view.get('serving_version')} (round {view.get('round')}, source {view.get('source')}); "
          f"retained {view.get('retained')}")
    for m in models.get("data", []):
        loss = m.get("eval_loss")
        print(f"  {m['id']:<28} version {str(m.get('adapter_version')):>5}  round {str(m.get('round')):>4}  "
              f"loss {'-' if loss is None else f'{loss:.4f}'}  sha256 {(m.get('sha256') or '-')[:12]}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    base = _base_url(args)
    if args.command == "status":
        h = status(base, args)
        if args.json:
            print(json.dumps(h, indent=2))
        else:
            _print_status(h)
        return 0
    if args.action in ("rollback", "pin"):
        view = _call("POST", base + "/admin/rollback", args.token, json={"version": args.version})
        print(json.dumps(view, indent=2) if args.json else f"serving version {view['serving_version']} again")
        return 0
    models = _call("GET", base + "/v1/models", args.key)
    view = _call("GET", base + "/v1/adapters", args.key)
    if args.json:
        print(json.dumps({"models": models, "adapters": view}, indent=2))
    else:
        _print_adapters(models, view)
    return 0


def wants(argv: list[str]) -> bool:
    return bool(argv) and argv[0] in COMMANDS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
