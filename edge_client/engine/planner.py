"""What one engine step computes, as pure functions over the running requests (no torch, no threads).

A step is one decode token per decoding request, then prefill chunks, oldest request first, up to
the step token budget B, so a long prompt never stalls running decodes (Sarathi-Serve's order).
Segments are sorted by adapter version, so each version's rows are contiguous in the step's
flattened batch (the runner applies one LoRA per row range).
"""

from __future__ import annotations

from dataclasses import dataclass

from collm.edge_client.model.runner import Segment


@dataclass(frozen=True)
class StepShape:
    """The step's cost features: decoding sequences, prefill tokens and KV tokens attended."""

    decode: int
    prefill: int
    attended: int


def plan_step(running: list, budget: int) -> list[Segment]:
    """The segments of the next step for `running` requests (objects with `prompt_ids`, `prefilled`,
    `out_ids`, `slot`, `adapter`), at most `budget` tokens."""
    segs = []
    for r in running:  # decodes first: one token each
        if r.prefilled == len(r.prompt_ids):
            pos = len(r.prompt_ids) + len(r.out_ids) - 1
            segs.append(Segment(r.slot, pos, [r.out_ids[-1]], r.adapter, True))
            budget -= 1
    for r in running:  # then prefill chunks, oldest request first
        left = len(r.prompt_ids) - r.prefilled
        if left and budget > 0:
            n = min(left, budget)
            segs.append(Segment(r.slot, r.prefilled, r.prompt_ids[r.prefilled:r.prefilled + n], r.adapter,
                                r.prefilled + n == len(r.prompt_ids)))
            budget -= n
    segs.sort(key=lambda s: s.adapter.version)  # contiguous rows per adapter version
    return segs


def step_shape(segments: list[Segment], prefilling: set[int]) -> StepShape:
    """Cost features of a planned step; `prefilling`: slots whose segment is a prefill chunk (a
    1-token last chunk looks like a decode but is not one)."""
    decode = sum(1 for s in segments if s.slot not in prefilling)
    prefill = sum(len(s.tokens) for s in segments) - decode
    return StepShape(decode, prefill, sum(s.start + len(s.tokens) for s in segments))


def next_step_shape(running: list, budget: int) -> StepShape:
    """The shape of the step `running` would take next (for predicting it before it runs)."""
    decoding = sum(1 for r in running if r.prefilled == len(r.prompt_ids))
    prefill = min(sum(len(r.prompt_ids) - r.prefilled for r in running), max(0, budget - decoding))
    return StepShape(decoding, prefill, sum(len(r.prompt_ids) + len(r.out_ids) for r in running))


def prefill_time(prompt_tokens: int, budget: int, step_time) -> float:
    """Predicted seconds to prefill a prompt alone: its chunks of at most `budget` tokens, each a step
    of `step_time(decode, prefill, attended)` (the engine's shed-late test, and the simulator's)."""
    chunk = min(prompt_tokens, budget)
    return -(-prompt_tokens // budget) * step_time(0, chunk, chunk)


def too_late(now: float, arrival: float, prefill_s: float, ttft_slo_s: float) -> bool:
    """A waiting request that cannot get its first token within its TTFT target any more
    (`engine.shed_late`): the wait so far plus its own prefill is past the target."""
    return now - arrival + prefill_s > ttft_slo_s
