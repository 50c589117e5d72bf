"""Shared fixtures: the tiny model is built once per session; the bundled SmolLM2 only for slow tests."""

import os

import collm  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads OpenMP)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield


@pytest.fixture(scope="session")
def tiny_cfg():
    from collm.edge_client.config import ModelConfig

    return ModelConfig(source="tiny", device=os.environ.get("COLLM_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_cfg):
    from collm.edge_client.model.loading import load_model

    return load_model(tiny_cfg)


@pytest.fixture(scope="session")
def smollm2_lm():
    from collm.edge_client.config import ModelConfig
    from collm.edge_client.model.loading import load_model

    return load_model(ModelConfig(source="bundled"))
