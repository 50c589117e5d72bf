# The README's two commands: `make demo` and `make test`. Both set up .venv first if needed.
.PHONY: setup demo test test-quick clean

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/collm-edge --config configs/edge-smollm2.yaml --prompt "What is the capital of France?"

test: setup
	.venv/bin/python -m pytest -q

test-quick: setup
	.venv/bin/python -m pytest -q -m "not slow"

clean:
	rm -rf .venv state runs
