"""Take part in Flower rounds from a long-running process that keeps its model loaded.

Stock Flower (1.42) runs a ClientApp in a fresh `flwr-clientapp` process per message, which
would reload the LLM every round. Instead, `SuperNodeExecutor`:

* starts a child `flower-supernode --isolation process` (Flower's own Fleet connection, TLS,
  node auth, heartbeats and reconnects), restarts it with backoff if it dies, and stops it;
* acts as that SuperNode's only task executor: it claims tasks on the SuperNode's Runtime API
  (`AcquireTask`), pulls the message, calls the given `ClientApp` object in this process and
  pushes the reply, as `flwr-clientapp` does but without spawning a process or exiting.

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
from collections.abc import Callable, Mapping

import httpx
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import RetryInvoker, exponential
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from collm.common.procs import child_env

log = logging.getLogger(__name__)

# `pull_task_input` sets flwr's process-global TaskIdentity, so a process runs one task at a
# time, even when it hosts several executors (the tests do).
_PROCESS_TASK_LOCK = threading.Lock()

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")

# `flower-supernode`, run by this interpreter (so its flwr is ours), that shuts down as on
# SIGTERM once the process that started it is gone, even after a SIGKILL: an orphaned
# SuperNode would keep its node online with nobody answering its messages, and its port taken.
_SUPERNODE_LAUNCHER = """\
import os, signal, sys, threading, time
parent = int(sys.argv.pop(1))
def watch_parent():
    while os.getppid() == parent:
        time.sleep(0.5)
    signal.raise_signal(signal.SIGTERM)
threading.Thread(target=watch_parent, daemon=True).start()
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
        Seconds between `AcquireTask` polls while idle (a loopback call).
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
        name: str | None = None,
    ) -> None:
        if insecure and (root_certificates or auth_private_key):
            raise ValueError("root_certificates and auth_private_key need TLS: pass insecure=False")
        self._client_app = client_app
        self._runtime_url = f"http://127.0.0.1:{runtime_port}"
        self._poll_interval = poll_interval
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
                    [sys.executable, "-c", _SUPERNODE_LAUNCHER, str(os.getpid()), *self._supernode_args],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=child_env(), text=True, errors="replace",
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
        """Claim the SuperNode's tasks one by one and run each in this thread."""
        acquirer = self._runtime_client(token=None, retry=False, timeout=5.0)
        try:
            while not self._stop.is_set():
                if not _PROCESS_TASK_LOCK.acquire(timeout=self._poll_interval):
                    continue  # another executor in this process runs a task
                try:
                    if token := self._acquire(acquirer):
                        self._run_task_safely(token)
                finally:
                    _PROCESS_TASK_LOCK.release()
                if not token:
                    self._stop.wait(self._poll_interval)
        finally:
            acquirer.close()

    def _acquire(self, acquirer: RuntimeHttpClient) -> str | None:
        """The token of a newly claimed ClientApp task; None if there is none or no SuperNode."""
        try:
            res = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except httpx.HTTPError as exc:  # the SuperNode is starting or restarting
            if self._runtime_up is not False:
                log.info("%s: waiting for the SuperNode Runtime API (%s)", self.name, _describe(exc))
            self._runtime_up = False
            return None
        if not self._runtime_up:
            log.info("%s: SuperNode Runtime API is up", self.name)
        self._runtime_up = True
        return res.token if res.HasField("task") and res.token else None

    def _run_task_safely(self, token: str) -> None:
        try:
            self._run_task(token)
        except Exception as exc:  # noqa: BLE001 - one broken task must not end the executor
            self._tasks_failed += 1
            self._last_error = _describe(exc)
            log.exception("%s: task failed: %s", self.name, self._last_error)

    def _run_task(self, token: str) -> None:
        """What `flwr-clientapp` does for one task, minus the process, the FAB install and the exit."""
        started = time.monotonic()
        client = self._runtime_client(token, retry=True)
        heartbeat_client = self._runtime_client(token, retry=False, timeout=5.0)
        heartbeat = HeartbeatSender(self._heartbeat_fn(heartbeat_client))
        heartbeat.start()
        try:
            message, context, run, _fab = pull_task_input(client)  # the FAB's code is not used
            log.info("%s: %s message of run %s", self.name, message.metadata.message_type, run.run_id)
            reply, status, details = self._call_client_app(message, context)
            # If the reply cannot be pushed, the task stays unfinished: once its token expires,
            # the SuperNode answers "ClientApp stopped responding" itself. A task finished
            # without a reply would leave the SuperNode waiting for that reply forever.
            push_message(client, reply, context)
            push_task_output(client, context, status, details)
            self._tasks_done += 1
            self._last_task_seconds = time.monotonic() - started
            log.info("%s: task %s in %.2f s", self.name, status, self._last_task_seconds)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
            heartbeat_client.close()

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

    def _heartbeat_fn(self, client: RuntimeHttpClient) -> Callable[[], bool]:
        """Keep the task's token alive. flwr's own version raises SIGINT when refused."""

        def beat() -> bool:
            try:
                accepted = client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success
            except Exception:  # noqa: BLE001 - False: HeartbeatSender retries with backoff
                return False
            if not accepted:
                log.warning("%s: the SuperNode no longer accepts this task (run stopped?)", self.name)
            return True

        return beat

    def _runtime_client(self, token: str | None, *, retry: bool, timeout: float = 30.0) -> RuntimeHttpClient:
        interceptors = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
        if token:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        return RuntimeHttpClient(
            self._runtime_url, interceptors=interceptors, timeout=timeout,
            retry_invoker=_transient_retry(self._stop.is_set) if retry else None,
        )  # fmt: skip


def _transient_retry(stopping: Callable[[], bool] = lambda: False) -> RetryInvoker:
    """Retry loopback hiccups (connection errors, HTTP 502/503/504) for up to 20 s, unless the edge is
    stopping (then the SuperNode is going away too, and waiting would only delay the shutdown).

    Not flwr's `make_simple_http_retry_invoker`: on HTTP 401 (a revoked task token) it raises
    SIGINT in the whole process, which would take the edge down.
    """

    def give_up(exc: Exception) -> bool:
        if stopping():
            return True
        return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code not in (502, 503, 504)

    return RetryInvoker(
        lambda: exponential(base_delay=0.2, max_delay=2),
        (httpx.TransportError, httpx.HTTPStatusError),
        max_tries=None,
        max_time=20.0,
        should_giveup=give_up,
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}: {exc.response.text[:300]}"
    return f"{type(exc).__name__}: {exc}"


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
