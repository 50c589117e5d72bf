"""Which matmul kernel a serving projection uses for a step of few rows, picked by timing on this machine.

A decode step multiplies each weight by one row per running request. On a CPU, aten's fp32 linear
(MKL's sgemm) is slow for 2-3 rows: on the 2-core bench machine, one thread, SmolLM2-135M's 30 layers
of projections plus its LM head take 46 / 82 / 105 / 65 ms for 1 / 2 / 3 / 4 rows, so a decode step of
three requests costs more than one of four. oneDNN's linear over the same dense weight (no packed copy:
the base is still held once) takes 38 / 49 / 53 / 57 ms there, and loses from about 6 rows on.
Which kernel wins depends on the CPU and the libraries, so nothing is assumed: `calibrate` times both
on the model's own weights for each row count up to `max_rows` (the engine's warm-up), and a row count
uses oneDNN only where it was faster. Both compute x W^T + b in fp32; they differ in summation order
(about 1e-6 relative), not in what they compute. Before calibration, off a CPU, for other dtypes, or
where the oneDNN op is missing or disagrees with aten, every call is aten's, as before.

`python benchmarks/row_kernels.py` prints the table above for this machine.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

log = logging.getLogger("collm.model")

MAX_ROWS = 8  # past this, steps carry prefill chunks: aten's kernel is as fast or faster (and is timed by nothing)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN's linear exists here, takes this weight, and computes what aten's does."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        return torch.allclose(_onednn(x, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class RowKernels:
    """y = x W^T + b for the serving runner's projections, by the number of rows in x: oneDNN's kernel
    for the row counts where `calibrate` found it faster, aten's otherwise."""

    def __init__(self):
        self.onednn_rows: frozenset[int] = frozenset()
        self.timings: dict[int, tuple[float, float]] = {}  # rows -> (aten s, oneDNN s), from calibrate

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] in self.onednn_rows and x.dim() == 2 and weight.dtype == x.dtype == torch.float32:
            return _onednn(x, weight, bias)
        return F.linear(x, weight, bias)

    def calibrate(self, weights: list[torch.Tensor], max_rows: int = MAX_ROWS, reps: int = 5) -> frozenset[int]:
        """Time both kernels over `weights` (a sample of the model's projections: their sum is what a
        step pays) for 1..max_rows rows, the fastest of `reps` runs each; keep oneDNN where it wins."""
        self.onednn_rows = frozenset()
        weights = [w for w in weights if w is not None]
        if not weights or not all(onednn_usable(w) for w in weights):
            return self.onednn_rows
        g = torch.Generator().manual_seed(0)
        inputs = {(m, n): torch.randn(m, n, generator=g) for m in range(1, max_rows + 1) for n in {w.shape[1] for w in weights}}

        def best(fn, m: int) -> float:
            times = []
            for _ in range(reps + 1):  # the first run is untimed (first-call paths)
                t = time.perf_counter()
                for w in weights:
                    fn(inputs[m, w.shape[1]], w, None)
                times.append(time.perf_counter() - t)
            return min(times[1:])

        with torch.inference_mode():
            for m in range(1, max_rows + 1):
                self.timings[m] = (best(F.linear, m), best(_onednn, m))
        self.onednn_rows = frozenset(m for m, (aten, dnn) in self.timings.items() if dnn < aten)
        log.info("serving matmuls: oneDNN for %s row(s), aten's otherwise (ms aten/oneDNN by rows: %s)",
                 sorted(self.onednn_rows) or "no", ", ".join(f"{m}: {1000 * a:.1f}/{1000 * d:.1f}"
                                                             for m, (a, d) in self.timings.items()))
        return self.onednn_rows
