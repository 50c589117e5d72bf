"""Take part in Flower rounds from a long-running process that keeps its model loaded.

Stock Flower (1.42) runs a ClientApp in a fresh `flwr-clientapp` process per message, which
would reload the LLM every round. Instead, `SuperNodeExecutor`:

* starts a child `flower-supernode --isolation process` (Flower's own Fleet connection, TLS,
  node auth, heartbeats and reconnects), restarts it with backoff if it dies, and stops it;
* acts as that SuperNode's only task executor: a low-priority transport process (`transport`)
  claims tasks on the SuperNode's Runtime API (`AcquireTask`), pulls each message and hands it
  over; the given `ClientApp` object runs in this process (on the resident model) and its reply
  goes back the same way, as `flwr-clientapp` does but without reloading anything per message.
  The transport's Python-heavy message handling never competes with serving for this process's GIL.

The Runtime API task protocol is flwr-internal (hence the exact flwr pin) and has no
authentication, so the SuperNode's Runtime API stays on 127.0.0.1.
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import ErrorCode, SubStatus

from collm.common.procs import child_env, lower_priority
from collm.edge_client.federation.transport import describe, transport_main

log = logging.getLogger(__name__)

# flwr's TaskIdentity is process-global, so a process runs one ClientApp call at a time, even when
# it hosts several executors (the tests do).
_PROCESS_TASK_LOCK = threading.Lock()

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")

# `flower-supernode`, run by this interpreter (so its flwr is ours), that shuts down once the process
# that started it is gone, even after a SIGKILL (`orphan_guard`: SIGTERM, then an exit 10 s later):
# an orphaned SuperNode would keep its node online with nobody answering its messages, and its port taken.
# With a poll interval (the second argument; empty: flwr's own 3 s), the SuperNode's Fleet loop waits at
# most that long for its next pull while it has no message (`fleet_wait.py`).
_SUPERNODE_LAUNCHER = """\
import sys
from collm.edge_client.federation.orphan_guard import guard
guard(int(sys.argv.pop(1)))
poll = sys.argv.pop(1)
if poll:
    from collm.edge_client.federation.fleet_wait import shorten_fleet_wait
    shorten_fleet_wait(float(poll))
from flwr.supernode.cli import flower_supernode
sys.argv[0] = "flower-supernode"
flower_supernode()
"""


def format_node_config(node_config: Mapping[str, bool | int | float | str]) -> str:
    """Render `node_config` as a `--node-config` string that flwr parses back to the same dict.

    Values are TOML scalars: strings are quoted (flwr rejects bare words), bools are
    `true`/`false`. Raises ValueError for anything that would not come back unchanged.
    """
    parts = []
    for key, value in node_config.items():
        if not isinstance(key, str) or not _BARE_KEY.fullmatch(key):
            raise ValueError(f"node_config key {key!r}: use letters, digits, '-', '_' and '.'")
        parts.append(f"{key}={_toml_scalar(key, value)}")
    text = " ".join(parts)
    if parse_config_args([text]) != dict(node_config):
        raise ValueError(f"node_config {dict(node_config)!r} does not survive flwr's parser")
    return text


def _toml_scalar(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"node_config {key}: {value} is not a finite number")
        return repr(value)
    if isinstance(value, str):
        if any(c in value for c in "\n\r\t"):
            raise ValueError(f"node_config {key}: strings cannot hold line breaks or tabs")
        if '"' not in value and "\\" not in value:
            return f'"{value}"'
        if "'" not in value:
            return f"'{value}'"  # a TOML literal string: no escapes
        raise ValueError(f"node_config {key}: a string cannot hold both ' and \"")
    raise ValueError(f"node_config {key}: expected bool, int, float or str, got {type(value).__name__}")


class SuperNodeExecutor:
    """A child SuperNode plus an in-process task executor for one `ClientApp` object.

    Parameters
    ----------
    client_app : ClientApp
        Called in this process for every message the node receives; it may keep state (a
        loaded model) across calls. If it raises, the ServerApp gets an Error reply and the
        executor carries on with the next task.
    superlink : str
        SuperLink address, `host:port` (its Fleet API).
    runtime_port : int
        Port of the SuperNode's Runtime API, bound on 127.0.0.1 only.
    node_config : Mapping[str, bool | int | float | str]
        The SuperNode's `--node-config`; handlers see it as `context.node_config`.
    insecure : bool (default: True)
        Plain HTTP to the SuperLink; False for TLS.
    root_certificates : str | None (default: None)
        CA file that verifies the SuperLink's certificate (TLS; None: the system CAs).
    auth_private_key : str | None (default: None)
        The node's OpenSSH ECDSA private key, for SuperNode authentication (TLS only).
    poll_interval : float (default: 0.2)
        Seconds between `AcquireTask` polls while idle (a loopback call, from the transport process).
    fleet_poll_s : float | None (default: None)
        At most this many seconds between the SuperNode's pulls from the SuperLink while it has no
        message (None: flwr's own 3 s).
    nice : int (default: 10)
        Scheduling niceness of the SuperNode and the transport process: moving round messages is
        background work and must not take CPU time from serving on the same device (0: same
        priority as the edge).
    name : str | None (default: None)
        Label for log lines; default `node_config["name"]`, else the runtime port.
    """

    def __init__(
        self,
        client_app: ClientApp,
        *,
        superlink: str,
        runtime_port: int,
        node_config: Mapping[str, bool | int | float | str],
        insecure: bool = True,
        root_certificates: str | None = None,
        auth_private_key: str | None = None,
        poll_interval: float = 0.2,
        fleet_poll_s: float | None = None,
        name: str | None = None,
        nice: int = 10,
    ) -> None:
        if insecure and (root_certificates or auth_private_key):
            raise ValueError("root_certificates and auth_private_key need TLS: pass insecure=False")
        self._client_app = client_app
        self._runtime_url = f"http://127.0.0.1:{runtime_port}"
        self._poll_interval = poll_interval
        if fleet_poll_s is not None and not fleet_poll_s > 0:
            raise ValueError(f"fleet_poll_s must be positive, got {fleet_poll_s!r}")
        self._fleet_poll = "" if fleet_poll_s is None else repr(float(fleet_poll_s))
        self._nice = nice
        self.name = name or str(node_config.get("name", f"supernode:{runtime_port}"))
        tls = ["--insecure"] if insecure else []
        if root_certificates:
            tls += ["--root-certificates", str(root_certificates)]
        if auth_private_key:
            tls += ["--auth-supernode-private-key", str(auth_private_key)]
        self._supernode_args = [
            *tls, "--superlink", superlink, "--isolation", "process", "--host", "127.0.0.1",
            "--port", str(runtime_port), "--node-config", format_node_config(node_config),
        ]  # fmt: skip
        self._stop = threading.Event()
        self._executor = threading.Thread(target=self._execute_loop, name=f"executor[{self.name}]", daemon=True)
        self._supervisor = threading.Thread(target=self._supervise, name=f"supernode[{self.name}]", daemon=True)
        self._proc: subprocess.Popen | None = None
        self._proc_lock = threading.Lock()  # no new child once stop() has looked for one
        self._runtime_up: bool | None = None
        self._tasks_done = 0
        self._tasks_failed = 0
        self._supernode_restarts = 0
        self._last_task_seconds: float | None = None
        self._last_error: str | None = None
        self._transport = None
        self._pending: tuple[str, float] = ("", 0.0)

    # ------------------------------------------------------------------ status (read-only)
    @property
    def running(self) -> bool:
        """True from `start()` until `stop()`, while the executor thread lives."""
        return self._executor.is_alive() and not self._stop.is_set()

    @property
    def tasks_done(self) -> int:
        """Tasks answered, including Error replies for a ClientApp that raised."""
        return self._tasks_done

    @property
    def tasks_failed(self) -> int:
        """Tasks whose ClientApp raised, or that could not be completed."""
        return self._tasks_failed

    @property
    def last_task_seconds(self) -> float | None:
        """Wall time of the last answered task, from claiming it to its reply being pushed."""
        return self._last_task_seconds

    @property
    def last_error(self) -> str | None:
        return self._last_error

    @property
    def supernode_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def supernode_restarts(self) -> int:
        return self._supernode_restarts

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SuperNodeExecutor:
        """Start the child SuperNode and the executor thread (once); returns self."""
        self._supervisor.start()
        self._executor.start()
        log.info("%s: started; SuperNode Runtime API on %s", self.name, self._runtime_url)
        return self

    def stop(self, timeout: float = 15.0) -> bool:
        """Take no new task, let a running one finish (up to `timeout` s), stop the SuperNode.

        Returns True if the threads and the child process all ended in time.
        """
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._executor.is_alive():
            self._executor.join(max(0.0, deadline - time.monotonic()))
        with self._proc_lock:
            proc = self._proc
        if proc is not None:
            _terminate(proc, max(1.0, deadline - time.monotonic()))
        if self._supervisor.is_alive():
            self._supervisor.join(max(0.1, deadline - time.monotonic()))
        threads_ended = not (self._executor.is_alive() or self._supervisor.is_alive())
        clean = threads_ended and (proc is None or proc.poll() is not None)
        log.info("%s: stopped%s", self.name, "" if clean else " (a task or the SuperNode did not end in time)")
        return clean

    def __enter__(self) -> SuperNodeExecutor:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ child SuperNode
    def _supervise(self) -> None:
        """Keep one `flower-supernode` running until stop(); restart it with backoff."""
        backoff = 1.0
        while True:
            started = time.monotonic()
            proc = self._spawn()
            if proc is not None:
                log.info("%s: flower-supernode started, pid %d", self.name, proc.pid)
                self._forward_output(proc)  # until the child closes its output, i.e. exits
                rc = proc.wait()
            if self._stop.is_set():
                return
            if proc is not None:
                self._last_error = f"flower-supernode exited with code {rc}"
            if time.monotonic() - started > 60:
                backoff = 1.0
            self._supernode_restarts += 1
            log.warning("%s: %s; restarting it in %.0f s", self.name, self._last_error, backoff)
            self._stop.wait(backoff)
            backoff = min(2 * backoff, 30.0)

    def _spawn(self) -> subprocess.Popen | None:
        with self._proc_lock:
            if self._stop.is_set():
                return None
            try:
                self._proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                    [sys.executable, "-c", _SUPERNODE_LAUNCHER, str(os.getpid()), self._fleet_poll, *self._supernode_args],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=child_env(), text=True, errors="replace", preexec_fn=lower_priority(self._nice),
                )  # fmt: skip
            except OSError as exc:
                self._last_error = f"cannot start flower-supernode: {exc}"
                return None
            return self._proc

    def _forward_output(self, proc: subprocess.Popen) -> None:
        child_log = logging.getLogger(f"{__name__}.supernode")
        for line in proc.stdout:
            if line := _ANSI.sub("", line).rstrip():
                child_log.info("[%s] %s", self.name, line)

    # ------------------------------------------------------------------ task executor
    def _execute_loop(self) -> None:
        """Run each task the transport process hands over, in this thread, and send back the reply."""
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        self._transport = ctx.Process(target=transport_main, name=f"collm-transport[{self.name}]", daemon=True,
                                      args=(child_conn, self._runtime_url, self._poll_interval, self._nice))
        self._transport.start()
        child_conn.close()
        try:
            while not self._stop.is_set():
                if not conn.poll(self._poll_interval):
                    if not self._transport.is_alive():
                        self._last_error = f"the task transport exited with code {self._transport.exitcode}"
                        log.error("%s: %s", self.name, self._last_error)
                        return
                    continue
                self._handle(conn, conn.recv())
        except (EOFError, BrokenPipeError, OSError) as exc:
            self._last_error = f"the task transport went away: {_describe(exc)}"
            log.error("%s: %s", self.name, self._last_error)
        finally:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._transport.join(5)
            if self._transport.is_alive():
                self._transport.kill()
            conn.close()

    def _handle(self, conn, msg: tuple) -> None:
        kind = msg[0]
        if kind == "runtime":
            _, up, why = msg
            if up:
                log.info("%s: SuperNode Runtime API is up", self.name)
            else:
                log.info("%s: waiting for the SuperNode Runtime API (%s)", self.name, why)
            self._runtime_up = up
        elif kind == "task":
            _, message, context, identity, run_id, pulled_s = msg
            started = time.monotonic()
            log.info("%s: %s message of run %s (pulled in %.2f s)", self.name, message.metadata.message_type,
                     run_id, pulled_s)
            with _PROCESS_TASK_LOCK:  # Message(...) may read flwr's process-global task identity
                from flwr.supercore.task_identity import TaskIdentity

                TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = identity
                reply, status, details = self._call_client_app(message, context)
            conn.send(("reply", reply, status, details))
            self._pending = (status, started)
        elif kind == "pushed":
            status, started = self._pending
            self._tasks_done += 1
            self._last_task_seconds = msg[1]
            log.info("%s: task %s in %.2f s", self.name, status, self._last_task_seconds)
        elif kind == "failed":
            self._tasks_failed += 1
            self._last_error = msg[1]
            log.error("%s: task failed: %s", self.name, self._last_error)

    def _call_client_app(self, message: Message, context: Context) -> tuple[Message, str, str]:
        """The ClientApp's reply, or an Error reply if it raised (as `flwr-clientapp` makes it)."""
        try:
            reply = self._client_app(message=message, context=context)
            if not isinstance(reply, Message) or reply.metadata.reply_to_message_id != message.metadata.message_id:
                raise TypeError("the ClientApp must return Message(..., reply_to=message)")
            return reply, SubStatus.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - becomes the Error reply
            reason = f"{type(exc)}:<'{exc}'>"  # flwr-clientapp's wording
            self._tasks_failed += 1
            self._last_error = f"ClientApp raised {type(exc).__name__}: {exc}"
            log.exception("%s: %s", self.name, self._last_error)
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
            return Message(error, reply_to=message), SubStatus.FAILED, reason


_describe = describe


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if the process is still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("flower-supernode pid %d ignored SIGTERM; killing it", proc.pid)
        proc.kill()
        proc.wait(5)
