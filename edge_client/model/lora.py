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


# Rows bound to BASE get no LoRA delta: the frozen base. Its version, -2, is no real version and
# differs from -1, which request records use for "never admitted".
BASE = AdapterWeights(-2, (), (), {"base": True})
LOCAL_VERSION = -3  # what a request names to get the edge's own adapter (`ShadowAdapter.publish_local`)


@dataclass
class ServingBinding:
    """Row ranges [start, end) of the flattened batch and the adapter version each range uses."""

    groups: list[tuple[int, int, AdapterWeights]]

    def apply(self, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, shape[-1])
        if len(self.groups) == 1 and self.groups[0][0] == 0 and self.groups[0][1] >= x2.shape[0]:
            w = self.groups[0][2]
            if w is BASE:
                return y
            return torch.addmm(y2, x2.to(w.a_t[i].dtype) @ w.a_t[i], w.b_t[i]).to(y.dtype).view(shape)
        out = y2.clone()
        for start, end, w in self.groups:
            if w is BASE:
                continue
            xs = x2[start:end].to(w.a_t[i].dtype)
            out[start:end] += (xs @ w.a_t[i] @ w.b_t[i]).to(y.dtype)
        return out.view(shape)


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
