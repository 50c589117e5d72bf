"""The Runtime-API side of a task, in a low-priority child process of its own.

Moving a round's message between the SuperNode and the ClientApp is Python-heavy work: flwr 1.42
splits a message into content-addressed objects, hashes them and moves each with its own HTTP
call, a few seconds of CPU for an adapter of SmolLM2's size. Done in the edge process, that work
competed with the engine thread for the GIL and stalled serving for seconds at a time (measured
with collm-bench: the SLO misses of co-located serving lined up with each round's message
transfers). So this process does all of it, at a lower CPU priority (`nice`), and hands the edge
only the finished objects through a pipe (pickle: ~10 ms for an 8 MB message):

    edge (executor thread)                    transport process (this module)
                                              AcquireTask, poll while idle
                 <-- ("task", message, context, identity)   pull_task_input, heartbeats
    run the ClientApp on the engine
                 --> ("reply", reply, status, details)
                 <-- ("pushed", seconds) / ("failed", why)   push_message, push_task_output
                 --> ("stop",)                               exit

A stop while a task runs leaves it unfinished: once its token expires, the SuperNode answers
"ClientApp stopped responding" itself (a task finished without a reply would hang the SuperNode).
If the edge dies, the pipe closes and this process exits.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import httpx
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import RetryInvoker, exponential
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

log = logging.getLogger("collm.edge_client.federation.transport")


def transport_main(conn, runtime_url: str, poll_interval: float, nice: int) -> None:
    """The child process: claim tasks, pull them, hand them over, push the replies, until told to stop."""
    if nice > 0:
        os.nice(nice)
    t = _Transport(conn, runtime_url, poll_interval)
    try:
        t.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the edge is gone
    finally:
        t.close()


class _Transport:
    def __init__(self, conn, runtime_url: str, poll_interval: float):
        self.conn, self.url, self.poll_interval = conn, runtime_url, poll_interval
        self.stopping = False
        self.runtime_up: bool | None = None
        self.acquirer = self._client(None, retry=False, timeout=5.0)

    def close(self) -> None:
        self.acquirer.close()

    def _stop_requested(self, wait_s: float = 0.0) -> bool:
        if self.conn.poll(wait_s):
            msg = self.conn.recv()
            if msg[0] == "stop":
                self.stopping = True
        return self.stopping

    def run(self) -> None:
        while not self._stop_requested():
            token = self._acquire()
            if token is None:
                self._stop_requested(self.poll_interval)
                continue
            try:
                self._run_task(token)
            except (EOFError, BrokenPipeError, ConnectionResetError):
                raise
            except Exception as exc:  # noqa: BLE001 - one broken task must not end the transport
                self.conn.send(("failed", describe(exc)))

    def _acquire(self) -> str | None:
        try:
            res = self.acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except httpx.HTTPError as exc:  # the SuperNode is starting or restarting
            if self.runtime_up is not False:
                self.conn.send(("runtime", False, describe(exc)))
            self.runtime_up = False
            return None
        if not self.runtime_up:
            self.conn.send(("runtime", True, ""))
        self.runtime_up = True
        return res.token if res.HasField("task") and res.token else None

    def _run_task(self, token: str) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        started = time.monotonic()
        client = self._client(token, retry=True)
        heartbeat_client = self._client(token, retry=False, timeout=5.0)
        heartbeat = HeartbeatSender(_heartbeat_fn(heartbeat_client))
        heartbeat.start()
        try:
            message, context, run, _fab = pull_task_input(client)  # the FAB's code is not used
            identity = (TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id)
            self.conn.send(("task", message, context, identity, run.run_id, time.monotonic() - started))
            while True:  # the ClientApp runs in the edge; wait for its reply (or a stop)
                if self.conn.poll(0.5):
                    msg = self.conn.recv()
                    if msg[0] == "reply":
                        break
                    if msg[0] == "stop":
                        self.stopping = True
                        return
            _, reply, status, details = msg
            push_message(client, reply, context)
            push_task_output(client, context, status, details)
            self.conn.send(("pushed", time.monotonic() - started))
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
            heartbeat_client.close()

    def _client(self, token: str | None, *, retry: bool, timeout: float = 30.0) -> RuntimeHttpClient:
        interceptors = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
        if token:
            interceptors.append(RuntimeTokenHttpInterceptor(token))
        return RuntimeHttpClient(
            self.url, interceptors=interceptors, timeout=timeout,
            retry_invoker=transient_retry(lambda: self.stopping) if retry else None,
        )  # fmt: skip


def _heartbeat_fn(client: RuntimeHttpClient) -> Callable[[], bool]:
    """Keep the task's token alive. flwr's own version raises SIGINT when refused."""

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except Exception:  # noqa: BLE001 - False: HeartbeatSender retries with backoff
            return False
        return True

    return beat


def transient_retry(stopping: Callable[[], bool] = lambda: False) -> RetryInvoker:
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


def describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}: {exc.response.text[:300]}"
    return f"{type(exc).__name__}: {exc}"
