"""Builders shared by tests: real engines on the tiny model (each with its own model instance)."""

from __future__ import annotations

import os

import torch

from collm.common.config import deep_merge, validate_config
from collm.edge_client.config import EdgeConfig
from collm.common.data import chat_prompt_ids
from collm.edge_client.training.data import load_edge_data
from collm.edge_client.model.loading import load_model
from collm.edge_client.engine import Engine
from collm.edge_client.model.lora import TrainableAdapter
from collm.lab.topology import free_port

# The device the tiny engines run on: cpu (CI), or cuda where benchmarks/gpu_check.sh runs these tests.
TEST_DEVICE = os.environ.get("COLLM_TEST_DEVICE", "cpu")

TINY = {
    "name": "t",
    "model": {"source": "tiny", "device": TEST_DEVICE},
    "engine": {"max_running": 8, "kv_cache_mb": 16, "step_token_budget": 128, "warmup": True},
    "slo": {"ttft_ms": 1000, "tpot_ms": 100},
    "data": {"categories": ["open_qa"], "max_records": 200},
    "training": {"micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 96, "max_eval_records": 16,
                 "lr": 0.001},
}


def tiny_config(**overrides) -> EdgeConfig:
    return validate_config(EdgeConfig, deep_merge(TINY, overrides), "test")


def tiny_engine(costs=None, start: bool = True, with_data: bool = True, **overrides) -> Engine:
    """An in-process tiny engine. It does not shed late requests unless a test asks (`engine.shed_late`):
    on a loaded CI machine a queued request can wait past the 1 s TTFT target, and a test about
    something else then sees 'expired' instead of its answer."""
    cfg = tiny_config(**deep_merge({"engine": {"shed_late": False}}, overrides))
    lm = load_model(cfg.model)
    eng = Engine(lm, cfg, load_edge_data(cfg.data) if with_data else None, costs=costs)
    return eng.start() if start else eng


def random_adapter_state(engine: Engine, seed: int, scale: float = 0.5) -> dict:
    """A PEFT state dict that changes the model's outputs a lot (distinct versions)."""
    ad = TrainableAdapter(engine.layers, engine.device, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.b:
            b.copy_(torch.randn(b.shape, generator=g) * scale)
    return ad.state_dict_peft()


def prompt(engine: Engine, text: str) -> list[int]:
    return chat_prompt_ids(engine.tokenizer, text)


def base_fingerprint(model) -> dict:
    """Every base parameter and buffer, copied (LoRA adapters are not part of the base model)."""
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


class LiveEdge:
    """A real edge API (uvicorn on a free loopback port) around a tiny-model runtime, in this process."""

    def __init__(self, cfg, load: bool = True):
        import threading

        import uvicorn

        from collm.edge_client.serve.api import create_app
        from collm.edge_client.runtime import EdgeRuntime

        self.runtime = EdgeRuntime(cfg)
        if load:
            self.runtime.load()
        self.app = create_app(self.runtime)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        import time

        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def engine(self):
        return self.runtime.engine

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        if self.runtime.engine is not None:
            self.runtime.engine.stop()


