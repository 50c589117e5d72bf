"""collm-bench's judge of served quality: every adapter a mode served, scored once on one fixed held-out
set (the same for every mode), outside the measured windows; quality-weighted goodput reads these losses."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from collm.common.data import Record, load_records, split_holdout
from collm.common.rounds import complete_rounds
from collm.lab.bench_config import BenchConfig
from collm.lab.topology import edge_config

if TYPE_CHECKING:
    from collm.lab.bench_topology import ModeRun


class QualityJudge:
    """Loss of adapters on one fixed held-out set (same for every mode), computed outside the windows."""

    def __init__(self, cfg: BenchConfig):
        from collm.common.data import format_example
        from collm.edge_client.engine import Engine
        from collm.edge_client.model.loading import load_model

        base = edge_config(cfg.model, "judge", Path(cfg.out), categories=[], overrides=cfg.edge)
        lm = load_model(base.model)
        self.engine = Engine(lm, base)  # not started: evaluation runs synchronously here
        by_cat: dict[str, list[Record]] = {}
        for r in split_holdout(load_records(), 0.1)[1]:
            by_cat.setdefault(r.category, []).append(r)
        per_cat = max(1, cfg.eval_records // max(1, len(by_cat)))
        self.examples = [format_example(lm.tokenizer, r, base.training.max_seq_len)
                         for rs in by_cat.values() for r in rs[:per_cat]]

    def loss(self, state: dict | None) -> float:
        from collm.edge_client.training.evaluation import EvalJob

        eng = self.engine
        weights = eng.shadow.current if state is None else eng.layers.serving_weights(state, -1, eng.device,
                                                                                       eng.lm.dtype)
        job = EvalJob(eng.parts, weights, self.examples, 8, eng.tokenizer.pad_token_id, eng.device)
        job.run_all()
        return float(job.report.loss)


def served_loss_timeline(judge: QualityJudge, run: ModeRun, t_start: float, base_loss: float) -> list[dict]:
    """(seconds after the mode's first point started, loss) of every adapter it served, from its swap."""
    from collm.common.adapter_io import load_adapter

    points = [{"t": 0.0, "round": 0, "loss": base_loss}]
    for r in complete_rounds(run.ckpt_dir):
        d = run.ckpt_dir / f"round-{r:04d}"
        swapped = (d / "metrics.json").stat().st_mtime
        if run.mode == "isolated":
            at = [x["at"] for x in run.reloads if x["round"] == r and x["status"] == 200]
            if not at:
                continue  # written but never loaded by the serving replicas
            swapped = max(at)
        state, _ = load_adapter(d)
        points.append({"t": swapped - t_start, "round": r, "loss": judge.loss(state)})
    return points
