"""CoLLM: co-executed LLM serving and federated LoRA fine-tuning on shared edge replicas.

The repository keeps the folders `common/`, `edge_client/` and `server/` at its top level;
`pyproject.toml` maps them to `collm.common`, `collm.edge_client` and `collm.server`.
"""

__version__ = "0.1.0"
