"""`collm-server`: run the CoLLM ServerApp on a running SuperLink; exit with the run's status.

It does what `flwr run <app> <connection> --stream` does on flwr 1.42, without three snags:

* no `$FLWR_HOME/config.toml` connection is needed: `--superlink`, `--insecure` or
  `--root-certificates` say where the SuperLink is;
* it skips virtualenvs and hidden folders in the app folder (`flwr run .` reads every file of
  a checkout's `.venv` before filtering them out: about 10 s on a 2-core machine);
* its exit status is the run's: 0 for `finished:completed`, 1 otherwise (`flwr run --stream`
  exits 0 even when the ServerApp fails).

The FAB is built by flwr's own rules (`fab-include` / `fab-exclude`, `.gitignore`); CoLLM's
pyproject.toml bundles only itself, so the ServerApp imports `collm.server` from the
environment `flower-superlink` runs in.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from collm.common.errors import UserError, cli_entry
from collm.common.procs import quiet_flower

FINISHED = "finished"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--app", default=".", help="folder with the Flower App's pyproject.toml (default: .)")
    p.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink host:port (default: %(default)s)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the SuperLink")
    tls.add_argument("--root-certificates", help="CA file that signed the SuperLink's certificate")
    p.add_argument("-c", "--run-config", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="override keys of [tool.flwr.app.config], e.g. -c 'config=\"configs/server.yaml\"'")
    return p


def status_main(argv: list[str]) -> int:
    """`collm-server status CHECKPOINT_DIR`: the run's rounds from its checkpoints, while it runs and after."""
    p = argparse.ArgumentParser(prog="collm-server status", description=status_main.__doc__)
    p.add_argument("checkpoint_dir", help="the ServerApp's checkpoint_dir (configs/server.yaml)")
    args = p.parse_args(argv)
    from collm.common.rounds import read_status
    from collm.server.app import summary_table
    from collm.server.checkpoints import load_all_metrics

    d = Path(args.checkpoint_dir)
    if not d.is_dir():
        raise UserError(f"{d}: no such folder; give the ServerApp's checkpoint_dir")
    metrics = load_all_metrics(d)
    now = read_status(d)
    print(summary_table(metrics))
    for r, m in sorted(metrics.items()):
        notes = [f"{e}: {why}" for e, why in sorted((m.get("dropped") or {}).items())]
        notes += [f"{e}: weighed as {w:g} (claimed more)" for e, w in sorted((m.get("capped") or {}).items())]
        if m.get("training_skipped"):
            notes.append(f"no training: {m['training_skipped']}")
        if notes:
            print(f"round {r}: " + "; ".join(notes))
    if now is not None:
        print(f"now: round {now.get('round')}, {now.get('phase')}")
    return 0


def exporter_main(argv: list[str]) -> int:
    """`collm-server exporter CHECKPOINT_DIR`: the run's round facts as Prometheus metrics (server/exporter.py)."""
    p = argparse.ArgumentParser(prog="collm-server exporter", description=exporter_main.__doc__)
    p.add_argument("checkpoint_dir", help="the ServerApp's checkpoint_dir (configs/server.yaml); it may not exist yet")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=9105, help="port to listen on (default: %(default)s)")
    args = p.parse_args(argv)
    from collm.server.exporter import serve

    try:
        serve(args.checkpoint_dir, args.host, args.port)
    except OSError as e:
        raise UserError(f"--port: cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    except KeyboardInterrupt:
        pass
    return 0


@cli_entry
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    if argv[:1] == ["exporter"]:
        return exporter_main(argv[1:])
    args = build_parser().parse_args(argv)
    quiet_flower()
    with _as_user_error():
        fab = build_fab(Path(args.app))
        client = connect(args.superlink, args.insecure, args.root_certificates)
    try:
        with _as_user_error():
            run_id = start_run(client, fab, args.run_config)
        print(f"collm-server: started run {run_id} on {args.superlink}", flush=True)
        try:
            with _as_user_error():
                status, details = stream_until_finished(client, run_id)
        except KeyboardInterrupt:
            print(f"\ncollm-server: stopped following run {run_id}; it goes on (`flwr stop {run_id}`)")
            return 130
    finally:
        client.close()
    print(f"collm-server: run {run_id} {status}" + (f": {details}" if details else ""), flush=True)
    return 0 if status == f"{FINISHED}:completed" else 1


@contextmanager
def _as_user_error():
    """flwr's CLI helpers report bad input and unreachable SuperLinks as click exceptions."""
    import click

    try:
        yield
    except click.ClickException as e:
        raise UserError(e.format_message()) from None
    except ValueError as e:
        raise UserError(str(e)) from None


def build_fab(app: Path):
    """The app folder as a FAB, by flwr's rules (after skipping virtualenvs and hidden folders)."""
    from flwr.cli.build import build_fab_from_files
    from flwr.cli.config_utils import load_and_validate
    from flwr.supercore.fab import Fab

    if not (app / "pyproject.toml").is_file():
        raise UserError(f"{app}: no pyproject.toml (use --app to name the Flower App folder)")
    load_and_validate(app / "pyproject.toml")  # raises ValueError naming what is missing
    fab_bytes, _ = build_fab_from_files(app_files(app))
    return Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})


def app_files(app: Path) -> dict[str, Path]:
    """Relative POSIX path -> file, for every file outside hidden folders and virtualenvs."""
    files = {}
    for folder, subfolders, names in os.walk(app):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"
                         and not (Path(folder) / d / "pyvenv.cfg").exists()]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink():
                files[path.relative_to(app).as_posix()] = path
    return files


def connect(superlink: str, insecure: bool, root_certificates: str | None):
    """A Control API client, as `flwr` builds it from a config.toml connection."""
    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection

    if root_certificates:
        root_certificates = str(Path(root_certificates).resolve())
    connection = SuperLinkConnection(name="collm-server", address=superlink, insecure=insecure,
                                     root_certificates=root_certificates)
    return init_http_client_from_connection(connection)


def start_run(client, fab, run_config: list[str]) -> int:
    from flwr.cli.utils import flwr_cli_exc_handler
    from flwr.common.config import parse_config_args
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest  # pylint: disable=E0611

    overrides = user_config_to_proto(parse_config_args(run_config))
    request = StartRunRequest(fab=fab_to_proto(fab), override_config=overrides)
    with flwr_cli_exc_handler():
        response = client.StartRun(request)
    if not response.HasField("run_id"):
        raise UserError("the SuperLink did not start the run")
    return response.run_id


def stream_until_finished(client, run_id: int, poll_s: float = 1.0) -> tuple[str, str]:
    """Print the run's log until it ends; return its final status (`finished:<sub>`) and details."""
    from flwr.cli.log import AllLogsRetrieved, stream_logs

    try:
        stream_logs(run_id, client, after_timestamp=0.0)  # ends once the run has finished
    except AllLogsRetrieved:
        pass
    while not (status := run_status(client, run_id))[0].startswith(FINISHED):
        time.sleep(poll_s)
    return status


def run_status(client, run_id: int) -> tuple[str, str]:
    from flwr.cli.utils import flwr_cli_exc_handler
    from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611

    with flwr_cli_exc_handler():
        run = client.ListRuns(ListRunsRequest(run_id=run_id)).run_dict[run_id]
    sub = f":{run.status.sub_status}" if run.status.sub_status else ""
    return f"{run.status.status}{sub}", run.status.details


if __name__ == "__main__":
    sys.exit(main())
