"""What happened in one round, as the ServerApp writes it to the round's checkpoint (metrics.json) and
`collm-server status` and the exporter read it back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RoundRecord:
    """What happened in one round: written to the round's checkpoint as metrics.json (`as_dict`)."""

    round: int
    strategy: str
    started_at: str
    balancer: list[dict] = field(default_factory=list)  # one decision per edge asked, with its load report
    lr: float | None = None  # the learning rate sent with this round's TRAIN messages (none sent: None)
    training_skipped: str | None = None
    train: dict[str, dict] = field(default_factory=dict)  # edge -> its TRAIN reply's metrics
    dropped: dict[str, str] = field(default_factory=dict)  # edge -> why its update was left out
    capped: dict[str, float] = field(default_factory=dict)  # edge -> the weight its over-large claim was cut to
    norms: dict[str, float] = field(default_factory=dict)  # edge -> its update's norm |local - global| (screened)
    rank_energy: float | None = None  # lora_aggregation product: share of the aggregate's energy lora.r keeps
    kept: list[str] = field(default_factory=list)
    train_aggregate: dict | None = None
    eval: dict[str, dict] = field(default_factory=dict)
    eval_aggregate: dict | None = None
    refused_by: list[str] = field(default_factory=list)  # edges whose canary gate refused the new global
    privacy: dict | None = None
    wall_s: float | None = None
    global_keys: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)
