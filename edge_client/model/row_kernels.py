"""Which matmul kernel a serving projection uses for a step of few rows.

A decode step multiplies each weight by one row per running request. On the bench machine's CPU,
aten's fp32 linear (MKL's sgemm) is slow for 2-3 rows: a SmolLM2-135M decode step of 3 requests took
longer than one of 4. oneDNN's linear over the same dense weight (no packed copy: the base is still
held once) is not: decode steps of 2 / 3 rows took 0.68x / 0.60x the time with it, 1 and 4-8 rows
0.86-0.96x (`python benchmarks/row_kernels.py`, docs in benchmarks/README.md). Which kernel wins
depends on the CPU and the libraries, so nothing is assumed: the engine's warm-up times both on the
model's own weights for each row count up to `MAX_ROWS` (`engine.warmup.time_row_kernels`), and
`RowKernels.choose` keeps oneDNN only for the row counts where it was faster. Both compute x W^T + b
in fp32; they differ in summation order (about 1e-6 relative), not in result. Until then, with
`engine.row_kernels: false`, off a CPU, for other dtypes or where the oneDNN op is missing or
disagrees with aten, every call is aten's, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # the row counts timed: decode steps (more rows carry prefill chunks, which stay on aten's kernel)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def onednn_usable(weight: torch.Tensor) -> bool:
    """oneDNN's linear exists here, takes this weight, and computes what aten's does."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        return torch.allclose(onednn_linear(x, weight), F.linear(x, weight), rtol=1e-4, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class RowKernels:
    """y = x W^T + b for the serving runner's projections, by the number of rows in x: oneDNN's kernel
    for the row counts `choose` was shown to be faster, aten's otherwise."""

    def __init__(self):
        self.onednn_rows: frozenset[int] = frozenset()
        self.timings: dict[int, tuple[float, float]] = {}  # rows -> (aten s, oneDNN s) the choice was made on

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] in self.onednn_rows:
            return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def choose(self, timings: dict[int, tuple[float, float]]) -> frozenset[int]:
        """oneDNN for the row counts where it timed faster (`timings`: rows -> (aten s, oneDNN s), timed on
        weights `onednn_usable` accepts; empty: aten's for every row count); those row counts."""
        self.timings = dict(timings)
        self.onednn_rows = frozenset(m for m, (aten, dnn) in self.timings.items() if dnn < aten)
        return self.onednn_rows
