"""Projections that read the same input run as one matmul, their LoRA deltas as one or two more.

A Llama layer has seven LoRA targets, and unmerged LoRA called them one by one: 7 base matmuls
plus 14 small LoRA ones per layer and step (210 + 420 calls for SmolLM2). On a CPU, and at small
batch on a GPU, those calls and their passes over memory are the cost, not the math (a rank-8
delta is under 2% of the FLOPs). So the serving runner fuses q|k|v and gate|up:

* base: the member weights are concatenated into one [sum out, in] tensor, and each member
  module's weight becomes a view of its rows, so the model still holds one copy of the base and
  every other caller (training, evaluation, HF's own forward) computes exactly what it did;
* LoRA: per version, A of the members side by side ([in, sum r]) and B block-diagonal
  ([sum r, sum out]), built once per version (`AdapterWeights.fused`), so the delta is
  `addmm(y, x @ A, B)`: two calls per group instead of two per member;
* several versions in one batch: their A stacked side by side and their B on top of each other,
  one matmul each, with the rows' x @ A masked to their own version's block (exact: the other
  blocks contribute zeros). See `ServingBinding.apply_fused`.

Members that cannot be concatenated (a quantized base: bitsandbytes packs its weights), or all of
them with `engine.fuse_projections: false`, are called one by one, each with its own LoRA, as
before; the outputs are concatenated so the runner sees one path.

Memory: a base that was converted or de-quantized at load is owned memory, and fusing moves it
into the fused tensors (the originals are freed). A float32 safetensors base is memory-mapped
(page cache, shared between processes); fusing copies q|k|v and gate|up (about half of the base)
into owned memory, and the file pages they came from stay mapped until the kernel reclaims them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from collm.edge_client.model.lora import LoRALinear, ServingBinding, current_binding


@dataclass(frozen=True)
class Member:
    """One projection of a fused group: its LoRA layer index (None: not a LoRA target) and its columns."""

    lora: int | None
    start: int
    end: int


def _base(m: nn.Module) -> nn.Module:
    return m.base if isinstance(m, LoRALinear) else m


def _concatenable(bases: list[nn.Module]) -> bool:
    """Plain float linears on one device and dtype, with the same input, all with a bias or none."""
    if not all(type(b) is nn.Linear for b in bases):  # bitsandbytes' linears subclass nn.Linear
        return False
    w0 = bases[0].weight
    return (all(b.weight.dtype == w0.dtype and b.weight.device == w0.device and b.in_features == bases[0].in_features
                for b in bases) and w0.is_floating_point()
            and len({b.bias is None for b in bases}) == 1)


class FusedLinear:
    """`modules` (LoRALinear or plain linears reading the same input) as one projection whose output
    is theirs concatenated along the last dimension."""

    STACKS_KEPT = 4  # version sets whose stacked A/B are kept (sets change only around swaps)

    def __init__(self, modules: list[nn.Module], concatenate: bool = True, matmul=F.linear):
        self.modules = list(modules)
        self.matmul = matmul  # the base's x W^T + b: aten's, or the runner's `RowKernels` (by rows)
        bases = [_base(m) for m in self.modules]
        members, col = [], 0
        for m, b in zip(self.modules, bases):
            members.append(Member(m.index if isinstance(m, LoRALinear) else None, col, col + b.out_features))
            col += b.out_features
        self.members = tuple(members)
        self.out_features = col
        self.key = tuple((mb.lora, mb.start, mb.end) for mb in self.members)  # what a version's fused A/B depend on
        self.stacks: OrderedDict = OrderedDict()
        self.weight = self.bias = None
        if len(bases) == 1 and type(bases[0]) is nn.Linear:
            self.weight, self.bias = bases[0].weight, bases[0].bias
        elif len(bases) > 1 and concatenate and _concatenable(bases):
            self.weight, self.bias = self._concatenate(bases)

    @staticmethod
    def _concatenate(bases: list[nn.Module]):
        """One tensor holding the members' weights; each member's weight becomes a view of its rows.
        A second runner over the same model finds the first one's tensor (kept on the first member,
        checked against every member's weight) and reuses it."""
        kept = getattr(bases[0], "_collm_fused", None)
        if kept is not None:
            ids, weight, bias = kept
            if ids == tuple(id(b) for b in bases) and FusedLinear._views_of(weight, bases):
                return weight, bias
        with torch.no_grad():
            weight = torch.cat([b.weight.detach() for b in bases], dim=0)
            bias = torch.cat([b.bias.detach() for b in bases]) if bases[0].bias is not None else None
        start = 0
        for b in bases:
            n = b.out_features
            b.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
            if bias is not None:
                b.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
            start += n
        bases[0]._collm_fused = (tuple(id(b) for b in bases), weight, bias)
        return weight, bias

    @staticmethod
    def _views_of(weight: torch.Tensor, bases: list[nn.Module]) -> bool:
        start, row = 0, weight.stride(0) * weight.element_size()
        for b in bases:
            if b.weight.data_ptr() != weight.data_ptr() + start * row:
                return False
            start += b.out_features
        return True

    @property
    def concatenated(self) -> bool:
        return self.weight is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # not concatenable: each member with its own LoRA, as before
            if len(self.modules) == 1:
                return self.modules[0](x)
            return torch.cat([m(x) for m in self.modules], dim=-1)
        y = self.matmul(x, self.weight, self.bias)
        binding: ServingBinding | None = current_binding()  # the runner serves: only serving bindings
        return y if binding is None else binding.apply_fused(self, x, y)

    def stacked(self, versions: tuple):
        """`versions`' LoRA laid out member-major for a mixed batch (None: no LoRA on this group):
        A [in, members * V * r] (member 1's A of every version, then member 2's, ...) and per LoRA
        member its B of every version stacked, [V * r, its columns]; and r."""
        k = tuple(id(w) for w in versions)
        hit = self.stacks.get(k)
        if hit is not None:
            self.stacks.move_to_end(k)
            return hit[1]
        lora = [m for m in self.members if m.lora is not None]
        value = None
        if lora:
            with torch.no_grad():
                dt = self.weight.dtype  # cast once here, not per call on the serving path
                a = torch.cat([w.a_t[m.lora] for m in lora for w in versions], dim=1).to(dt)
                bs = tuple((m, torch.cat([w.b_t[m.lora] for w in versions], dim=0).to(dt)) for m in lora)
            value = (a, bs, versions[0].a_t[lora[0].lora].shape[1])
        self.stacks[k] = (versions, value)  # the versions themselves keep their ids from being reused
        while len(self.stacks) > self.STACKS_KEPT:
            self.stacks.popitem(last=False)
        return value
