"""The Flower strategies CoLLM's rounds ride on (flwr's FedAvg, FedProx, FedAdam and the robust ones,
each with `CollmRounds` mixed in), chosen by `cfg.strategy`."""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx, FedTrimmedAvg, Krum
from flwr.supercore import log

from collm.server.config import ServerConfig
from collm.server.strategy import CollmRounds


class CollmFedAvg(CollmRounds, FedAvg):
    """FedAvg over the LoRA adapter, with the CoLLM balancer, robust filtering and checkpoints."""


class CollmFedProx(CollmRounds, FedProx):
    """FedProx ("proximal-mu" in every TRAIN config), with the CoLLM round logic."""


class CollmFedAdam(CollmRounds, FedAdam):
    """FedAdam (server-side Adam over the averaged update), with the CoLLM round logic."""

    def _average(self, r: int, kept: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not self._global:
            # FedAdam's step needs a previous global; in round 1 there is none (edges started from
            # their seeded adapter), so the round's FedAvg becomes the first global.
            log(INFO, "round %d: global was empty; using the FedAvg of the updates, the server "
                "optimizer starts next round", r)
            return FedAvg.aggregate_train(self, r, kept)
        return super()._average(r, kept)

    def server_state(self) -> dict[str, dict[str, np.ndarray]]:
        return {k: v for k, v in (("m_t", self.m_t), ("v_t", self.v_t)) if v}

    def restore_server_state(self, state: dict[str, dict[str, np.ndarray]]) -> None:
        self.m_t = state.get("m_t") or None
        self.v_t = state.get("v_t") or None


class CollmFedMedian(CollmRounds, FedMedian):
    """The coordinate-wise median of the kept updates (Flower's FedMedian), with the CoLLM round logic."""


class CollmFedTrimmedAvg(CollmRounds, FedTrimmedAvg):
    """The trimmed mean (`trim_beta` cut from each end, per value; Flower's FedTrimmedAvg)."""


class CollmKrum(CollmRounds, Krum):
    """The update closest to the others (Flower's Krum, `krum_malicious` assumed malicious)."""


# strategy name -> (class, its own arguments from the config)
STRATEGIES: dict[str, tuple[type, Callable[[ServerConfig], dict]]] = {
    "fedavg": (CollmFedAvg, lambda cfg: {}),
    "fedprox": (CollmFedProx, lambda cfg: {"proximal_mu": cfg.proximal_mu}),
    "fedadam": (CollmFedAdam, lambda cfg: cfg.fedadam.model_dump()),
    "fedmedian": (CollmFedMedian, lambda cfg: {}),
    "fedtrimmedavg": (CollmFedTrimmedAvg, lambda cfg: {"beta": cfg.trim_beta}),
    "krum": (CollmKrum, lambda cfg: {"num_malicious_nodes": cfg.krum_malicious}),
}


def build_strategy(cfg: ServerConfig, round_offset: int = 0,
                   server_state: dict[str, dict[str, np.ndarray]] | None = None) -> CollmRounds:
    """The strategy named by `cfg.strategy`. flwr samples every connected edge for the round's load
    reports (`fraction_train` is applied by the balancer) and `fraction_evaluate` of them for evaluation.
    flwr counts its sample before it waits for `min_available_nodes`, so its minimum for a sample
    (min_train_nodes, and min_evaluate_nodes while every edge evaluates) is the number waited for."""
    common = dict(server_cfg=cfg, round_offset=round_offset, fraction_train=1.0,
                  fraction_evaluate=cfg.fraction_evaluate, min_train_nodes=cfg.min_nodes,
                  min_evaluate_nodes=cfg.min_nodes if cfg.fraction_evaluate >= 1 else 1,
                  min_available_nodes=cfg.min_nodes)
    cls, own = STRATEGIES[cfg.strategy]
    strategy: CollmRounds = cls(**own(cfg), **common)
    if server_state:
        strategy.restore_server_state(server_state)
    return strategy
