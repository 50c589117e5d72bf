"""What runs and measures a whole CoLLM topology on one machine: collm-lab, collm-bench, collm-certs."""
