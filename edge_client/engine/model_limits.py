"""The loaded model's limits as the engine sees them, fixed once at start: how many KV slots of what
length fit the configured cache, and which token ids end a sequence."""

from __future__ import annotations

from collm.edge_client.config import EdgeConfig
from collm.edge_client.model.loading import LoadedModel
from collm.edge_client.model.runner import KVPool, ModelRunner


def plan_kv(cfg: EdgeConfig, runner: ModelRunner, model_max: int) -> tuple[int, int]:
    """(slots, tokens per slot) that fit engine.kv_cache_mb; one slot per running request."""
    bpt = KVPool.bytes_per_token(runner.n_layers, runner.n_kv, runner.head_dim, runner.dtype)
    limit = min(cfg.engine.max_context or model_max, model_max)
    per_slot = int(cfg.engine.kv_cache_mb * 2**20 // (cfg.engine.max_running * bpt))
    slot_len = min(limit, per_slot)
    if slot_len < 32:
        raise ValueError(
            f"engine.kv_cache_mb={cfg.engine.kv_cache_mb:g} gives {per_slot} tokens per request with "
            f"max_running={cfg.engine.max_running}; raise kv_cache_mb or lower max_running")
    return cfg.engine.max_running, slot_len


def eos_ids(lm: LoadedModel) -> set[int]:
    """The tokenizer's end of sequence and the model's generation config's (one id or a list)."""
    eos = {lm.tokenizer.eos_token_id}
    gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return {e for e in eos if e is not None}
