"""The pieces every whole-topology tool shares (collm-lab, collm-bench, the tests that run processes):
free ports, one edge config builder, a process group that stops cleanly, health waits.

An edge config is always built the same way: a shipped base config (`BASE_CONFIGS`), then what the
topology decides (name, ports, data split, federation, state dir, cores), validated into an
`EdgeConfig` before any process starts, so a mistake is one line here rather than a child's traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import httpx
import yaml

from collm.common.config import deep_merge, dump_config, validate_config
from collm.common.errors import UserError
from collm.common.procs import child_env, end_stragglers, lower_priority, usable_cpus
from collm.edge_client.config import EdgeConfig

BASE_CONFIGS = {"tiny": "configs/edge-tiny.yaml", "bundled": "configs/edge-smollm2.yaml"}
BASE_MODEL_NAMES = {"tiny": "collm-tiny", "bundled": "smollm2-135m-instruct"}
# The federation's coordinator (SuperLink, and the ServerApp it starts) runs on a server in a real
# deployment; on one machine it shares the edges' cores, so it runs at a lower priority (about a
# tenth of a busy core when it competes with an edge): it must not take serving's time, and it must
# not starve either when an edge trains flat out (the colocated-naive baseline).
COORDINATOR_NICE = 10


def repo_file(rel: str) -> Path:
    """A file of the CoLLM checkout the lab tools run in (`configs/...`): from the current folder, else beside the
    installed package's data (an editable install's checkout), so a run started elsewhere finds it too."""
    from collm.data import DATA_DIR

    for root in (Path.cwd(), DATA_DIR.parent):
        if (root / rel).is_file():
            return root / rel
    raise UserError(f"{rel}: not found in {Path.cwd()} nor in {DATA_DIR.parent}; run the lab tools from the "
                    "CoLLM repository root")


def config_path(path: str) -> Path:
    """A config the user named: as given, or (a relative path not found here) in the CoLLM checkout."""
    p = Path(path)
    return p if p.exists() or p.is_absolute() else repo_file(path)


def stop_on_signals(handler) -> None:
    """`handler` for SIGTERM and SIGHUP (a closed terminal), so the processes stop as on ^C; a SIGHUP that nohup
    set to be ignored stays ignored."""
    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, handler)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_cores(i: int, n: int) -> list[int]:
    """The cores replica i of n is pinned to: each replica its own share, like separate devices."""
    cpus = usable_cpus()
    if n >= len(cpus):
        return [cpus[i % len(cpus)]]
    per = len(cpus) // n
    return cpus[i * per:(i + 1) * per]


def edge_config(model: str, name: str, out: Path, *, categories: list[str], superlink: str | None = None,
                overrides: dict | None = None) -> EdgeConfig:
    """The config of one edge of a local topology: `model`'s base config, its own name, loopback
    ports, Dolly categories and state dir under `out`; federation on when `superlink` is given."""
    base = yaml.safe_load(repo_file(BASE_CONFIGS[model]).read_text())
    fed = {"enabled": superlink is not None, "runtime_port": free_port()}
    if superlink is not None:
        fed["superlink"] = superlink
    topology = {"name": name, "api": {"host": "127.0.0.1", "port": free_port()},
                "data": {"categories": categories}, "federation": fed, "state_dir": str(out / "state" / name)}
    data = deep_merge(deep_merge(base, topology), overrides or {})
    return validate_config(EdgeConfig, data, f"{name} (from {BASE_CONFIGS[model]})")


def write_config(path: Path, cfg) -> Path:
    path.write_text(dump_config(cfg))
    return path


def edge_url(cfg: EdgeConfig) -> str:
    return f"http://{cfg.api.host}:{cfg.api.port}"


class ProcessGroup:
    """The processes of one topology; `stop()` ends them all (edges gracefully, then the SuperLink).

    Every process writes its output to `out/logs/<name>.log`. `check_alive()` raises a UserError
    naming the log of the first essential process that exited; a process marked `expendable`
    (an edge, while enough of them remain) only gets reported by `casualties()`.
    """

    def __init__(self, out: Path):
        self.out = out
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.expendable: set[str] = set()
        self.superlink: str | None = None  # host:port, for the processes the SuperLink detaches
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, cmd: list[str], expendable: bool = False, nice: int = 0, **kw) -> subprocess.Popen:
        """Start `cmd` in its own session; `nice` > 0 runs it (and what it starts) at lower CPU priority."""
        log = open(self.out / "logs" / f"{name}.log", "a")
        env = child_env(**kw.pop("env", {}))
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             preexec_fn=lower_priority(nice), **kw)
        self.procs = [(n, q) for n, q in self.procs if n != name] + [(name, p)]
        if expendable:
            self.expendable.add(name)
        return p

    def get(self, name: str) -> subprocess.Popen | None:
        return dict(self.procs).get(name)

    def log_path(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"

    def casualties(self) -> list[tuple[str, int]]:
        """(name, exit status) of the expendable processes that have exited."""
        return [(n, p.returncode) for n, p in self.procs if n in self.expendable and p.poll() is not None]

    def retire(self, name: str, grace_s: float = 30.0) -> int | None:
        """Stop one process as on shutdown (SIGTERM, SIGKILL after `grace_s`) and forget it: an edge
        leaving the fleet on purpose is neither a casualty nor restarted. Returns its exit status."""
        p = self.get(name)
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs = [(n, q) for n, q in self.procs if n != name]
        self.expendable.discard(name)
        return p.returncode

    def check_alive(self, ignore: tuple[str, ...] = ()) -> None:
        for name, p in self.procs:
            if p.poll() is not None and name not in ignore and name not in self.expendable:
                raise UserError(f"{name} exited with status {p.returncode}; see {self.log_path(name)}")

    def stop(self, grace_s: float = 45.0) -> None:
        """End every process: SIGTERM, up to `grace_s` to exit, then SIGKILL. A second ^C (or SIGTERM, SIGHUP)
        meanwhile does not cut this short: it would leave the rest running, pinned to cores and holding ports."""
        with _signals_held():
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        for _, p in reversed(self.procs):  # edges and router first, the SuperLink last
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
        if self.superlink:
            end_stragglers(self.superlink, 15)


@contextlib.contextmanager
def _signals_held():
    """Hold ^C, SIGTERM and SIGHUP while the body runs and deliver the first one after it (main thread only:
    others cannot set handlers): the cleanup finishes, and the interrupt still stops the run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before: dict = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            before[s] = signal.signal(s, lambda signum, frame: held.append(signum))
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set from C
        if held:
            signal.raise_signal(held[0])


def wait_http(url: str, group: ProcessGroup, timeout: float, what: str, ca: Path | None = None) -> None:
    """Wait until `url` answers 200 (`ca`: verify an https server with this CA file)."""
    verify = ssl.create_default_context(cafile=str(ca)) if ca else True
    deadline = time.time() + timeout
    while time.time() < deadline:
        group.check_alive()
        try:
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise UserError(f"{what} did not become ready within {timeout:.0f} s (see {group.out / 'logs'})")


def start_router(group: ProcessGroup, out: Path, edges: dict[str, str], settings: dict | None = None,
                 what: str = "collm-router", label: str = "router") -> str:
    """collm-router on a free loopback port in front of `edges` (name: URL), with `settings` merged into its
    config (routing, auth, edge_key); its URL once /health answers. Its process and its config,
    OUT/<label>.yaml, are named `label`."""
    from collm.common.procs import BIN_DIR

    port = free_port()
    cfg = {**(settings or {}), "api": {"host": "127.0.0.1", "port": port},
           "edges": [{"name": n, "url": u} for n, u in edges.items()]}
    path = out / f"{label}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    group.spawn(label, [str(BIN_DIR / "collm-router"), "--config", str(path)])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", group, 60, what)
    return url


def prepare_out(out: Path, overwrite: bool) -> Path:
    """`out` as a fresh folder for a run, never deleting anything the user did not ask to lose.

    An absent or empty folder is used as it is. A non-empty one needs `overwrite`; even then only
    what an earlier run of these tools wrote there is removed (the folder must carry the marker
    file they leave), so `--out .` or `--out ~` can never wipe a working directory.
    """
    out = out.resolve()
    marker = out / ".collm-run"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"--out {out}: the folder is not empty; pass --overwrite to replace an earlier run's "
                            "results, or choose another folder")
        if not marker.is_file():
            raise UserError(f"--out {out}: not a folder an earlier collm-lab/collm-bench run made (no .collm-run); "
                            "refusing to delete its contents")
        import shutil

        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text("made by a CoLLM run; collm-lab/collm-bench --overwrite may replace this folder\n")
    return out
