"""Record names and keys of the messages between the CoLLM ServerApp and the edges.

QUERY     instruction  {"config": ConfigRecord({"server-round": r})}
          reply        {"report": MetricRecord(LoadReport.to_record()), "identity": ConfigRecord({"edge-name": str})}
TRAIN     instruction  {"arrays": ArrayRecord (global adapter, fp32, PEFT keys, packed into one Array by
                        collm.common.wire; EMPTY in round 1 =
                        start from the identical seeded initial adapter),
                        "config": ConfigRecord({"server-round", "budget-tokens", "deadline-s", "lr",
                                                 ["proximal-mu" with FedProx],
                                                 ["lora-freeze-a": 1 with lora_aggregation ffa],
                                                 ["clipping_norm": C with dp]})}
          reply        {"arrays": ArrayRecord (local adapter fp32, packed), "metrics": MetricRecord(TRAIN_KEYS),
                        "identity": ConfigRecord}
EVALUATE  instruction  {"arrays": global adapter after round r, "config": {"server-round": r}}
          reply        {"metrics": MetricRecord(EVAL_KEYS), "identity": ConfigRecord}

The global adapter after round r is served by every edge as adapter version r.
Unknown values in a report are sent as -1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

REPORT = "report"
IDENTITY = "identity"
EDGE_NAME = "edge-name"
ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"
NUM_EXAMPLES = "num-examples"
SERVER_ROUND = "server-round"
BUDGET_TOKENS = "budget-tokens"
DEADLINE_S = "deadline-s"
LR = "lr"
PROXIMAL_MU = "proximal-mu"
FREEZE_A = "lora-freeze-a"  # FFA-LoRA: train only the B matrices (A stays the global's)
CLIPPING_NORM = "clipping_norm"  # DP: clip the update to this L2 norm (Flower's KEY_CLIPPING_NORM)
# lora_aggregation product (common/lora_rank.py): in TRAIN/EVALUATE config, the global's LoRA alpha (the edge fits
# the global to its own rank); in a TRAIN reply, the edge's own alpha (the server needs it for the product)
LORA_ALPHA = "lora-alpha"
LORA_MAX_RANK = "lora-max-rank"  # product, in TRAIN config: the server's lora.r (an edge above it refuses)

# reply metrics (MetricRecord keys), written by edge_client/federation/client.py, read by server/
TRAIN_LOSS, TRAIN_TOKENS, TRAIN_STEPS = "train-loss", "train-tokens", "train-steps"
DEADLINE_HIT, SECONDS, CARRIED_TOKENS = "deadline-hit", "seconds", "carried-tokens"
UPDATE_NORM = "update-norm"  # DP: the norm of the update before it was clipped
EVAL_LOSS, EVAL_ACCURACY = "eval-loss", "eval-accuracy"
ADAPTER_VERSION = "adapter-version"  # the version the edge serves after the evaluation
CANARY_REFUSED = "canary-refused"  # 1: its canary gate refused the round's global
RANK_ENERGY = "rank-energy"  # product: the share of the global's energy the edge's rank keeps (1: all)
TRAIN_KEYS = (NUM_EXAMPLES, TRAIN_LOSS, TRAIN_TOKENS, TRAIN_STEPS, DEADLINE_HIT, SECONDS, CARRIED_TOKENS)
EVAL_KEYS = (NUM_EXAMPLES, EVAL_LOSS, EVAL_ACCURACY, ADAPTER_VERSION, CANARY_REFUSED)
UNKNOWN = -1.0

def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI-style error object, the body of every 4xx/5xx collm-edge and collm-router send."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# HTTP response headers of collm-edge, passed through by collm-router
VERSION_HEADER = "X-CoLLM-Adapter-Version"  # the adapter version the request was admitted with
EDGE_HEADER = "X-CoLLM-Edge"  # the edge that served it


# The range each load-report value is clamped to (`LoadReport.from_record`); others: +-REPORT_MAX.
REPORT_MAX = 1e12
REPORT_BOUNDS: dict[str, tuple[float, float]] = {
    "slo-attainment": (UNKNOWN, 1.0), "spare-capacity": (0.0, 1.0), "train-share": (0.0, 1.0),
    "gain-per-ktok": (-1e3, 1e3), "budget-fill": (UNKNOWN, 1e3),
    "adapter-version": (UNKNOWN, 2.0**31), "refused-version": (UNKNOWN, 2.0**31),
    "request-rate": (0.0, 1e6), "queue-depth": (0.0, 1e6), "running": (0.0, 1e6), "goodput": (0.0, 1e6),
    "train-examples": (0.0, 1e9), "train-tokens-per-s": (0.0, 1e9), "carried-tokens": (0.0, REPORT_MAX),
}


@dataclass(frozen=True)
class LoadReport:
    """One edge's load report (its QUERY reply), the input of the server's workload balancer.

    The edge fills it from its `EdgeSnapshot`; on the wire each field is a MetricRecord key with
    dashes (`request_rate` -> "request-rate"); None travels as UNKNOWN.
    """

    name: str                        # the edge (travels in the identity record, not in the report)
    request_rate: float              # λ, requests/s finished over the edge's window
    slo_attainment: float | None     # A, fraction of completed requests within SLO; None = none completed
    spare_capacity: float            # s, fraction of time not serving, [0, 1]
    queue_depth: float               # q, requests waiting
    running: float                   # requests being served
    train_examples: int              # n, local training examples
    gain_per_ktok: float | None      # g, holdout-loss drop per 1k training tokens last round; None = unknown
    train_tokens_per_s: float        # c, training throughput when idle
    goodput: float = 0.0             # requests/s that met every SLO
    adapter_version: int = -1        # the version the edge serves
    refused_version: int = -1        # the last global its canary gate refused to serve (-1: none)
    carried_tokens: int = 0          # tokens trained since its last update, sent with its next one
    train_share: float = 0.0         # f, training seconds per second its co-execution rule grants beside serving
    budget_fill: float | None = None  # tokens it trained last round / its budget (< 1: it could not keep up); None = unknown

    @staticmethod
    def key(field_name: str) -> str:
        return field_name.replace("_", "-")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.key(f.name) for f in fields(cls) if f.name != "name")

    def to_record(self) -> dict[str, float]:
        def num(v) -> float:
            return UNKNOWN if v is None or (isinstance(v, float) and not math.isfinite(v)) else float(v)

        return {self.key(f.name): num(getattr(self, f.name)) for f in fields(self) if f.name != "name"}

    @classmethod
    def from_record(cls, name: str, record: dict) -> LoadReport:
        """Parse a QUERY reply's MetricRecord; missing or non-finite values become unknown (or 0).

        Attainment is a fraction, so any negative value means unknown; a gain may be negative
        (quality got worse), so only exactly UNKNOWN means unknown. The report is an edge's word, so every
        value is clamped to a range no honest edge leaves (`REPORT_BOUNDS`): a finite 1e300 would otherwise
        overflow the balancer's weights to inf and NaN and end the ServerApp.
        """
        def num(key: str, default: float = 0.0) -> float:
            v = record.get(key, default)
            if not (isinstance(v, (int, float)) and math.isfinite(v)):
                return default
            lo, hi = REPORT_BOUNDS.get(key, (-REPORT_MAX, REPORT_MAX))
            return min(max(float(v), lo), hi)

        attainment, gain = num("slo-attainment", UNKNOWN), num("gain-per-ktok", UNKNOWN)
        return cls(
            name=name, request_rate=num("request-rate"),
            slo_attainment=attainment if attainment >= 0 else None,
            spare_capacity=num("spare-capacity"), queue_depth=num("queue-depth"), running=num("running"),
            train_examples=int(num("train-examples")), gain_per_ktok=gain if gain != UNKNOWN else None,
            train_tokens_per_s=num("train-tokens-per-s"), goodput=num("goodput"),
            adapter_version=int(num(ADAPTER_VERSION, UNKNOWN)),
            refused_version=int(num("refused-version", UNKNOWN)), carried_tokens=int(num("carried-tokens")),
            train_share=num("train-share"),
            budget_fill=fill if (fill := num("budget-fill", UNKNOWN)) >= 0 else None)
