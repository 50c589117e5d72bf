"""Unmerged LoRA over the frozen base: the layers only compute with the adapter each call binds.

PEFT keeps its active adapter and train/eval flag as state on the shared modules, so serving and
training on one `PeftModel` gives silently wrong outputs and gradients. Here a `LoRALinear` wraps
each target `nn.Linear` (or bitsandbytes linear) without touching it, and reads the adapter to
apply from a `ContextVar` that the caller binds around a forward pass:

* `ServingBinding`: immutable serving versions for contiguous row ranges of a flattened batch, so
  requests pinned to different versions share one forward pass;
* `TrainingBinding`: the trainable adapter (autograd, dropout).

No binding means the plain base model.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from torch import nn

from collm.common.adapter_io import peft_key

_BINDING: contextvars.ContextVar = contextvars.ContextVar("collm_lora_binding", default=None)


class LoRALinear(nn.Module):
    """A frozen base linear plus the LoRA delta of the currently bound adapter (if any)."""

    def __init__(self, base: nn.Module, index: int, path: str):
        super().__init__()
        self.base = base
        self.index = index  # position of this layer in every adapter's tensor lists
        self.path = path  # module path in the HF model, e.g. model.layers.0.self_attn.q_proj
        self.in_features = base.in_features
        self.out_features = base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        binding = _BINDING.get()
        if binding is None:
            return y
        return binding.apply(self.index, x, y)


@dataclass(frozen=True)
class AdapterWeights:
    """One immutable serving version: per layer A^T [in, r] and scaled B^T [r, out] in compute dtype."""

    version: int
    a_t: tuple[torch.Tensor, ...]
    b_t: tuple[torch.Tensor, ...]
    meta: dict = field(default_factory=dict, compare=False)
    _fused: dict = field(default_factory=dict, compare=False, repr=False)

    def fused(self, f) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This version's LoRA for a fused projection group `f` (`collm.edge_client.model.fused`):
        the members' A^T side by side [in, sum r] and their B^T block-diagonal [sum r, sum out];
        None if no member is a LoRA target. Built on first use, then kept with the version."""
        hit = self._fused.get(f.key, False)
        if hit is not False:
            return hit
        lora = [m for m in f.members if m.lora is not None]
        value = None
        if lora and self.a_t:
            with torch.no_grad():
                a = torch.cat([self.a_t[m.lora] for m in lora], dim=1)
                b = self.b_t[lora[0].lora].new_zeros(a.shape[1], f.out_features)
                r0 = 0
                for m in lora:
                    r = self.a_t[m.lora].shape[1]
                    b[r0:r0 + r, m.start:m.end] = self.b_t[m.lora]
                    r0 += r
            value = (a.to(f.weight.dtype), b.to(f.weight.dtype))  # cast once here, not per call
        self._fused[f.key] = value
        return value


# Rows bound to BASE get no LoRA delta: the frozen base. Its version, -2, is no real version and
# differs from -1, which request records use for "never admitted".
BASE = AdapterWeights(-2, (), (), {"base": True})
LOCAL_VERSION = -3  # what a request names to get the edge's own adapter (`ShadowAdapter.publish_local`)


@dataclass
class ServingBinding:
    """Row ranges [start, end) of the flattened batch and the adapter version each range uses."""

    groups: list[tuple[int, int, AdapterWeights]]
    _masks: dict = field(default_factory=dict, repr=False)  # fused path: per block width, this step's row mask

    def __post_init__(self):
        seen: dict[int, AdapterWeights] = {}
        for _, _, w in self.groups:
            if w is not None and w is not BASE:  # None: a runner over the plain base
                seen.setdefault(id(w), w)
        self.versions = tuple(seen.values())  # distinct LoRA versions in the batch, in first-row order
        g = self.groups
        self.single = (self.versions[0] if len(self.versions) == 1 and len(g) == 1 and g[0][0] == 0
                       else None)  # one version on every row (the usual step)

    def apply(self, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One LoRALinear's delta (HF's own forward: evaluation, the quantized fallback)."""
        shape = y.shape
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, shape[-1])
        if len(self.groups) == 1 and self.groups[0][0] == 0 and self.groups[0][1] >= x2.shape[0]:
            w = self.groups[0][2]
            if w is BASE or w is None:
                return y
            return torch.addmm(y2, x2.to(w.a_t[i].dtype) @ w.a_t[i], w.b_t[i]).to(y.dtype).view(shape)
        out = y2.clone()
        for start, end, w in self.groups:
            if w is BASE or w is None:
                continue
            xs = x2[start:end].to(w.a_t[i].dtype)
            out[start:end] += (xs @ w.a_t[i] @ w.b_t[i]).to(y.dtype)
        return out.view(shape)

    LOOP_ROWS = 64  # mixed versions with more rows than this (prefill chunks): one pass per version

    def apply_fused(self, f, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the fused base output of group f, updated in place) plus each row's own version's delta.

        One version on every row: y += (x @ A) @ B with the version's fused A and block-diagonal B
        (two calls). Several versions (or base rows among them) in a decode-sized batch: the
        versions' A side by side, one matmul, masked so each row keeps only its own version's
        columns (the other columns multiply by exact zeros), then one matmul per member with its
        versions' B stacked: the number of calls does not grow with the number of versions.
        Several versions over many rows (prefill): each version on its own rows, so no row pays
        for the others' adapters."""
        if not self.versions:
            return y
        shape = y.shape
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if self.single is not None and self.groups[0][1] >= rows:
            ab = self.single.fused(f)
            if ab is not None:
                a, b = ab
                y2.addmm_(x2 @ a, b)
            return y
        if rows > self.LOOP_ROWS:
            for start, end, w in self.groups:
                if w is None or w is BASE:
                    continue
                ab = w.fused(f)
                if ab is not None:
                    a, b = ab
                    y2[start:end].addmm_(x2[start:end] @ a, b)
            return y
        st = f.stacked(self.versions)
        if st is None:
            return y
        a, bs, r = st
        V = len(self.versions)
        xa = (x2 @ a).mul_(self._mask(rows, len(bs), r, a.dtype))
        w_ = V * r
        for k, (mb, b) in enumerate(bs):
            y2[:, mb.start:mb.end].addmm_(xa[:, k * w_:(k + 1) * w_], b)
        return y

    def _mask(self, rows: int, members: int, r: int, dtype) -> torch.Tensor:
        """[rows, members * V * r] for member-major stacked columns: 1 where the column's version is
        the row's, else 0 (base rows: all 0)."""
        key = (rows, members, r, dtype)
        m = self._masks.get(key)
        if m is None:
            V = len(self.versions)
            dev = self.versions[0].a_t[0].device
            row_block = torch.full((rows,), -1, dtype=torch.long)
            index = {id(w): i for i, w in enumerate(self.versions)}
            for start, end, w in self.groups:
                if id(w) in index:
                    row_block[start:end] = index[id(w)]
            cols = (torch.arange(members * V * r) // r) % V
            m = (cols[None, :] == row_block[:, None]).to(device=dev, dtype=dtype)
            self._masks[key] = m
        return m


@dataclass
class TrainingBinding:
    """The trainable adapter, applied with autograd (and dropout on the LoRA input)."""

    adapter: TrainableAdapter
    dropout: float = 0.0

    def apply(self, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = self.adapter.a[i], self.adapter.b[i]
        xs = x.to(a.dtype)
        if self.dropout and torch.is_grad_enabled():
            xs = nn.functional.dropout(xs, self.dropout, training=True)
        return y + ((xs @ a.t()) @ b.t() * self.adapter.scaling).to(y.dtype)


def current_binding():
    """The binding of the enclosing `bind` (None: the plain base)."""
    return _BINDING.get()


@contextlib.contextmanager
def bind(binding):
    """Apply `binding` to every LoRALinear during the enclosed forward (and nothing else)."""
    token = _BINDING.set(binding)
    try:
        yield
    finally:
        _BINDING.reset(token)


class LoRALayers:
    """The LoRALinear layers injected into one base model, in a fixed order."""

    def __init__(self, layers: list[LoRALinear], r: int, alpha: float):
        self.layers = layers
        self.r = r
        self.scaling = alpha / r

    @property
    def paths(self) -> list[str]:
        return [m.path for m in self.layers]

    def expected_shapes(self) -> dict[str, tuple[int, int]]:
        """PEFT key -> shape, for validating adapters that come from outside."""
        out = {}
        for m in self.layers:
            out[peft_key(m.path, "A")] = (self.r, m.in_features)
            out[peft_key(m.path, "B")] = (m.out_features, self.r)
        return out

    def serving_weights(self, state: dict[str, torch.Tensor], version: int, device, dtype,
                        meta: dict | None = None) -> AdapterWeights:
        """Copy a PEFT state dict into a new immutable serving version (off the serving path)."""
        a_t, b_t = [], []
        with torch.no_grad():
            for m in self.layers:
                a = state[peft_key(m.path, "A")].to(device=device, dtype=torch.float32)
                b = state[peft_key(m.path, "B")].to(device=device, dtype=torch.float32)
                a_t.append(a.t().contiguous().to(dtype))
                b_t.append((b * self.scaling).t().contiguous().to(dtype))
        return AdapterWeights(version, tuple(a_t), tuple(b_t), dict(meta or {}))


def inject_lora(model: nn.Module, target_modules: list[str], r: int, alpha: float) -> LoRALayers:
    """Wrap every target linear of `model` in a LoRALinear (in place; base weights untouched).

    A model wrapped before (a second engine on the same loaded model) keeps its wrappers: they hold
    no adapter state, so they are simply reused."""
    existing = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    if existing:
        other = sorted({m.path.rsplit(".", 1)[-1] for m in existing} - set(target_modules))
        if other:
            raise ValueError(f"this model was already wrapped for LoRA on {other}, not in {target_modules}")
        return LoRALayers(existing, r, alpha)
    layers: list[LoRALinear] = []
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in target_modules and hasattr(child, "in_features") and not isinstance(child, LoRALinear):
                path = f"{parent_path}.{name}" if parent_path else name
                wrapped = LoRALinear(child, len(layers), path)
                setattr(parent, name, wrapped)
                layers.append(wrapped)
    if not layers:
        raise ValueError(f"no module named any of {target_modules} found for LoRA")
    return LoRALayers(layers, r, alpha)


class TrainableAdapter(nn.Module):
    """The training adapter's parameters (float32), initialised like PEFT: A Kaiming-uniform, B zero."""

    def __init__(self, layers: LoRALayers, device, seed: int = 0):
        super().__init__()
        self.paths = layers.paths
        self.scaling = layers.scaling
        g = torch.Generator().manual_seed(seed)
        a, b = [], []
        for m in layers.layers:
            bound = 1.0 / (m.in_features ** 0.5)
            a.append(nn.Parameter((torch.rand(layers.r, m.in_features, generator=g) * 2 - 1) * bound))
            b.append(nn.Parameter(torch.zeros(m.out_features, layers.r)))
        self.a = nn.ParameterList(a)
        self.b = nn.ParameterList(b)
        self.to(device)

    def state_dict_peft(self) -> dict[str, torch.Tensor]:
        """A detached float32 copy with PEFT keys."""
        out = {}
        with torch.no_grad():
            for path, a, b in zip(self.paths, self.a, self.b):
                out[peft_key(path, "A")] = a.detach().clone()
                out[peft_key(path, "B")] = b.detach().clone()
        return out

    def load_peft(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for path, a, b in zip(self.paths, self.a, self.b):
                a.copy_(state[peft_key(path, "A")].to(a.device, a.dtype))
                b.copy_(state[peft_key(path, "B")].to(b.device, b.dtype))
