"""Configuration of one `collm-edge` process (`configs/edge-*.yaml`).

Unknown keys are errors and every mistake is reported on one line that names the field
(see `collm.common.config.load_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from collm.common.auth import AuthConfig, KeySource
from collm.common.config import LoraConfig, ServerTls, Strict
from collm.common.errors import UserError
from collm.common.listen import is_loopback
from collm.common.slo import SLO

# ----------------------------------------------------------------------------- model
class TinyModelConfig(Strict):
    """A random Llama built from these sizes (tests and CI); deterministic for a given seed."""

    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(128, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(1024, ge=16)
    vocab_size: int = Field(512, ge=300, description="BPE vocabulary size of the local tokenizer")
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class ModelConfig(Strict):
    """Where the base model comes from and how it is held in memory."""

    source: Literal["tiny", "bundled", "local", "hub"] = "tiny"
    path: str | None = Field(None, description="local Hugging Face directory (source: local)")
    gguf_file: str | None = Field(None, description="GGUF file name inside `path` (optional)")
    hub_id: str | None = Field(None, description="Hugging Face hub id (source: hub)")
    hub_timeout_s: float = Field(5.0, gt=0, description="give up on the hub after this long")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    quantization: Literal["none", "nf4", "int8"] = "none"
    cache_dir: str = Field("~/.cache/collm", description="converted models are cached here")
    threads: int | None = Field(None, ge=1, description="CPU threads for torch (default: one per core); with "
                                                       "several edges on one machine give each cores/edges")
    cpu_affinity: list[int] | None = Field(None, description="pin this edge to these CPU cores (e.g. one edge "
                                                             "per core, like separate devices on one machine)")
    tiny: TinyModelConfig = TinyModelConfig()

    @model_validator(mode="after")
    def _source_fields(self) -> ModelConfig:
        if self.cpu_affinity is not None:
            from collm.common.procs import usable_cpus

            have = usable_cpus()
            bad = [c for c in self.cpu_affinity if c not in have]
            if bad or not self.cpu_affinity:
                raise ValueError(f"cpu_affinity {self.cpu_affinity} must list cores this process may use: {have}")
        if self.source == "local":
            if not self.path:
                raise ValueError("source 'local' needs `path`: a Hugging Face model directory")
            if not Path(self.path).expanduser().is_dir():
                raise ValueError(f"path {self.path!r} is not a directory")
        if self.source == "hub" and not self.hub_id:
            raise ValueError("source 'hub' needs `hub_id`, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
        return self


# ----------------------------------------------------------------------------- edge
class EngineConfig(Strict):
    """Continuous batching limits of one replica."""

    max_running: int = Field(16, ge=1, description="requests decoding at once")
    max_queue: int = Field(256, ge=0, description="requests waiting for admission; more get 429")
    shed_late: bool = Field(True, description="refuse (429, 'expired') a waiting request once its wait plus the "
                            "prefill queued ahead of it and its own is past its TTFT target: served late it only "
                            "pushes the requests behind it past their targets too")
    kv_cache_mb: float = Field(256.0, gt=0, description="KV memory reserved for running requests")
    step_token_budget: int = Field(256, ge=16, description="tokens per forward step (prefill chunking)")
    max_context: int | None = Field(None, ge=16, description="prompt + output limit; default: model's")
    default_max_tokens: int = Field(128, ge=1)
    warmup: bool = Field(True, description="measure step costs at start before serving")
    fuse_projections: bool = Field(True, description="serve q|k|v and gate|up as one matmul each (the base "
                                   "weights become views of one tensor per group, still one copy; a base "
                                   "memory-mapped from safetensors is then partly owned memory instead of "
                                   "page cache); false: one call per projection, as HF does")
    row_kernels: bool = Field(True, description="at warm-up, time oneDNN's fp32 linear against aten's for decode "
                              "steps of 1-8 rows and use it where it is faster (on the bench machine steps of 2-3 "
                              "rows take 0.60-0.68x the time; edge_client/model/row_kernels.py); false: aten's always")
    timeline: str | None = Field(None, description="write every serving step, background unit and adapter "
                                 "publish to this JSON-lines file (engine/timeline.py; for finding why requests "
                                 "were slow); off by default")


class SLOConfig(Strict):
    """Default service-level objectives of this edge; a request may override them."""

    ttft_ms: float = Field(2000.0, gt=0, allow_inf_nan=False, description="time to first token")
    tpot_ms: float = Field(200.0, gt=0, allow_inf_nan=False, description="time per output token after the first")
    safety: float = Field(0.8, gt=0, le=1, description="fraction of each SLO the scheduler plans to use")
    override_floor: float = Field(0.25, ge=0, le=1, description="a request's own `slo` may tighten each target to "
                                  "this fraction of the edge's at most (a tighter one is raised to it)")

    @property
    def targets(self) -> SLO:
        return SLO.from_ms(self.ttft_ms, self.tpot_ms)


class DataConfig(Strict):
    """The edge's local instruction data and its holdout split."""

    path: str | None = Field(None, description="JSONL of instruction records; default: bundled Dolly subset")
    categories: list[str] | None = Field(None, description="keep only these categories (non-IID edge)")
    iid_shards: int | None = Field(None, ge=1, description="split into this many IID shards ...")
    iid_shard_index: int = Field(0, ge=0, description="... and keep this one")
    holdout_fraction: float = Field(0.1, gt=0, lt=1)
    max_records: int | None = Field(None, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.path is not None and not Path(self.path).expanduser().is_file():
            raise ValueError(f"path {self.path!r} does not exist")
        if self.iid_shards is not None and self.iid_shard_index >= self.iid_shards:
            raise ValueError("iid_shard_index must be smaller than iid_shards")
        return self


class FeedbackConfig(Strict):
    """The co-execution controller (`training.co_schedule: slo_feedback`, edge_client/engine/co_schedule.py):
    how fast training's share of busy time follows the measured latency slack."""

    period_s: float = Field(1.0, gt=0, le=60, description="the share is adjusted at most this often (seconds)")
    window_requests: int = Field(20, ge=1, le=10_000, description="the percentile is over this many of the most "
                                 "recent finished requests ...")
    window_s: float = Field(60.0, gt=0, le=3600, description="... none older than this (seconds)")
    min_requests: int = Field(8, ge=1, description="fewer fresh requests than this: no evidence, the share holds")
    quantile: float = Field(0.9, gt=0, le=1, description="the latency percentile the slack is measured at")
    slack_low: float = Field(0.2, ge=0, lt=1, description="slack (1 - latency / target) below this: the share "
                             "steps down")
    slack_high: float = Field(0.3, gt=0, lt=1, description="slack above this: the share steps up (only while it is "
                              "what refuses training)")
    step: float = Field(0.03, gt=0, le=1, description="additive step of the share per period")
    backoff: float = Field(0.5, ge=0, lt=1, description="the share is multiplied by this on a miss, a long wait "
                           "or a request shed as late")
    cool_s: float = Field(10.0, ge=0, description="no growth this long after a cut (seconds)")
    queue_cut: float = Field(0.5, gt=0, le=1, description="a request waiting longer than this fraction of its "
                             "TTFT target cuts the share")
    rho_max: float = Field(0.85, gt=0, le=1, description="serving busier than this (fraction of the last "
                           "busy_window_s in serving steps) cuts the share to 0: near saturation any work beside "
                           "serving queues requests (Heracles' load gate) ...")
    rho_resume: float = Field(0.8, gt=0, le=1, description="... and it may grow again only below this")
    f_max: float = Field(0.8, ge=0, le=1, description="the share stays in [0, f_max] (training seconds per second)")
    stale_s: float = Field(30.0, ge=0, description="no evidence this long: the share falls to 0 (idle time only)")

    @model_validator(mode="after")
    def _check(self) -> FeedbackConfig:
        if self.slack_low >= self.slack_high:
            raise ValueError(f"feedback.slack_low ({self.slack_low:g}) must be below feedback.slack_high "
                             f"({self.slack_high:g}): between them is the band where the share holds")
        if self.rho_resume > self.rho_max:
            raise ValueError(f"feedback.rho_resume ({self.rho_resume:g}) must not exceed feedback.rho_max "
                             f"({self.rho_max:g})")
        if self.min_requests > self.window_requests:
            raise ValueError(f"feedback.min_requests ({self.min_requests}) must not exceed feedback.window_requests "
                             f"({self.window_requests})")
        return self


class TrainingConfig(Strict):
    """Local LoRA training: micro-batches co-scheduled inside the SLO slack."""

    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(2, ge=1, description="sequences per micro-batch")
    grad_accum_steps: int = Field(4, ge=1, description="micro-batches per optimizer step")
    max_seq_len: int = Field(256, ge=16)
    group_by_length: int = Field(50, ge=0, le=10_000, description="a micro-batch's sequences are padded to the "
                                 "longest: each epoch's shuffled examples are cut into windows of this many "
                                 "micro-batches, sorted by length inside a window and grouped, so a micro-batch "
                                 "holds sequences of similar length (Hugging Face's group_by_length; 0: random "
                                 "micro-batches: 16-19% of a micro-batch of 2 from the bench's data is padding, benchmarks/padding.py)")
    reset_optimizer_each_round: bool = True
    co_schedule: Literal["slo_feedback", "work_conserving", "naive"] = Field(
        "slo_feedback", description="slo_feedback: training in idle time, and beside decodes as much as the "
        "measured latency slack allows (`feedback`; CoLLM, edge_client/engine/co_schedule.py); work_conserving: "
        "idle time plus a fixed share (`busy_share`); naive: a whole micro-batch after every serving step (the "
        "baseline without SLO control)")
    feedback: FeedbackConfig = FeedbackConfig()
    busy_share: float = Field(0.0, ge=0, le=1, description="work_conserving only: while requests decode, training "
                              "may take up to busy_share - rho - busy_margin of the replica (rho: measured serving "
                              "busy fraction); 0: only idle time")
    busy_margin: float = Field(0.1, ge=0, le=1)
    busy_window_s: float = Field(10.0, gt=0, description="window over which rho is measured")
    eval_share: float = Field(0.25, ge=0, le=1, description="while a round's evaluation runs, its units may take "
                              "at least this share of the replica beside decodes (still within the per-step cap "
                              "and the slack guard), even when training gets none: the round on every edge and "
                              "the served version's swap wait on it (docs/benchmarks.md, 'A budget for the "
                              "idle edge'); 0: evaluation runs only where training would. co_schedule naive "
                              "has no floor")
    default_round_tokens: int = Field(4096, ge=1, description="round budget when the server assigns none")
    finish_grace: float = Field(0.25, ge=0, le=1, description="a micro-batch in flight at the round's deadline "
                                "may finish within this fraction of the deadline after it (no new one starts); "
                                "0: cut it off and lose its work")
    carry_between_rounds: bool = Field(True, description="after a round's update is sent, keep training "
                                       "(as serving allows) until the next round; that work is rebased onto the new "
                                       "global and sent with the next update (edge_client/training/trainer.py)")
    carry_budget_rounds: float = Field(4.0, gt=0, le=100, description="the carry trains up to this many times "
                                        "the last round's token budget: idle time between rounds is not left unused, "
                                        "and an edge that sits rounds out does not drift without bound")
    eval_batch_size: int = Field(4, ge=1)
    max_eval_records: int | None = Field(64, ge=1, description="cap on holdout records per evaluation")

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.busy_share > 0 and self.co_schedule != "work_conserving":
            raise ValueError(f"training.busy_share ({self.busy_share:g}) is a setting of co_schedule: work_conserving; "
                             f"co_schedule is {self.co_schedule} (slo_feedback sets the share itself: "
                             "training.feedback)")
        if self.co_schedule == "naive" and "eval_share" not in self.model_fields_set:
            self.eval_share = 0.0  # naive has no floor; written out as such, the config reads back the same
        if self.eval_share > 0 and self.co_schedule == "naive":
            raise ValueError(f"training.eval_share ({self.eval_share:g}) is a floor of the SLO-aware policies; "
                             "co_schedule naive runs every unit at once: set eval_share to 0")
        return self


class ApiConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    shutdown_grace_s: float = Field(30.0, ge=0, description="SIGTERM: let in-flight requests finish")
    admin: bool = Field(False, description="enable /admin/* (local training, evaluation, adapter loading); needs "
                        "auth.admin_tokens")
    admin_without_token: bool = Field(False, description="allow admin: true with no auth.admin_tokens, on a loopback "
                                      "host only (a lab or a test on one machine): then anyone who can reach the "
                                      "port can publish adapters")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="a request body over this many bytes is "
                                "answered 413 before it is read whole (common/http_guard.py)")
    max_prompt_chars: int = Field(262_144, ge=1, description="a prompt (all messages together, each counting 32 "
                                  "characters more for its template markers) over this many characters is answered "
                                  "400 before it is tokenized")
    tls: ServerTls = Field(ServerTls(), description="serve HTTPS with this certificate (keys then never travel in "
                           "clear text; the router verifies it with proxy.ca_file)")
    adapter_dir: str | None = Field(None, description="/admin/adapters loads only from inside this directory (paths "
                                    "outside it, '..' and symlinks out of it are refused); unset: any path")


class AdaptersConfig(Strict):
    """How clients name what they are served (the `model` field; see edge_client/serve/models.py)."""

    name: str = Field("collm-global", pattern=r"^[A-Za-z0-9_.-]+$",
                      description="model id of the global adapter; `<name>@<version>` names a retained version")
    retain: int = Field(4, ge=1, le=64, description="last published versions kept servable by `<name>@<version>`")
    local_every: int = Field(4, ge=0, description="serve the training adapter as `<name>:local` every this many "
                             "local optimizer steps (the global plus what this edge trained since; 0: off)")
    canary_margin: float | None = Field(0.05, ge=0, description="before a new global is served, its holdout loss "
                                        "must be at most (1 + margin) x the serving version's, else the edge keeps "
                                        "serving what it serves (edge_client/federation/canary.py); null: no gate, "
                                        "swap first and evaluate after")


class FederationConfig(Strict):
    """How this edge takes part in Flower rounds (a child flower-supernode; tasks run in-process)."""

    enabled: bool = False
    superlink: str = Field("127.0.0.1:8000", pattern=r"^[^\s:]+:\d+$", description="SuperLink host:port")
    runtime_port: int = Field(9094, ge=1, le=65535, description="the SuperNode's runtime API (127.0.0.1 only)")
    insecure: bool = Field(True, description="plain HTTP to the SuperLink; false = TLS")
    root_certificates: str | None = Field(None, description="CA file to verify the SuperLink (TLS)")
    auth_private_key: str | None = Field(None, description="SuperNode key (OpenSSH ECDSA) for node authentication")
    node_config: dict[str, str | int | float | bool] = Field(default_factory=dict)
    fleet_poll_s: float = Field(0.5, gt=0, le=3, description="at most this many seconds between the SuperNode's "
                                "pulls from the SuperLink while it has no message (flwr waits 3 s, and each of a "
                                "round's three exchanges waited for it)")
    supernode_nice: int = Field(10, ge=0, le=19, description="scheduling niceness of the child flower-supernode: "
                                "relaying round messages is background work, serving on this device goes first")
    run_key: KeySource = Field(KeySource(), description="act only on messages signed with one of these keys (the "
                               "server's federation_key; common/run_proof.py): another run on the same SuperLink is "
                               "refused; unset: every run is obeyed")
    bootstrap_from: str | None = Field(None, description="the server's checkpoint directory, where this edge can "
                                       "read it (a shared or mounted folder): a (re)started edge serves the latest "
                                       "global adapter from there before it reports ready")

    @model_validator(mode="after")
    def _tls(self) -> FederationConfig:
        for field in ("root_certificates", "auth_private_key"):
            path = getattr(self, field)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(f"{field} {path!r} does not exist")
        if self.insecure and (self.root_certificates or self.auth_private_key):
            raise ValueError("root_certificates / auth_private_key need TLS: set insecure: false")
        return self


class EdgeConfig(Strict):
    """Configuration of one `collm-edge` process."""

    name: str = Field("edge0", pattern=r"^[A-Za-z0-9_.-]+$")
    model: ModelConfig = ModelConfig()
    lora: LoraConfig = LoraConfig()
    engine: EngineConfig = EngineConfig()
    slo: SLOConfig = SLOConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    api: ApiConfig = ApiConfig()
    auth: AuthConfig = AuthConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    federation: FederationConfig = FederationConfig()
    state_dir: str = Field("state/{name}", description="adapters and local state; {name} = edge name")

    @model_validator(mode="after")
    def _open_admin_on_loopback_only(self) -> EdgeConfig:
        if self.api.admin and self.api.admin_without_token and not is_loopback(self.api.host):
            raise ValueError(f"api.admin_without_token: allowed on a loopback host only, api.host is "
                             f"{self.api.host!r}; set auth.admin_tokens instead")
        return self

    def check_admin_keys(self, keys) -> None:
        """At start, with the keys resolved (an empty variable is no token): admin on and no token is a
        one-line error unless explicitly allowed on loopback (issue #34: /admin/* answered anyone)."""
        if self.api.admin and not keys.admin and not self.api.admin_without_token:
            raise UserError("api.admin: /admin/* would answer anyone (it publishes adapters and rolls them back) and "
                            "auth.admin_tokens gives no token; set one, or on a loopback host "
                            "api.admin_without_token: true")

    @property
    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir.format(name=self.name)).expanduser()
