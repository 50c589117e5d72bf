"""Record names and keys of the messages between the CoLLM ServerApp and the edges.

QUERY     instruction  {"config": ConfigRecord({"server-round": r})}
          reply        {"report": MetricRecord(REPORT_KEYS), "identity": ConfigRecord({"edge-name": str})}
TRAIN     instruction  {"arrays": ArrayRecord (global adapter, fp32, PEFT keys; EMPTY in round 1 =
                        start from the identical seeded initial adapter),
                        "config": ConfigRecord({"server-round", "budget-tokens", "deadline-s", "lr",
                                                 ["proximal-mu" with FedProx]})}
          reply        {"arrays": ArrayRecord (local adapter fp32), "metrics": MetricRecord(TRAIN_KEYS),
                        "identity": ConfigRecord}
EVALUATE  instruction  {"arrays": global adapter after round r, "config": {"server-round": r}}
          reply        {"metrics": MetricRecord(EVAL_KEYS), "identity": ConfigRecord}

The global adapter after round r is served by every edge as adapter version r.
Unknown values in a report are sent as -1.0.
"""

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

REPORT_KEYS = ("request-rate", "slo-attainment", "spare-capacity", "queue-depth", "running",
               "train-examples", "gain-per-ktok", "train-tokens-per-s", "goodput", "adapter-version")
TRAIN_KEYS = ("num-examples", "train-loss", "train-tokens", "train-steps", "deadline-hit", "seconds")
EVAL_KEYS = ("num-examples", "eval-loss", "eval-accuracy", "adapter-version")
UNKNOWN = -1.0

# HTTP response headers of collm-edge, passed through by collm-router
VERSION_HEADER = "X-CoLLM-Adapter-Version"  # the adapter version the request was admitted with
EDGE_HEADER = "X-CoLLM-Edge"  # the edge that served it
