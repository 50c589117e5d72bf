"""Measure this replica's costs before it serves, so the first decisions are informed.

It picks the serving matmul kernel for steps of few rows (`engine.row_kernels`), then times, on this
machine and through the real code paths: prefill steps of two sizes, decode steps of batch 1..4, and
every unit of one training and one evaluation micro-batch (the real `LayerwisePass`, its gradients
dropped). Each shape runs several times and the fastest counts:
replicas warming up side by side on shared cores (`collm-lab` starts three at once) must not
become a replica's idea of its own speed. The fits then become the priors (`adopt_fit_as_prior`)
and go on refitting online from what the loop measures.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from collm.common.step_cost import step_features
from collm.edge_client.model.row_kernels import MAX_ROWS, onednn_linear, onednn_usable
from collm.edge_client.model.runner import Segment
from collm.edge_client.training.evaluation import EvalJob
from collm.edge_client.training.layerwise import timed_units

log = logging.getLogger("collm.engine")

STEP_REPS = 3
PASS_REPS = 2
KERNEL_REPS = 5


def fastest(fn, reps: int = STEP_REPS, pick=min) -> float:
    """The fastest (or `pick` of the) `reps` timed calls, after one untimed call (allocations,
    first-call paths)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return pick(times)


def fastest_units(make_pass, reps: int = PASS_REPS) -> tuple[list[tuple[object, float]], int]:
    """Each unit of a pass with the fastest time it took over `reps` runs of the same pass, and the
    pass's input tokens."""
    passes = [make_pass() for _ in range(reps)]
    runs = [timed_units(p) for p in passes]
    return [(runs[0][i][0], min(run[i][1] for run in runs)) for i in range(len(runs[0]))], passes[0].tokens


def time_row_kernels(weights: list[torch.Tensor], max_rows: int = MAX_ROWS,
                     reps: int = KERNEL_REPS) -> dict[int, tuple[float, float]]:
    """rows -> (aten's, oneDNN's) fastest time over `weights` for 1..max_rows rows (`RowKernels.choose`
    picks from it); empty where oneDNN cannot take every weight."""
    if not weights or not all(onednn_usable(w) for w in weights):
        return {}
    g = torch.Generator().manual_seed(0)
    timings = {}
    with torch.inference_mode():
        for m in range(1, max_rows + 1):
            xs = [torch.randn(m, w.shape[1], generator=g) for w in weights]
            timings[m] = tuple(fastest(lambda k=kernel: [k(x, w) for x, w in zip(xs, weights)], reps)
                               for kernel in (F.linear, onednn_linear))
    return timings


def warm_up(engine) -> None:
    t0 = time.perf_counter()
    costs, runner, pool = engine.costs, engine.runner, engine.pool
    if engine.cfg.engine.row_kernels:  # first: the step costs below are the chosen kernels'
        rows = runner.kernels.choose(time_row_kernels(runner.kernel_sample()))
        log.info("serving matmuls: oneDNN for %s row(s), aten's otherwise (ms aten/oneDNN by rows: %s)",
                 sorted(rows) or "no", ", ".join(f"{m}: {1000 * a:.1f}/{1000 * d:.1f}"
                                                 for m, (a, d) in runner.kernels.timings.items()))
    w = engine.shadow.pin()
    slots = [pool.allocate() for _ in range(min(4, pool.slots))]
    try:
        g = torch.Generator().manual_seed(0)
        for n in (16, min(64, engine.max_context // 2)):
            ids = torch.randint(3, runner.vocab_size, (n,), generator=g).tolist()
            seconds = fastest(lambda: runner.forward([Segment(slots[0], 0, ids, w, True)], pool))
            costs.step.observe(step_features(0, n, n), seconds)
        for b in range(1, len(slots) + 1):
            segs = [Segment(s, 8, [5], w, True) for s in slots[:b]]
            seconds = fastest(lambda: runner.forward(segs, pool))
            costs.step.observe(step_features(b, 0, 9 * b), seconds)
        trainer = engine.trainer
        if trainer is not None:
            _observe_pass(costs, "train", fastest_units(lambda: trainer.new_pass(
                trainer.stream.peek(trainer.cfg.micro_batch_size))))
        if engine.holdout:
            def eval_pass():  # the first batch of a real evaluation (its examples grouped by length)
                return EvalJob(engine.parts, w, engine.holdout, engine.cfg.training.eval_batch_size,
                               engine.tokenizer.pad_token_id, engine.device).new_pass()

            _observe_pass(costs, "eval", fastest_units(eval_pass))
    finally:
        for s in slots:
            pool.release(s)
        engine.shadow.release(w)
    for model in costs.all_models():
        model.adopt_fit_as_prior()
    log.info("warmup done in %.1f s: decode step (1 seq) %.1f ms, training micro-batch %.2f s, idle training "
             "%.0f tokens/s", time.perf_counter() - t0, 1000 * costs.step_time(1, 0, 64),
             costs.microbatch_time("train", engine.cfg.training.micro_batch_size * engine.cfg.training.max_seq_len
                                   // 2), engine.idle_train_tokens_per_s() if engine.trainer else 0.0)


def _observe_pass(costs, kind: str, measured: tuple[list, int]) -> None:
    units, tokens = measured
    for unit, seconds in units:
        costs.observe_unit(kind, unit.kind, unit.tokens, seconds)
    (costs.train if kind == "train" else costs.eval).observe([tokens], sum(s for _, s in units))
