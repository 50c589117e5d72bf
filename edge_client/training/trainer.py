"""Local LoRA training on the serving model's base, one unit of one micro-batch at a time.

The engine decides *when* a unit runs (`engine.co_schedule`); this module decides *what* the
training step computes, and it exists only here: a micro-batch is a `LayerwisePass` (forward and
backward cut into layer units, exact gradients), its gradients are summed over
`grad_accum_steps` micro-batches, divided by the answer tokens, clipped and applied by AdamW.
FedProx adds `mu * (w - w_global)` to each gradient before the optimizer step. With `freeze_a`
(FFA-LoRA, the server's `lora_aggregation: ffa`) only the B matrices take steps: A stays at the
global's (every edge's identical seeded A), so the server's average of the B's is the exact
average of the products B·A. Warm-up times the
same pass (`LocalTrainer.measure`), so there is no second copy of the step to drift apart.

Carry between rounds (`training.carry_between_rounds`): a round's update is sent at its deadline,
and the next round's global comes one evaluation and three message exchanges later (20-30 s on a
serving replica, as long as the training window). So after a round's job the engine keeps
training as its co-execution rule allows (`LocalTrainer.carry`), from the update just sent (`base`),
up to `carry_budget_rounds` times the last round's token budget. The next round's job rebases
that work onto the new global,

    w  <-  w_global + (w_carry - base)

keeps the optimizer state, and counts the carried micro-batches as its own: the work is sent in
the next update, not thrown away. Its gradients were taken at the old weights, a staleness of
one round (more if the edge sits rounds out), as in asynchronous federated training (FedBuff).
"""

from __future__ import annotations

import random

import torch

from collm.common.data import Example
from collm.edge_client.config import TrainingConfig
from collm.edge_client.model.lora import LoRALayers, TrainableAdapter, TrainingBinding
from collm.edge_client.training.jobs import JobReport, PassJob, TrainBudget
from collm.edge_client.training.layerwise import LayerwisePass, ModelParts, Unit, layer_params_of, timed_units


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


def grouped_by_length(examples: list[Example], k: int, rng: random.Random) -> list[Example]:
    """`examples` sorted by length, cut into groups of `k` (neighbours in length, so a batch of them is
    little padding), the full groups in `rng`'s order and a short group last, so that consecutive takes of
    `k` never straddle two groups. Training's stream and evaluation's batches both use it."""
    ranked = sorted(examples, key=lambda e: len(e.input_ids))
    full = len(ranked) - len(ranked) % k
    groups = [ranked[i: i + k] for i in range(0, full, k)]
    rng.shuffle(groups)
    return [e for g in groups for e in g] + ranked[full:]


class ExampleStream:
    """Endless shuffled pass over the training examples (reshuffled each epoch, seeded), `k` at a time.

    With `group` > 0 each epoch's order is cut into windows of `group * k` examples, each window sorted by
    length and cut into groups of `k`, and the groups shuffled again: a micro-batch's sequences have
    similar lengths, so little of it is padding, and which examples meet in a window is still random
    (Hugging Face's `LengthGroupedSampler` does the same with "megabatches"). Takes are `k` at a time, so
    a group never straddles two micro-batches. An epoch's leftover opens the next epoch's first micro-batch
    (`_leftover_batch`)."""

    def __init__(self, examples: list[Example], seed: int = 0, *, k: int = 1, group: int = 0):
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        self.rng = random.Random(seed)
        self.k = k
        self.group = group
        self.buffer: list[Example] = []

    def _refill(self) -> None:
        order = list(self.examples)
        self.rng.shuffle(order)
        lead, order = self._leftover_batch(order)
        if self.group > 0 and self.k > 1:  # only the last window can end in a short group: the next epoch's leftover
            w = self.group * self.k
            order = [e for i in range(0, len(order), w) for e in grouped_by_length(order[i: i + w], self.k, self.rng)]
        self.buffer = lead + order

    def _leftover_batch(self, order: list[Example]) -> tuple[list[Example], list[Example]]:
        """(the next epoch's first micro-batch, the rest of `order`). An epoch's leftover (fewer than k examples)
        opens the next epoch's first micro-batch, completed by the first examples of `order` that are not its
        own copies: grouped by length, an example and its copy would be neighbours, one micro-batch."""
        if not self.buffer:
            return [], order
        held = {id(e) for e in self.buffer}
        need = self.k - len(self.buffer)
        fill: list[Example] = []
        rest: list[Example] = []
        for e in order:
            (fill if len(fill) < need and id(e) not in held else rest).append(e)
        return self.buffer + fill, rest

    def peek(self, k: int) -> list[Example]:
        while len(self.buffer) < k:
            self._refill()
        return self.buffer[:k]

    def take(self, k: int) -> list[Example]:
        out = self.peek(k)
        del self.buffer[:k]
        return out


class LocalTrainer:
    """The training adapter, its optimizer, and the edge's training examples."""

    def __init__(self, parts: ModelParts, layers: LoRALayers, adapter: TrainableAdapter, cfg: TrainingConfig,
                 examples: list[Example], pad_id: int, dropout: float = 0.0, seed: int = 0):
        self.parts = parts
        self.adapter = adapter
        self.layer_params = layer_params_of(adapter, layers, len(self.parts.layers))
        self.cfg = cfg
        self.stream = ExampleStream(examples, seed, k=cfg.micro_batch_size, group=cfg.group_by_length)
        self.pad_id = pad_id
        self.dropout = dropout
        self.optimizer = self._new_optimizer()
        self.total_steps = 0
        self.total_tokens = 0
        self.last_loss: float | None = None
        self.on_step = None  # called with total_steps after every optimizer step (the engine publishes `:local`)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.adapter.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    @property
    def sequences_per_step(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum_steps

    def new_pass(self, examples: list[Example]) -> LayerwisePass:
        """The training step's forward and backward over `examples`, as units."""
        ids, mask, labels = collate(examples, self.pad_id, self.adapter.a[0].device)
        return LayerwisePass(self.parts, ids, mask, labels, TrainingBinding(self.adapter, self.dropout),
                             self.layer_params)

    def measure(self) -> list[tuple[Unit, float]]:
        """Run one micro-batch pass and time each unit; the gradients are dropped, nothing changes."""
        return timed_units(self.new_pass(self.stream.peek(self.cfg.micro_batch_size)))

    def job(self, budget: TrainBudget, global_state: dict | None = None, proximal_mu: float = 0.0,
            lr: float | None = None, serve_local: bool = True, carry_after: bool = False,
            freeze_a: bool = False, rebase=None) -> TrainJob:
        job = TrainJob(self, budget, global_state, proximal_mu, lr)
        job.rebase = rebase  # how a carry absorbed at the start is put on the new global (None: factor-wise)
        job.freeze_a = freeze_a  # FFA-LoRA: only B is trained (see the module docstring)
        job.serve_local = serve_local  # False: this job's steps are not served as `:local` (e.g. a refused global)
        job.carry_after = carry_after  # True: the engine starts `carry(job)` when it ends
        return job

    def carry(self, after: TrainJob) -> TrainJob:
        """Training after `after` (a finished round job) until the next round's job absorbs it: from
        the update `after` sent, up to `carry_budget_rounds` times `after`'s token budget, with no
        deadline (see the docstring)."""
        cap = max(1, round((after.budget.tokens or self.cfg.default_round_tokens) * self.cfg.carry_budget_rounds))
        job = TrainJob(self, TrainBudget(tokens=cap), None, after.mu, after.lr)
        job.serve_local = after.serve_local
        job.freeze_a = after.freeze_a
        job.base = after.report.adapter_state
        job.is_carry = True
        return job


class TrainJob(PassJob):
    kind = "train"

    def __init__(self, trainer: LocalTrainer, budget: TrainBudget, global_state: dict | None,
                 proximal_mu: float, lr: float | None):
        super().__init__(budget.deadline_s, trainer.cfg.finish_grace)
        self.t = trainer
        self.budget = budget
        self.global_state = global_state
        self.mu = proximal_mu
        self.lr = lr
        self._anchor: list[torch.Tensor] | None = None
        self.serve_local = True
        self.freeze_a = False
        self._grads: dict[int, torch.Tensor] = {}
        self._acc_seqs = 0
        self._acc_tokens = 0
        self._loss_sum = 0.0
        self.is_carry = False
        self.carry_after = False  # the engine's core starts `make_carry()` when it ends
        self.base: dict | None = None  # a carry job: the adapter it started from (the update sent)
        self.carried: TrainJob | None = None  # the carry job this round's job absorbs when it starts
        self.rebase = None  # (global, now, base) -> the start with the carry's work on the new global; None: factor-wise

    def absorb(self, carry: TrainJob) -> None:
        self.carried = carry

    def make_carry(self) -> TrainJob:
        return self.t.carry(self)

    def start(self, now: float | None = None) -> None:
        super().start(now)
        t = self.t
        if self.is_carry and t.cfg.reset_optimizer_each_round:
            t.optimizer = t._new_optimizer()  # the carry is the next round's start
        c, self.carried = self.carried, None
        if c is not None and c.report.microbatches > 0:
            self._absorb_carry(c)
        else:
            if c is not None:
                c._pass = None  # its micro-batch in flight, dropped: activations and graph are not kept all round
            if self.global_state is not None:
                t.adapter.load_peft(self.global_state)
                if t.cfg.reset_optimizer_each_round:
                    t.optimizer = t._new_optimizer()
        if self.lr is not None:
            for g in t.optimizer.param_groups:
                g["lr"] = self.lr
        if self.mu > 0 and self._anchor is None:
            self._anchor = [p.detach().clone() for p in t.adapter.parameters()]
        t.optimizer.zero_grad(set_to_none=True)

    def _absorb_carry(self, c: TrainJob) -> None:
        """Rebase the carry's work onto this round's global and count its micro-batches as this job's."""
        t, r, cr = self.t, self.report, c.report
        c.finish()  # its accumulated gradients take their step; a half-done micro-batch is dropped
        if self.global_state is not None and c.base is not None:
            now = t.adapter.state_dict_peft()
            t.adapter.load_peft(self.global_state)
            if self.mu > 0:  # FedProx pulls toward the global, not toward the rebased start
                self._anchor = [p.detach().clone() for p in t.adapter.parameters()]
            if self.rebase is not None:  # e.g. mixed ranks: the factors are in different bases
                t.adapter.load_peft(self.rebase(self.global_state, now, c.base))
                if t.cfg.reset_optimizer_each_round:  # the carry's moments were for the factors it had
                    t.optimizer = t._new_optimizer()
            else:
                t.adapter.load_peft({k: self.global_state[k].to(v.device, v.dtype) + (v - c.base[k].to(v.device, v.dtype))
                                     for k, v in now.items()})
        for k in ("microbatches", "sequences", "tokens", "answer_tokens", "steps", "compute_seconds", "units",
                  "deferrals"):
            setattr(r, k, getattr(r, k) + getattr(cr, k))
        r.first_loss, r.last_loss, r.loss = cr.first_loss, cr.last_loss, cr.loss
        self._loss_sum = c._loss_sum
        r.extra["carried_tokens"] = cr.tokens
        r.extra["carried_seconds"] = round(cr.seconds, 3)

    def new_pass(self) -> LayerwisePass:
        return self.t.new_pass(self.t.stream.peek(self.t.cfg.micro_batch_size))

    def completed(self, p: LayerwisePass) -> int:
        """A micro-batch completed: keep its gradients, count it, maybe take an optimizer step."""
        t, r = self.t, self.report
        k = self.t.cfg.micro_batch_size
        t.stream.take(k)  # consumed only now that the micro-batch completed
        for key, g in p.grads.items():
            self._grads[key] = g if key not in self._grads else self._grads[key] + g
        mb_loss = p.loss_sum / max(p.answer_tokens, 1)
        r.first_loss = mb_loss if r.first_loss is None else r.first_loss
        r.last_loss = t.last_loss = mb_loss
        self._loss_sum += p.loss_sum
        r.add_microbatch(k, p.tokens, p.answer_tokens, self._loss_sum)
        t.total_tokens += p.tokens
        self._acc_seqs += k
        self._acc_tokens += p.answer_tokens
        if self._acc_seqs >= t.sequences_per_step:
            self._optimizer_step()
        return p.tokens

    def _optimizer_step(self) -> None:
        t = self.t
        if self._acc_tokens == 0:
            self._acc_seqs = 0
            self._grads.clear()
            return
        params = list(t.adapter.parameters())
        frozen = {id(a) for a in t.adapter.a} if self.freeze_a else set()
        for i, p in enumerate(params):
            g = self._grads.get(id(p))
            if g is None or id(p) in frozen:  # no grad: AdamW leaves it (and its weight decay) alone
                continue
            p.grad = g / self._acc_tokens
            if self._anchor is not None:
                p.grad.add_(p.detach() - self._anchor[i], alpha=self.mu)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.total_steps += 1
        self.report.steps += 1
        if t.on_step is not None and self.serve_local:
            t.on_step(t.total_steps)
        self._grads.clear()
        self._acc_seqs = self._acc_tokens = 0

    def done(self) -> bool:
        b, r = self.budget, self.report
        return (b.steps is not None and r.steps >= b.steps) or (b.tokens is not None and r.tokens >= b.tokens)

    def finish(self, deadline_hit: bool = False, now: float | None = None) -> JobReport:
        self._pass = None  # a micro-batch cut short (past the deadline's grace, or at shutdown) teaches nothing
        if self._acc_seqs:  # use the gradients of the micro-batches that completed
            self._optimizer_step()
        self.report.extra["lr"] = self.t.optimizer.param_groups[0]["lr"]
        self.report.adapter_state = self.t.adapter.state_dict_peft()  # taken on the engine thread: the update
        return super().finish(deadline_hit, now)
