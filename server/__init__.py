"""The CoLLM ServerApp: strategy, workload balancer, robust screening, checkpoints (runs inside flower-superlink)."""
