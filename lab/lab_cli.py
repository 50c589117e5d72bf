"""collm-lab's command line: its flags and every check of them, before anything is written or started."""

from __future__ import annotations

import argparse
from pathlib import Path

from collm.common.config import load_config
from collm.common.errors import UserError
from collm.lab.monitoring import prometheus_binary
from collm.lab.topology import BASE_CONFIGS, config_path
from collm.server.config import ServerConfig


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated ranks, e.g. 4,8,16") from None
    if any(not 1 <= r <= 256 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: each rank must be 1 to 256")
    return ranks


def _precisions(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",")]
    if bad := [x for x in out if x not in ("none", "nf4", "int8")]:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]!r} is not none, nf4 or int8")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-lab", description="Run a local CoLLM lab: SuperLink, ServerApp, "
                                "N edges (and a router), federated rounds under request load.")
    p.add_argument("--model", choices=sorted(BASE_CONFIGS), default="tiny")
    p.add_argument("--edges", type=int, default=3, help="edges to start, 1 to 8 (one Dolly category group each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-config", default="configs/server.yaml")
    p.add_argument("--strategy", choices=["fedavg", "fedprox", "fedadam"])
    p.add_argument("--round-deadline", type=float, help="seconds of training per round (balancer.round_deadline_s)")
    p.add_argument("--round-tokens", type=int, help="training tokens per round, all edges (balancer budget)")
    p.add_argument("--load", type=float, default=1.0, help="requests per second during the rounds (0: none)")
    p.add_argument("--router", action=argparse.BooleanOptionalAction, default=True,
                   help="send the load through collm-router (default) or straight to the edges")
    p.add_argument("--restart-edges", action="store_true", help="start an edge that died again (it catches up "
                   "to the latest global adapter before it serves)")
    p.add_argument("--join", action="append", default=[], metavar="EDGE@ROUND",
                   help="start EDGE late, connected for ROUND (2 or later); repeatable")
    p.add_argument("--leave", action="append", default=[], metavar="EDGE@ROUND",
                   help="stop EDGE when ROUND's training starts; repeatable")
    p.add_argument("--out", default="runs/lab")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier lab run's results in --out")
    p.add_argument("--cache-dir", help="model cache (default: the edge config's)")
    p.add_argument("--eval-records", type=int, help="holdout records per evaluation on each edge "
                   "(training.max_eval_records; default: the edge config's)")
    p.add_argument("--keys", action="store_true", help="require API keys (generated into OUT/keys) for /v1/* "
                   "and an admin token for the edges' /admin/* (then on)")
    p.add_argument("--ranks", type=_ranks, metavar="R,R,...", help="each edge's LoRA rank, e.g. 4,8,16: a mixed-rank "
                   "fleet, aggregated exactly as products and served at each edge's rank (lora_aggregation product; "
                   "the server's lora.r is the largest)")
    p.add_argument("--quantization", type=_precisions, metavar="Q,Q,...", help="each edge's base precision: none, "
                   "nf4 or int8 (bitsandbytes; LoRA trains on the quantized base, QLoRA), e.g. none,nf4,none")
    p.add_argument("--prometheus", action="store_true", help="also start the round exporter and a real "
                   "Prometheus on loopback scraping every process, with the alert rules (needs `prometheus`: "
                   "apt-get install prometheus); its URL is printed and its data kept in OUT/prometheus")
    p.add_argument("--linger", type=float, default=0, metavar="SECONDS",
                   help="keep every process up this long after the last round (to look at Prometheus or the "
                   "edges); ^C ends it early")
    p.add_argument("--tls", action="store_true", help="TLS to the SuperLink and SuperNode authentication: "
                   "certificates and edge keys in OUT/certs, each edge's key registered before it starts")
    return p


def check_churn(args) -> tuple[dict[str, int], dict[str, int]]:
    """--join and --leave as {edge: round} each, or a UserError naming the bad value."""
    names = [f"edge{i}" for i in range(args.edges)]
    joins, leaves = {}, {}
    for flag, specs, first, table in (("--join", args.join, 2, joins), ("--leave", args.leave, 1, leaves)):
        for spec in specs:
            name, _, rnd = spec.partition("@")
            if name not in names:
                raise UserError(f"{flag} {spec}: no edge named {name!r} (with --edges {args.edges}: {', '.join(names)})")
            if not rnd.isdigit() or not first <= int(rnd) <= args.rounds:
                raise UserError(f"{flag} {spec}: give EDGE@ROUND with ROUND from {first} to --rounds {args.rounds}")
            if name in table:
                raise UserError(f"{flag}: {name} is named twice")
            table[name] = int(rnd)
    for name in set(joins) & set(leaves):
        if leaves[name] <= joins[name]:
            raise UserError(f"--leave {name}@{leaves[name]}: it joins at round {joins[name]}; leave later than that")
    if len(joins) >= args.edges:
        raise UserError(f"--join: at least one of the {args.edges} edges must be there from the start")
    if (joins or leaves) and not args.router:
        raise UserError("--join/--leave need the router (it sends requests only to the edges that are up); "
                        "drop --no-router")
    return joins, leaves


def check_args(args) -> None:
    """Every mistake in the arguments, before anything is written or started."""
    if not 1 <= args.edges <= 8:
        raise UserError(f"--edges {args.edges}: give 1 to 8 (the Dolly subset has 8 categories, one group per edge)")
    if args.rounds < 1:
        raise UserError(f"--rounds {args.rounds}: give at least 1")
    if not 0 <= args.load <= 1e4:  # NaN fails too
        raise UserError(f"--load {args.load:g}: give 0 to 10000 requests per second")
    if args.eval_records is not None and args.eval_records < 1:
        raise UserError(f"--eval-records {args.eval_records}: give at least 1")
    if args.round_deadline is not None and args.round_deadline <= 0:
        raise UserError(f"--round-deadline {args.round_deadline:g}: give a positive number of seconds")
    if args.ranks and len(args.ranks) != args.edges:
        raise UserError(f"--ranks: give one rank per edge ({args.edges}), got {len(args.ranks)}")
    if args.quantization and len(args.quantization) != args.edges:
        raise UserError(f"--quantization: give one precision per edge ({args.edges}), got {len(args.quantization)}")
    if args.round_tokens is not None and args.round_tokens < 1:
        raise UserError(f"--round-tokens {args.round_tokens}: give at least 1 token per round")
    if args.linger < 0:
        raise UserError(f"--linger {args.linger:g}: give 0 or more seconds")
    if args.prometheus:
        prometheus_binary()  # no prometheus: one line now, not after the edges have loaded
    args.joins, args.leaves = check_churn(args)
    args.server_config = str(config_path(args.server_config))  # the default is found from any folder
    if not Path(args.server_config).is_file():
        raise UserError(f"--server-config {args.server_config}: file not found")
    load_config(ServerConfig, args.server_config)  # a bad server config is one line here
