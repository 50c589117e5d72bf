"""Config files: resolved output, and one clear line per mistake (no traceback, exit code 2)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from collm.common.config import load_config
from collm.edge_client.config import EdgeConfig
from collm.common.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("edge*.yaml"))


def run_edge(*args):
    return subprocess.run([sys.executable, "-m", "collm.edge_client", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_edge_configs_validate(path):
    cfg = load_config(EdgeConfig, path)
    assert cfg.name


def test_check_prints_resolved_config():
    r = run_edge("--config", "configs/edge-tiny.yaml", "--check")
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    assert resolved["name"] == "edge-tiny"
    assert resolved["engine"]["max_queue"] == 256  # a default filled in
    assert resolved["model"]["tiny"]["hidden_size"] == 64


@pytest.mark.parametrize("body,field,words", [
    ("engine:\n  max_running: many\n", "engine.max_running", ["integer", "'many'"]),
    ("engine:\n  max_runing: 4\n", "engine.max_runing", ["unknown key", "max_running"]),
    ("model:\n  source: local\n  path: /no/such/dir\n", "model", ["/no/such/dir"]),
    ("slo:\n  ttft_ms: -5\n", "slo.ttft_ms", ["greater than 0", "-5"]),
    ("data:\n  path: /no/such.jsonl\n", "data", ["does not exist"]),
])
def test_bad_config_is_one_line_naming_the_field(tmp_path, body, field, words):
    p = tmp_path / "edge.yaml"
    p.write_text(body)
    r = run_edge("--config", str(p), "--check")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert str(p) in lines[0] and f" {field}:" in lines[0]
    for w in words:
        assert w in lines[0]


def test_missing_file_and_bad_yaml(tmp_path):
    r = run_edge("--config", str(tmp_path / "absent.yaml"), "--check")
    assert r.returncode == 2 and "config file not found" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [1\n")
    r = run_edge("--config", str(bad), "--check")
    assert r.returncode == 2 and "YAML syntax error" in r.stderr and f"{bad}:2:1" in r.stderr


def test_validation_error_lists_every_problem(tmp_path):
    p = tmp_path / "e.yaml"
    p.write_text("engine:\n  max_running: x\nslo:\n  tpot_ms: y\n")
    with pytest.raises(UserError) as e:
        load_config(EdgeConfig, p)
    assert "engine.max_running" in str(e.value) and "slo.tpot_ms" in str(e.value)


@pytest.mark.parametrize("text, field, secret", [
    ("edge_key: sk-live-SECRET\n", "edge_key", "SECRET"),                       # a key where a mapping goes
    ("auth:\n  api_keys: [sk-live-SECRET]\n", "auth.api_keys", "SECRET"),
    ("auth:\n  admin_tokens:\n    keys: sk-live-SECRET\n", "auth.admin_tokens.keys", "SECRET"),
    ("auth: sk-live-SECRET\n", "auth", "SECRET"),
    ("auth:\n  api_keys:\n    keys: [ok, 8675309]\n", "auth.api_keys.keys.1", "8675309"),  # a numeric key
])
def test_a_config_error_never_echoes_a_key(tmp_path, text, field, secret):
    from collm.router.config import RouterConfig

    path = tmp_path / "router.yaml"
    path.write_text("edges: [{name: e, url: 'http://127.0.0.1:1'}]\n" + text)
    with pytest.raises(UserError) as err:
        load_config(RouterConfig, path)
    assert secret not in str(err.value) and f"{field}:" in str(err.value), str(err.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n"])
def test_a_config_that_is_no_mapping_is_one_line_even_with_cli_overrides(tmp_path, text):
    path = tmp_path / "edge.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match="expected a mapping of keys at the top level"):
        load_config(EdgeConfig, path, {"api": {"port": 9000}})


def test_a_config_path_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(UserError, match="is a folder; give the config file in it"):
        load_config(EdgeConfig, tmp_path)


def test_an_output_file_is_checked_before_the_work_that_writes_it(tmp_path):
    from collm.common.config import check_writable_file

    with pytest.raises(UserError, match="--profile .*: is a folder; give a file name in it"):
        check_writable_file(tmp_path, "--profile")  # `--profile runs/` profiled for minutes, then IsADirectoryError
    with pytest.raises(UserError, match="the folder .* does not exist"):
        check_writable_file(tmp_path / "none" / "p.json", "--profile")
    assert check_writable_file(tmp_path / "p.json", "--profile") == tmp_path / "p.json"
    assert not (tmp_path / "p.json").exists()  # the probe leaves nothing behind


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "edge.yaml"
    p.write_bytes(b"name: caf\xe9\n")  # latin-1
    with pytest.raises(UserError, match="not UTF-8 text .*save the config as UTF-8"):
        load_config(EdgeConfig, p)
