"""Configuration of the federation server (`configs/server.yaml`).

Unknown keys are errors and every mistake is reported on one line that names the field
(see `collm.common.config.load_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from collm.common.auth import KeySource
from collm.common.config import LoraConfig, Strict, load_config


class FedAdamConfig(Strict):
    """Server-side Adam over the averaged update (flwr's FedAdam; defaults are flwr's)."""

    eta: float = Field(1e-1, gt=0, description="server learning rate")
    eta_l: float = Field(1e-1, gt=0, description="client learning rate (kept for flwr; edges use balancer.lr)")
    beta_1: float = Field(0.9, ge=0, lt=1)
    beta_2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0, description="adaptivity: added to sqrt(v) in the denominator")


class RobustConfig(Strict):
    """Checks that leave a round's bad updates out of the aggregate."""

    norm_k: float = Field(5.0, gt=1, description="drop an update whose norm exceeds norm_k x the round's median")
    weighting: Literal["examples", "equal"] = Field("examples", description="examples: FedAvg weighs each update by "
                                                    "the examples its edge says it trained on (capped: "
                                                    "max_weight_ratio); equal: every kept update the same")
    max_weight_ratio: float | None = Field(4.0, gt=1, description="an update weighs at most this many times the median "
                                           "of the round's other claims (edges report their own count); null: "
                                           "as claimed")


class BalancerConfig(Strict):
    """The per-round workload balancer (see `collm.server.balancer`)."""

    mode: Literal["slo", "uniform"] = Field("slo", description="slo: the rule in collm.server.balancer; "
                                                 "uniform: every edge gets budget/N (a baseline)")
    target_attainment: float | None = Field(None, gt=0, le=1, description="an edge whose SLO attainment is below "
                                            "this sits the round out (unset: none does; CoLLM edges train only in time "
                                            "serving does not need, so a busy edge trains less, not at all)")
    round_deadline_s: float = Field(120.0, gt=0, description="edges stop training after this long")
    round_token_budget: int = Field(20000, ge=1, description="training tokens per round, all edges together")
    min_edge_tokens: int = Field(256, ge=0, description="an edge offered fewer tokens sits the round out")
    spare_use: float = Field(1.0, gt=0, le=1, description="fraction of an edge's spare time its budget is sized for "
                             "(the edge's co-execution rule already keeps training out of serving's way; a budget "
                             "below what the spare time allows leaves the rest of it idle)")
    fill_budget: bool = Field(True, description="hand the part of round_token_budget the edges' spare-time caps "
                              "leave over to them by weight (the deadline still bounds each edge)")
    lr: float = Field(2e-4, gt=0, description="local learning rate sent to the edges in round 1")
    lr_decay: float = Field(1.0, gt=0, le=1, description="each round after one that changed the global trains at "
                            "the last rate times this (`server/lr_schedule.py`; 1: every round at lr)")
    lr_min: float = Field(0.0, ge=0, description="the decay stops here (the federation keeps adapting)")
    idle_wait_s: float = Field(15.0, ge=0, description="pause before the next round when no update was "
                               "aggregated (every edge busy), instead of polling the edges back to back")

    @model_validator(mode="after")
    def _floor_below_rate(self) -> BalancerConfig:
        if self.lr_min > self.lr:
            raise ValueError(f"lr_min ({self.lr_min:g}) is above lr ({self.lr:g}): set balancer.lr_min to at most "
                             "balancer.lr (the floor of the decay that starts at lr)")
        return self


class DPConfig(Strict):
    """Central differential privacy, client-level (see `collm.server.privacy`)."""

    clipping_norm: float = Field(..., gt=0, description="each edge clips its update (local - start, all tensors "
                                 "together) to this L2 norm")
    noise_multiplier: float = Field(1.0, ge=0, description="z: the server adds Gaussian noise of std "
                                    "z x clipping_norm / (updates averaged); 0: clipping only, no privacy claimed")
    target_delta: float = Field(1e-5, gt=0, lt=1, description="the delta the spent epsilon is reported at")
    max_epsilon: float | None = Field(None, gt=0, description="no more training once the next round would spend "
                                      "more than this epsilon (the rounds go on; the global stays as it is)")


def round_timeout_for(round_deadline_s: float) -> float:
    """The reply timeout a topology started on one machine sets for a round deadline (`collm-lab`,
    `collm-bench`): training's deadline, then evaluation on edges that still serve, each slowed by the
    neighbours, and two minutes for the transport."""
    return 4 * round_deadline_s + 120


class ServerConfig(Strict):
    """Configuration of the CoLLM ServerApp."""

    rounds: int = Field(5, ge=1, description="total rounds; a resumed run continues up to this number")
    strategy: Literal["fedavg", "fedprox", "fedadam", "fedmedian", "fedtrimmedavg", "krum"] = Field(
        "fedavg", description="fedmedian, fedtrimmedavg and krum are Flower's robust aggregations: a minority of "
        "poisoned updates moves the global little (they ignore the examples weights)")
    proximal_mu: float = Field(0.01, ge=0, description="FedProx proximal term weight")
    trim_beta: float = Field(0.2, gt=0, lt=0.5, description="fedtrimmedavg: the fraction cut from each end, per value")
    krum_malicious: int = Field(0, ge=0, description="krum: how many edges may be malicious")
    fedadam: FedAdamConfig = FedAdamConfig()
    min_nodes: int = Field(2, ge=1, description="wait for this many edges before the first round starts")
    min_round_nodes: int | None = Field(None, ge=1, description="every later round needs only this many (an edge "
                                        "that died or left is skipped); default: min_nodes")
    fraction_train: float = Field(1.0, gt=0, le=1, description="share of the available edges asked to train each "
                                  "round, at least min_train_nodes (as Flower counts it: int(n x fraction)); the "
                                  "balancer chooses which: those that trained least recently, then the most spare "
                                  "capacity (collm.server.balancer.choose_participants)")
    min_train_nodes: int = Field(1, ge=1, description="train on at least this many edges a round (when available)")
    fraction_evaluate: float = Field(1.0, gt=0, le=1, description="share of the edges sent each new global to "
                                     "evaluate and serve; an edge left out serves it from its next TRAIN message")
    lora_aggregation: Literal["separate", "ffa", "product"] = Field(
        "separate", description="separate: A and B averaged separately (the mean of the B's times the mean of the "
        "A's is not the mean of the products B.A); ffa: FFA-LoRA, A stays at every edge's identical seeded init and "
        "only B is trained and averaged, which is exact; product: the products B.A averaged exactly (stacked), "
        "then brought to lora.r by truncated SVD: edges may train any rank up to lora.r (common/lora_rank.py)")
    dp: DPConfig | None = Field(None, description="central differential privacy (unset: off)")
    lora: LoraConfig = LoraConfig()
    base_model_name: str = Field("collm-tiny", min_length=1,
                                 description="base_model_name_or_path written to adapter_config.json")
    robust: RobustConfig = RobustConfig()
    balancer: BalancerConfig = BalancerConfig()
    checkpoint_dir: str = Field("runs/checkpoints", min_length=1)
    federation_key: KeySource = Field(KeySource(), description="the key every instruction to the edges is signed "
                                      "with (common/run_proof.py; the first one given): edges whose federation.run_key "
                                      "holds it act on this run's messages only")
    round_timeout_s: float = Field(600.0, gt=0, description="how long to wait for TRAIN/EVALUATE replies")
    query_timeout_s: float = Field(60.0, gt=0, description="how long to wait for load reports")
    reply_poll_s: float = Field(0.25, gt=0, le=3, description="seconds between the server's pulls for replies "
                                "(server/polling.py; flwr waits 3 s, so each of a round's three exchanges ended up "
                                "to 3 s after its last reply)")

    @property
    def nodes_after_first_round(self) -> int:
        return self.min_nodes if self.min_round_nodes is None else self.min_round_nodes

    @model_validator(mode="after")
    def _timeout_covers_deadline(self) -> ServerConfig:
        if self.min_round_nodes is not None and self.min_round_nodes > self.min_nodes:
            raise ValueError(f"min_round_nodes ({self.min_round_nodes}) must not exceed min_nodes ({self.min_nodes})")
        if self.dp is not None and self.strategy not in ("fedavg", "fedprox"):
            raise ValueError(f"dp: works with strategy fedavg or fedprox; {self.strategy}'s aggregate is not the "
                             "average the noise is calibrated to (set strategy: fedavg, or remove dp)")
        if self.lora_aggregation == "product" and (self.dp is not None or self.strategy not in ("fedavg", "fedprox")):
            raise ValueError("lora_aggregation: product averages the products B.A itself; it works with strategy "
                             f"fedavg or fedprox and without dp (got strategy {self.strategy}"
                             f"{', dp on' if self.dp is not None else ''})")
        if self.round_timeout_s <= self.balancer.round_deadline_s:
            raise ValueError(
                f"round_timeout_s ({self.round_timeout_s:g}) must be larger than "
                f"balancer.round_deadline_s ({self.balancer.round_deadline_s:g}), "
                "or every training reply arrives too late")
        return self


# run_config keys (`[tool.flwr.app.config]` or `flwr run -c "k=v"`) that override the YAML
RUN_CONFIG_OVERRIDES = {"rounds": "rounds", "num-server-rounds": "rounds",
                        "strategy": "strategy", "checkpoint-dir": "checkpoint_dir"}
DEFAULT_CONFIG_PATH = "configs/server.yaml"


def load_server_config(run_config: dict[str, Any] | None = None) -> ServerConfig:
    """The ServerConfig named by run_config["config"] (default configs/server.yaml), with overrides."""
    rc = dict(run_config or {})
    path = Path(str(rc.get("config", DEFAULT_CONFIG_PATH)))
    overrides = {field: rc[key] for key, field in RUN_CONFIG_OVERRIDES.items() if key in rc}
    return load_config(ServerConfig, path, overrides)
