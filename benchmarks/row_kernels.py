"""The serving step's matmul kernel for few rows (edge_client/model/row_kernels.py), measured on this machine.

On the bundled SmolLM2-135M-Instruct with one thread (as each bench replica runs), through the engine's
own ModelRunner and KV pool: first what the warm-up times to choose (`engine.warmup.time_row_kernels`:
the fastest of 5 passes over one layer's projections and the LM head, aten's fp32 linear against
oneDNN's, per row count), then whole
decode steps of B running requests with the kernel choice off (aten's always, as before) and on (the
calibrated choice), alternating off/on in each repeat so a drift of the machine weighs on both alike.
Each repeat times `--steps` decode steps; the table gives the median step time of each and the
on/off ratio with a 95% bootstrap interval over the repeats.

    python benchmarks/row_kernels.py --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adapter_quality import edge_cfg  # noqa: E402  (the bundled model, one thread)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,3,4,5,6,8", help="decode rows per step to time")
    p.add_argument("--repeats", type=int, default=15, help="off/on pairs per batch size")
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed repeat")
    p.add_argument("--context", type=int, default=64, help="tokens already in each sequence's KV")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1 or args.repeats < 2 or args.steps < 1:
        p.error("--batches must be positive integers, --repeats >= 2, --steps >= 1")

    from collm.common.stats import ratio_ci
    from collm.edge_client.engine import Engine
    from collm.edge_client.engine.warmup import time_row_kernels
    from collm.edge_client.model.loading import load_model
    from collm.edge_client.model.runner import Segment

    cfg = edge_cfg(1, 8)
    torch.set_num_threads(1)
    engine = Engine(load_model(cfg.model), cfg, None)
    runner, pool = engine.runner, engine.pool
    chosen = runner.kernels.choose(time_row_kernels(runner.kernel_sample()))
    print(f"torch {torch.__version__}, 1 thread; calibrate (one layer's projections + LM head, ms):")
    print("rows  aten  oneDNN  chosen")
    for m, (aten, dnn) in runner.kernels.timings.items():
        print(f"{m:4d}  {1000 * aten:5.1f}  {1000 * dnn:6.1f}  {'oneDNN' if m in chosen else 'aten'}")

    w = engine.shadow.pin()
    slots = [pool.allocate() for _ in range(max(batches))]
    if None in slots:
        p.error(f"the KV pool has fewer than {max(batches)} slots; lower --batches")

    def steps(b: int) -> float:
        segs = [Segment(s, args.context, [5], w, True) for s in slots[:b]]
        t = time.perf_counter()
        for _ in range(args.steps):
            runner.forward(segs, pool)
        return (time.perf_counter() - t) / args.steps

    print(f"\ndecode step of B rows, median of {args.repeats} repeats x {args.steps} steps (ms); on/off with 95% CI")
    print("   B    off     on  on/off [95% CI]")
    for b in batches:
        times = {"off": [], "on": []}
        for i in range(args.repeats + 1):
            for name, rows in (("off", frozenset()), ("on", chosen)):  # off: aten's for every row count
                runner.kernels.onednn_rows = rows
                t = steps(b)
                if i:  # the first pair is untimed (first-call paths)
                    times[name].append(t)
        r, lo, hi = ratio_ci(times["on"], times["off"])
        print(f"{b:4d}  {1000 * statistics.median(times['off']):5.1f}  {1000 * statistics.median(times['on']):5.1f}  "
              f"{r:.2f} [{lo:.2f}, {hi:.2f}]", flush=True)
    runner.kernels.onednn_rows = chosen


if __name__ == "__main__":
    main()
