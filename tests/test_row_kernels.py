"""The serving matmul for few rows: oneDNN's kernel where it was timed faster, aten's otherwise, the same result."""

import torch
import torch.nn.functional as F

from collm.edge_client.engine.warmup import time_row_kernels
from collm.edge_client.model.row_kernels import MAX_ROWS, RowKernels, onednn_usable
from collm.edge_client.model.sampling import SamplingParams

from helpers import prompt, tiny_engine


def _weight(out_f: int = 96, in_f: int = 64, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)


def test_every_row_count_computes_what_atens_linear_computes():
    w, b = _weight(), torch.randn(96, generator=torch.Generator().manual_seed(2))
    k = RowKernels()
    k.choose(time_row_kernels([w], reps=2))
    forced = RowKernels()
    forced.onednn_rows = frozenset(range(1, 2 * MAX_ROWS))  # oneDNN for every row count, even past MAX_ROWS
    g = torch.Generator().manual_seed(3)
    for m in range(1, 2 * MAX_ROWS):
        x = torch.randn(m, 64, generator=g)
        for kernels in (k, forced):
            torch.testing.assert_close(kernels(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(kernels(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)


def test_the_choice_keeps_onednn_only_for_the_row_counts_it_timed_faster():
    k = RowKernels()
    assert k.choose({1: (2.0, 1.0), 2: (1.0, 2.0), 3: (3.0, 1.5), 4: (1.0, 1.0)}) == frozenset({1, 3})
    assert k.onednn_rows == {1, 3}  # a tie stays on aten's
    timings = time_row_kernels([_weight(), _weight(64, 96)], max_rows=5, reps=2)
    assert sorted(timings) == [1, 2, 3, 4, 5] and all(a > 0 and d > 0 for a, d in timings.values())
    assert k.choose({}) == frozenset() and k.timings == {}


def test_weights_onednn_cannot_take_keep_atens_kernel_exactly():
    for w in (_weight(dtype=torch.float64), _weight(dtype=torch.bfloat16), _weight().t()):  # the last: not contiguous
        assert not onednn_usable(w)
        k = RowKernels()
        timings = time_row_kernels([w], reps=1)
        assert timings == {} and k.choose(timings) == frozenset()
        x = torch.randn(3, w.shape[1], dtype=w.dtype)
        assert torch.equal(k(x, w), F.linear(x, w))


def test_the_engine_picks_its_kernels_at_warmup_and_serves_the_same_tokens_either_way():
    on = tiny_engine(start=False)
    off = tiny_engine(start=False, engine={"row_kernels": False})
    try:
        on.start()
        off.start()
        kernels = on.runner.kernels
        assert sorted(kernels.timings) == list(range(1, MAX_ROWS + 1))  # calibrated at warm-up
        assert off.runner.kernels.timings == {} and off.runner.kernels.onednn_rows == frozenset()
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        ids = prompt(on, "Name three colours.")
        kernels.onednn_rows = frozenset(range(1, MAX_ROWS + 1))  # oneDNN for every decode step
        a = on.generate(ids, params)
        kernels.onednn_rows = frozenset()  # aten's for every step, as with row_kernels: false
        b = on.generate(ids, params)
        assert len(a.token_ids) == 12 and a.token_ids == b.token_ids  # they differ in rounding, not in result
    finally:
        on.stop()
        off.stop()
