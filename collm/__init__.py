"""CoLLM: co-executed LLM serving and federated LoRA fine-tuning on shared edge replicas.

The repository keeps the folders `common/`, `edge_client/` and `server/` at its top level;
`pyproject.toml` maps them to `collm.common`, `collm.edge_client` and `collm.server`.
"""

import os

__version__ = "0.1.0"

# Serving, training, the router and Flower share a few cores. With GNU OpenMP's default
# busy-waiting, one torch process next to another CPU-heavy one slowed down 100x here (a 3 ms
# forward took 0.55 s); passive waiting avoids that. It must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
