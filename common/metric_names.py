"""Prometheus metric names, shared by the edge (which exports them) and the router (which reads them)."""

TTFT = "collm_ttft_seconds"
TPOT = "collm_tpot_seconds"
E2E = "collm_e2e_seconds"
REQUESTS = "collm_requests_total"
REQUESTS_SLO_MET = "collm_requests_slo_met_total"
# the same, per served adapter version (label `version`: a number, or "base" for the frozen base)
VERSION_REQUESTS = "collm_version_requests_total"
VERSION_SLO_MET = "collm_version_requests_slo_met_total"
VERSION_TTFT = "collm_version_ttft_seconds"
VERSION_TPOT = "collm_version_tpot_seconds"
SLO_ATTAINMENT = "collm_slo_attainment"
GOODPUT = "collm_goodput_rps"
REQUEST_RATE = "collm_request_rate_rps"
QUEUE_DEPTH = "collm_queue_depth"
RUNNING = "collm_running_requests"
MAX_RUNNING = "collm_max_running_requests"
BATCH_SIZE = "collm_batch_size_mean"
SPARE_CAPACITY = "collm_spare_capacity"
TRAINING_BUSY = "collm_training_busy_fraction"
TRAINING_BESIDE_SERVING = "collm_training_beside_serving_fraction"
TRAIN_SHARE = "collm_training_share_granted"
TRAIN_TOKENS_PER_S = "collm_training_tokens_per_second"
TRAINING_ACTIVE = "collm_training_active"
TRAIN_TOKENS = "collm_training_tokens_total"
ADAPTER_VERSION = "collm_adapter_version"
SWAPS = "collm_adapter_swaps_total"
DEFERRALS = "collm_training_deferrals_total"
STEP_P50 = "collm_step_seconds_p50"
DECODE_STEP_PRED = "collm_decode_step_predicted_seconds"
STEP_COST = "collm_step_cost_seconds"
STEP_COST_TERMS = ("base", "per_decode_seq", "per_prefill_token", "per_1k_kv_tokens")  # label `term`
SLO_TTFT = "collm_slo_ttft_seconds"
SLO_TPOT = "collm_slo_tpot_seconds"
MAX_CONTEXT = "collm_max_context_tokens"
STEP_TOKEN_BUDGET = "collm_step_token_budget"
SLO_SAFETY = "collm_slo_safety"

# The ServerApp's round facts, served by `collm-server exporter CHECKPOINT_DIR` from the run's checkpoints
# (server/exporter.py): Flower runs the ServerApp in a process of its own that ends with the run, so the
# checkpoints (written once per round, durable) are what a scrape reads, during the run and after it.
SERVER_ROUND = "collm_server_round"  # the last complete round
SERVER_ROUNDS = "collm_server_rounds_total"
SERVER_RUN_ACTIVE = "collm_server_run_active"  # 1 from the first round's start until the run has finished
SERVER_ROUND_END = "collm_server_last_round_end_timestamp_seconds"
SERVER_ROUND_DURATION = "collm_server_round_duration_seconds"
SERVER_ROUND_DEADLINE = "collm_server_round_deadline_seconds"
SERVER_STATUS_TIME = "collm_server_status_timestamp_seconds"  # the run's last step: a round started or completed
SERVER_ROUND_TIMEOUT = "collm_server_round_timeout_seconds"  # round_timeout_s: the longest a phase may wait
SERVER_ROUND_EDGES = "collm_server_round_edges"  # label `stage`: asked, selected, replied, aggregated, dropped
SERVER_ROUND_EDGE_STAGES = ("asked", "selected", "replied", "aggregated", "dropped")
SERVER_DROPPED = "collm_server_updates_dropped_total"  # label `reason`: server/exporter.py DROP_REASONS
SERVER_AGG_TOKENS = "collm_server_round_aggregated_tokens"
SERVER_AGG_TOKENS_TOTAL = "collm_server_aggregated_tokens_total"
SERVER_UPDATE_NORM = "collm_server_update_norm"  # label `edge`
SERVER_HOLDOUT_LOSS = "collm_server_holdout_loss"  # the example-weighted mean over the edges that evaluated
SERVER_EDGE_HOLDOUT_LOSS = "collm_server_edge_holdout_loss"  # label `edge`
SERVER_CANARY_REFUSED = "collm_server_canary_refusals_total"
SERVER_PRIVACY_ENABLED = "collm_server_privacy_enabled"
SERVER_EPSILON = "collm_server_privacy_epsilon"  # only while DP releases are accounted
SERVER_MAX_EPSILON = "collm_server_privacy_max_epsilon"  # only with dp.max_epsilon set
