"""The CoLLM ServerApp (`collm.server.app:app`): resume, run the rounds, log a summary.

run_config keys (`[tool.flwr.app.config]` or `flwr run -c "k=v"`):
    config            path of the ServerConfig YAML (default configs/server.yaml)
    rounds / num-server-rounds, strategy, checkpoint-dir    override the YAML
"""

from __future__ import annotations

import time
from logging import ERROR, INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from collm.common.errors import UserError

from collm.common.rounds import latest_complete_round, write_status
from collm.server.checkpoints import check_lora_matches, load_all_metrics, load_latest_good
from collm.server.config import ServerConfig, load_server_config
from collm.server.polling import QuickGrid
from collm.server.strategies import build_strategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        cfg = load_server_config(context.run_config)
        run(grid, cfg)
    except UserError as e:
        log(ERROR, "error: %s", e)
        raise


def run(grid: Grid, cfg: ServerConfig) -> None:
    """Resume from the last complete round under cfg.checkpoint_dir and run up to cfg.rounds."""
    if latest_complete_round(cfg.checkpoint_dir) >= cfg.rounds:
        log(INFO, "all %d rounds are already complete in %s; nothing to do", cfg.rounds, cfg.checkpoint_dir)
        _log_lines(summary_table(load_all_metrics(cfg.checkpoint_dir)))
        write_status(cfg.checkpoint_dir, {"round": cfg.rounds, "phase": "finished", "at": time.time()})
        return
    ckpt = load_latest_good(cfg.checkpoint_dir, warn=lambda msg: log(WARNING, "%s", msg))
    done = ckpt.round if ckpt is not None else 0
    arrays, server_state = ArrayRecord(), {}
    if ckpt is not None:
        check_lora_matches(ckpt, cfg.lora, "lora")
        arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in ckpt.arrays.items()})
        server_state = ckpt.server_state
        log(INFO, "resuming after round %d from %s (%d adapter tensors)", done, cfg.checkpoint_dir, len(arrays))
    else:
        log(INFO, "starting at round 1: the edges start from their identical seeded adapter")

    strategy = build_strategy(cfg, round_offset=done, server_state=server_state)
    if done:
        strategy.restore_history({r: m for r, m in load_all_metrics(cfg.checkpoint_dir).items() if r <= done})
    t0 = time.time()
    strategy.start(grid=QuickGrid(grid, cfg.reply_poll_s, names=strategy.name_of), initial_arrays=arrays,
                   num_rounds=cfg.rounds - done, timeout=cfg.round_timeout_s, train_config=ConfigRecord(),
                   evaluate_config=ConfigRecord())
    log(INFO, "rounds %d-%d finished in %.1f s", done + 1, cfg.rounds, time.time() - t0)
    write_status(cfg.checkpoint_dir, {"round": latest_complete_round(cfg.checkpoint_dir), "phase": "finished",
                                      "at": time.time()})
    _log_lines(summary_table(load_all_metrics(cfg.checkpoint_dir)))


def _log_lines(text: str) -> None:
    for line in text.splitlines():
        log(INFO, "%s", line)


def summary_table(metrics_by_round: dict[int, dict]) -> str:
    """Per-edge holdout eval loss and wall time per round, as a fixed-width text table."""
    if not metrics_by_round:
        return "(no complete rounds)"
    edges = sorted({e for m in metrics_by_round.values() for e in m.get("eval", {})})
    head = ["round", *edges, "wall s"]
    rows = []
    for r in sorted(metrics_by_round):
        m = metrics_by_round[r]
        kept = set(m.get("kept", []))
        cells = [str(r)]
        for e in edges:
            loss = (m.get("eval", {}).get(e) or {}).get("eval-loss")
            cell = "-" if not isinstance(loss, (int, float)) else f"{loss:.4f}"
            cells.append(cell + ("*" if e in kept else ""))
        wall = m.get("wall_s")
        cells.append("-" if wall is None else f"{wall:.1f}")
        rows.append(cells)
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = ["holdout eval loss per edge (* = its update was aggregated that round)", fmt.format(*head)]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)
