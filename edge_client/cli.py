"""`collm-edge --config edge.yaml`: one edge replica (model loaded once, served and trained).

(`collm-edge status` and `collm-edge adapters` look at and steer a running one: `device_cli.py`.)

It listens on the configured host/port at once (`/health` answers 503 while the model loads),
loads the model, and serves until SIGTERM/SIGINT; then it stops admitting, lets in-flight
requests finish within `api.shutdown_grace_s`, saves the training state and exits 0. If the
engine loop itself dies (a bug, not a bad request), `/health` answers 503 and the process stops
and exits 1, so a supervisor (Compose's `restart:`, systemd) starts a fresh one.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from collm.common.config import check_writable_dir, dump_config, load_config
from collm.edge_client.config import EdgeConfig
from collm.common.errors import cli_entry
from collm.common.listen import bind_listen_socket
from collm.common.logs import setup_logging

log = logging.getLogger("collm.edge")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-edge", description="Run one CoLLM edge replica.")
    p.add_argument("--config", required=True, help="edge YAML config (see configs/)")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("--prompt", help="load the model, answer this one prompt, and exit")
    p.add_argument("--max-tokens", type=int, default=64, help="with --prompt: answer length limit")
    p.add_argument("--port", type=int, help="override api.port")
    p.add_argument("--profile", metavar="OUT.json", help="measure this replica's cost model (step times, training "
                   "and evaluation micro-batches, loop overhead) for collm-sim, write it to OUT.json, and exit")
    p.add_argument("--profile-reps", type=int, default=5, help="with --profile: timed repeats per shape (median)")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    from collm.edge_client import device_cli

    argv = sys.argv[1:] if argv is None else argv
    if device_cli.wants(argv):  # `collm-edge status` / `collm-edge adapters ...` against a running edge
        return device_cli.main(argv)
    args = build_parser().parse_args(argv)
    overrides = {"api": {"port": args.port}} if args.port is not None else None
    cfg = load_config(EdgeConfig, args.config, overrides)
    if args.check:
        sys.stdout.write(dump_config(cfg))
        return 0
    setup_logging()
    if args.prompt is not None:
        return answer_once(cfg, args.prompt, args.max_tokens)
    if args.profile:
        return write_profile(cfg, args.profile, args.profile_reps)
    return serve(cfg)


def serve(cfg: EdgeConfig) -> int:
    import uvicorn

    from collm.edge_client.serve.api import create_app
    from collm.edge_client.runtime import EdgeRuntime

    check_writable_dir(cfg.resolved_state_dir, "state_dir")  # it is written on every publish and at shutdown
    sock = bind_listen_socket(cfg.api.host, cfg.api.port)  # before anything slow: a clash is one line
    rt = EdgeRuntime(cfg)
    if cfg.federation.enabled:
        from collm.edge_client.federation.service import EdgeFederation

        rt.federation = EdgeFederation(rt)
    app = create_app(rt)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.api.host, port=cfg.api.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=int(cfg.api.shutdown_grace_s) or None, lifespan="off",
        **cfg.api.tls.uvicorn_args()))
    # uvicorn handles SIGTERM/SIGINT while serving and re-raises the signal when it returns; these
    # handlers receive that re-raise, so the process goes on to save its state and exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    failed: list[str] = []

    def engine_died(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    rt.on_ready.append(lambda: rt.engine.on_failure.append(engine_died))
    loader = rt.load_in_background()
    log.info("edge %s: listening on %s://%s:%d", cfg.name, "https" if cfg.api.tls.enabled else "http", cfg.api.host,
             cfg.api.port)
    server.run(sockets=[sock])  # returns after SIGTERM/SIGINT, once in-flight requests are done
    log.info("edge %s: shutting down", cfg.name)
    loader.join(timeout=1)
    rt.shutdown(cfg.api.shutdown_grace_s)
    if failed:
        log.error("edge %s: exiting with status 1 because the engine failed: %s", cfg.name, failed[0])
        return 1
    return 0


def write_profile(cfg: EdgeConfig, out: str, reps: int) -> int:
    """Load the model and data, measure the replica's costs (`engine.profiling`), write them as JSON."""
    import json

    from collm.common.config import check_writable_file
    from collm.common.errors import UserError
    from collm.edge_client.engine import Engine
    from collm.edge_client.engine.profiling import measure_profile
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.training.data import load_edge_data

    if reps < 1:
        raise UserError(f"--profile-reps: expected at least 1, got {reps}")
    path = check_writable_file(out, "--profile")
    lm = load_model(cfg.model)
    engine = Engine(lm, cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"warmup": False})}),
                    load_edge_data(cfg.data))
    log.info("edge %s: profiling (%d repeats per shape)", cfg.name, reps)
    profile = measure_profile(engine, reps, progress=lambda line: log.info("%s", line))
    path.write_text(json.dumps(profile, indent=1) + "\n")
    s = profile["step"]
    log.info("profile written to %s: step coef %s (error %.1f%% on %d shapes), loop overhead %.2f ms/step",
             path, [round(c, 6) for c in s["coef"]], 100 * s["mape"], len(s["samples"]), 1000 * s["overhead_s"])
    return 0


def answer_once(cfg: EdgeConfig, prompt: str, max_tokens: int) -> int:
    """Load the model, answer one chat prompt greedily through the engine, print the answer."""
    from collm.common.data import chat_prompt_ids
    from collm.edge_client.model.loading import load_model

    from collm.edge_client.engine import Engine
    from collm.edge_client.model.sampling import SamplingParams

    lm = load_model(cfg.model)
    engine = Engine(lm, cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"warmup": False})}))
    engine.start()
    try:
        ids = chat_prompt_ids(lm.tokenizer, prompt)
        max_tokens = max(1, min(max_tokens, engine.max_context - len(ids)))
        ev = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        engine.stop()
    print(ev.text.strip())
    r = ev.record
    log.info("answered in %.2f s (first token %.2f s, %d tokens, adapter version %d)", r.e2e_s, r.ttft_s or 0,
             r.output_tokens, r.adapter_version)
    return 0
