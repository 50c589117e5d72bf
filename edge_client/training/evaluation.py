"""Held-out loss and token accuracy of one adapter version, forward units only (see `layerwise`)."""

from __future__ import annotations

import random

from collm.common.data import Example
from collm.edge_client.model.lora import AdapterWeights, ServingBinding
from collm.edge_client.training.jobs import PassJob
from collm.edge_client.training.layerwise import LayerwisePass, ModelParts
from collm.edge_client.training.trainer import collate, grouped_by_length


def by_length(examples: list[Example], batch_size: int, seed: int = 0) -> list[Example]:
    """The order an evaluation runs `examples` in: batches of similar lengths, in a fixed seeded order."""
    return grouped_by_length(examples, batch_size, random.Random(seed))


class EvalJob(PassJob):
    """Mean per-token holdout loss of `weights` (None: the base model), `batch_size` examples per pass.

    The examples are batched by length (a batch is padded to its longest; on the bench's Dolly halves 24-30%
    of a random batch of 4 is padding, benchmarks/padding.py) and the batches run in a fixed shuffled order, so an evaluation cut at
    its deadline has scored a random subset of batches, not the shortest. The loss, a sum over answer
    tokens divided by their count, does not depend on the order."""

    kind = "eval"

    def __init__(self, parts: ModelParts, weights: AdapterWeights | None, examples: list[Example], batch_size: int,
                 pad_id: int, device, deadline_s: float | None = None):
        super().__init__(deadline_s)
        self.parts = parts
        self.weights = weights
        self.examples = by_length(examples, batch_size)
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.device = device
        self.pos = 0
        self._loss_sum = 0.0
        self._correct = 0
        self.report.extra["version"] = None if weights is None else weights.version

    def new_pass(self) -> LayerwisePass:
        exs = self.examples[self.pos: self.pos + self.batch_size]
        ids, mask, labels = collate(exs, self.pad_id, self.device)
        binding = None if self.weights is None else ServingBinding([(0, ids.numel(), self.weights)])
        return LayerwisePass(self.parts, ids, mask, labels, binding)

    def completed(self, p: LayerwisePass) -> int:
        k = min(self.batch_size, len(self.examples) - self.pos)
        self.pos += k
        r = self.report
        self._loss_sum += p.loss_sum
        self._correct += p.correct
        r.add_microbatch(k, p.tokens, p.answer_tokens, self._loss_sum)
        r.accuracy = self._correct / max(r.answer_tokens, 1)
        return p.tokens

    def run_all(self) -> None:
        """Evaluate synchronously (outside an engine loop, e.g. the benchmark's quality judge)."""
        if self.started_at is None:
            self.start()
        while not self.done():
            self.run_unit()

    def done(self) -> bool:
        return self.pos >= len(self.examples)
