"""One readable log format for every CoLLM process."""

import logging
import os
import warnings


def setup_logging(level: str | int = "INFO") -> None:
    logging.basicConfig(
        level=os.environ.get("COLLM_LOG_LEVEL", level),
        format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # Libraries that are loud at INFO/WARNING about things that are not the operator's problem.
    for noisy in ("httpx", "httpcore", "bitsandbytes", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt: inputs will be cast.*")
