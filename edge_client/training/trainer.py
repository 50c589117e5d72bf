"""Local LoRA training and evaluation, one micro-batch at a time, on the serving model's base.

The engine decides *when* a micro-batch runs (inside the SLO slack, see `co_scheduler`); this
module decides *what* it computes. Gradient accumulation counts sequences, not micro-batches, so
the engine may pick smaller micro-batches when slack is short without changing the optimizer's
effective batch (`micro_batch_size * grad_accum_steps` sequences per step, loss averaged per token).
FedProx adds `mu * (w - w_global)` to each gradient before the optimizer step.
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from collm.edge_client.config import TrainingConfig
from collm.common.data import Example

from collm.edge_client.model.lora import AdapterWeights, ServingBinding, TrainableAdapter, TrainingBinding, bind


def collate(examples: list[Example], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) for a list of examples."""
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        mask[i, : len(e.input_ids)] = 1
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
    return ids.to(device), mask.to(device), labels.to(device)


def token_loss(model, ids, mask, labels) -> tuple[torch.Tensor, int, int]:
    """(sum of next-token losses over answer tokens, answer tokens, correctly predicted tokens)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum")
    valid = target != -100
    correct = int(((logits.argmax(-1) == target) & valid).sum())
    return loss, int(valid.sum()), correct


class ExampleStream:
    """Endless shuffled pass over the training examples (reshuffled each epoch, seeded)."""

    def __init__(self, examples: list[Example], seed: int = 0):
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        self.rng = random.Random(seed)
        self.buffer: list[Example] = []

    def peek(self, k: int) -> list[Example]:
        while len(self.buffer) < k:
            order = list(self.examples)
            self.rng.shuffle(order)
            self.buffer.extend(order)
        return self.buffer[:k]

    def take(self, k: int) -> list[Example]:
        out = self.peek(k)
        del self.buffer[:k]
        return out


@dataclass
class TrainBudget:
    steps: int | None = None  # optimizer steps
    tokens: int | None = None  # input tokens processed
    deadline_s: float | None = None  # seconds from the job's start

    def __post_init__(self):
        if self.steps is None and self.tokens is None:
            raise ValueError("a training budget needs steps or tokens")


@dataclass
class JobReport:
    kind: str
    microbatches: int = 0
    sequences: int = 0
    tokens: int = 0
    answer_tokens: int = 0
    steps: int = 0
    loss: float | None = None  # mean per-token loss over the job
    first_loss: float | None = None
    last_loss: float | None = None
    accuracy: float | None = None
    seconds: float = 0.0
    compute_seconds: float = 0.0
    deferrals: int = 0  # times the engine held the job back to keep an SLO
    deadline_hit: bool = False
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Option:
    """One way to run the next micro-batch: `k` sequences, each cut to `cap` tokens (None: whole)."""

    k: int
    cap: int | None
    tokens: int


class BackgroundJob:
    """Work the engine runs in SLO slack, one micro-batch per `run(option)` call.

    `run` may raise `Preempted` (see `preemption`); the job must then be unchanged, so the same
    micro-batch can run again later.
    """

    kind = "job"

    def __init__(self, deadline_s: float | None):
        self.future: Future = Future()
        self.report = JobReport(self.kind)
        self.started_at: float | None = None
        self.deadline_s = deadline_s

    def start(self) -> None:
        self.started_at = time.perf_counter()

    def past_deadline(self, now: float) -> bool:
        return self.deadline_s is not None and self.started_at is not None and now - self.started_at >= self.deadline_s

    def options(self) -> list[Option]:
        """Ways to run the next micro-batch, most preferred (largest) first."""
        raise NotImplementedError

    def run(self, option: Option) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def finish(self, deadline_hit: bool = False) -> JobReport:
        self.report.deadline_hit = deadline_hit
        if self.started_at is not None:
            self.report.seconds = time.perf_counter() - self.started_at
        if not self.future.done():
            self.future.set_result(self.report)
        return self.report

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def _batch_options(examples: list[Example], max_k: int, truncate_to: tuple[int, ...] = ()) -> list[Option]:
    out = []
    for k in range(min(max_k, len(examples)), 0, -1):
        out.append(Option(k, None, k * max(len(e.input_ids) for e in examples[:k])))
    if examples:
        full = len(examples[0].input_ids)
        out += [Option(1, cap, cap) for cap in truncate_to if cap < full]
    return out


def _cut(examples: list[Example], cap: int | None) -> list[Example]:
    return examples if cap is None else [Example(e.input_ids[:cap], e.labels[:cap]) for e in examples]


class LocalTrainer:
    """The training adapter, its optimizer, and the edge's training examples."""

    def __init__(self, model, adapter: TrainableAdapter, cfg: TrainingConfig, examples: list[Example],
                 pad_id: int, dropout: float = 0.0, seed: int = 0):
        self.model = model
        self.adapter = adapter
        self.cfg = cfg
        self.stream = ExampleStream(examples, seed)
        self.pad_id = pad_id
        self.dropout = dropout
        self.optimizer = self._new_optimizer()
        self.total_steps = 0
        self.total_tokens = 0
        self.last_loss: float | None = None

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.adapter.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    @property
    def sequences_per_step(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum_steps

    def job(self, budget: TrainBudget, global_state: dict | None = None, proximal_mu: float = 0.0,
            lr: float | None = None) -> TrainJob:
        return TrainJob(self, budget, global_state, proximal_mu, lr)


class TrainJob(BackgroundJob):
    kind = "train"

    def __init__(self, trainer: LocalTrainer, budget: TrainBudget, global_state: dict | None,
                 proximal_mu: float, lr: float | None):
        super().__init__(budget.deadline_s)
        self.t = trainer
        self.budget = budget
        self.global_state = global_state
        self.mu = proximal_mu
        self.lr = lr
        self._anchor: list[torch.Tensor] | None = None
        self._acc_seqs = 0
        self._acc_tokens = 0
        self._loss_sum = 0.0

    def start(self) -> None:
        super().start()
        t = self.t
        if self.global_state is not None:
            t.adapter.load_peft(self.global_state)
            if t.cfg.reset_optimizer_each_round:
                t.optimizer = t._new_optimizer()
        if self.lr is not None:
            for g in t.optimizer.param_groups:
                g["lr"] = self.lr
        if self.mu > 0:
            self._anchor = [p.detach().clone() for p in t.adapter.parameters()]
        t.optimizer.zero_grad(set_to_none=True)

    def options(self) -> list[Option]:
        L = self.t.cfg.max_seq_len
        # Short on slack, one sequence cut shorter still teaches the start of its answer.
        return _batch_options(self.t.stream.peek(self.t.cfg.micro_batch_size), self.t.cfg.micro_batch_size,
                              tuple(c for c in (L // 2, L // 4) if c >= 32))

    def run(self, option: Option) -> None:
        t, r = self.t, self.report
        exs = _cut(t.stream.peek(option.k), option.cap)
        ids, mask, labels = collate(exs, t.pad_id, t.adapter.a[0].device)
        params = list(t.adapter.parameters())
        with bind(TrainingBinding(t.adapter, t.dropout)):
            loss_sum, n_ans, _ = token_loss(t.model, ids, mask, labels)
            # autograd.grad, not backward(): a preempted pass must leave no partial gradients
            grads = torch.autograd.grad(loss_sum, params, allow_unused=True) if n_ans else [None] * len(params)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        t.stream.take(option.k)  # consumed only now that the micro-batch completed
        k = option.k
        mb_loss = loss_sum.item() / max(n_ans, 1)
        r.first_loss = mb_loss if r.first_loss is None else r.first_loss
        r.last_loss = t.last_loss = mb_loss
        self._loss_sum += loss_sum.item()
        r.microbatches += 1
        r.sequences += k
        r.tokens += int(mask.sum())
        r.answer_tokens += n_ans
        r.loss = self._loss_sum / max(r.answer_tokens, 1)
        t.total_tokens += int(mask.sum())
        self._acc_seqs += k
        self._acc_tokens += n_ans
        if self._acc_seqs >= t.sequences_per_step:
            self._optimizer_step()

    def _optimizer_step(self) -> None:
        t = self.t
        if self._acc_tokens == 0:
            self._acc_seqs = 0
            return
        params = list(t.adapter.parameters())
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            p.grad.div_(self._acc_tokens)
            if self._anchor is not None:
                p.grad.add_(p.detach() - self._anchor[i], alpha=self.mu)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.total_steps += 1
        self.report.steps += 1
        self._acc_seqs = self._acc_tokens = 0

    def done(self) -> bool:
        b, r = self.budget, self.report
        return (b.steps is not None and r.steps >= b.steps) or (b.tokens is not None and r.tokens >= b.tokens)

    def finish(self, deadline_hit: bool = False) -> JobReport:
        if self._acc_seqs:  # use the gradients already computed
            self._optimizer_step()
        self.report.extra["lr"] = self.t.optimizer.param_groups[0]["lr"]
        return super().finish(deadline_hit)


class EvalJob(BackgroundJob):
    """Held-out loss and token accuracy of one adapter version, forward passes only."""

    kind = "eval"

    def __init__(self, model, weights: AdapterWeights | None, examples: list[Example], batch_size: int,
                 pad_id: int, device, deadline_s: float | None = None):
        super().__init__(deadline_s)
        self.model = model
        self.weights = weights
        self.examples = examples
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.device = device
        self.pos = 0
        self._loss_sum = 0.0
        self._correct = 0
        self.report.extra["version"] = None if weights is None else weights.version

    def options(self) -> list[Option]:
        return _batch_options(self.examples[self.pos: self.pos + self.batch_size], self.batch_size)

    @torch.inference_mode()
    def run(self, option: Option) -> None:
        k = option.k
        exs = self.examples[self.pos: self.pos + k]
        ids, mask, labels = collate(exs, self.pad_id, self.device)
        binding = None if self.weights is None else ServingBinding([(0, ids.numel(), self.weights)])
        with bind(binding):
            loss_sum, n_ans, correct = token_loss(self.model, ids, mask, labels)
        self.pos += k
        r = self.report
        self._loss_sum += loss_sum.item()
        self._correct += correct
        r.microbatches += 1
        r.sequences += k
        r.tokens += int(mask.sum())
        r.answer_tokens += n_ans
        r.loss = self._loss_sum / max(r.answer_tokens, 1)
        r.accuracy = self._correct / max(r.answer_tokens, 1)

    def done(self) -> bool:
        return self.pos >= len(self.examples)


def perplexity(loss: float | None) -> float | None:
    return None if loss is None else math.exp(min(loss, 50.0))
