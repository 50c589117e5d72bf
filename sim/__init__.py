"""collm-sim: a fleet simulator that runs CoLLM's own policy code on 2-1,000 simulated edges.

`profile` (measured edge costs), `edge` (one edge's engine loop on a logical clock), `world` (the
event loop: trace, router, edges, rounds), `run` (collm-bench's experiment and sweeps, the CLI).
"""
