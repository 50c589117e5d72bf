# The README's two commands: `make demo` and `make test`. Both set up .venv first if needed.
.PHONY: setup demo test test-quick clean

setup:
	@bash scripts/setup.sh

# The main demo: SuperLink + ServerApp + 3 SmolLM2 edges (one Dolly domain each) + router, two
# federated rounds while requests are served; prints each edge's holdout loss per round.
demo: setup
	.venv/bin/collm-edge --config configs/edge-smollm2.yaml --prompt "What is the capital of France?"
	.venv/bin/collm-lab --model bundled --edges 3 --rounds 2 --load 0.3 --round-deadline 60 --out runs/demo --overwrite

test: setup
	.venv/bin/python -m pytest -q

test-quick: setup
	.venv/bin/python -m pytest -q -m "not slow"

clean:
	rm -rf .venv state runs
