"""The contract every CoLLM process shares: config base, protocol and metric names, SLO rule, stats, errors, adapter I/O, data and traces."""
