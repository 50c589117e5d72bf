"""One micro-batch through the model, cut into units of work that can be run one at a time.

A training micro-batch of a 135M model takes seconds on a CPU core, longer than a request can
wait for its first token. So the micro-batch is a sequence of *units*, each a separate call with
its state kept in between, none ever recomputed or thrown away:

    forward 0 .. forward n-1     one decoder layer over the whole micro-batch; each layer's input
                                 is a detached leaf, so its graph is a sub-graph of its own
    head 0 .. head h-1           norm + LM head + loss over a chunk of the answer tokens (prompt
                                 positions need no logits), the gradient w.r.t. the last hidden
                                 state summed over chunks
    backward n-1 .. backward 0   one `torch.autograd.grad` call through one layer's sub-graph: the
                                 LoRA gradients of that layer and the gradient for the layer below

The gradients are those of one monolithic forward and backward (a test compares them); only the
order of the work differs. An evaluation pass has the forward and head units only, under
`inference_mode`. The engine runs one unit at a time between serving steps (`engine.co_schedule`),
so a request that arrives waits for at most the unit in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collm.edge_client.model.lora import bind

HEAD_CHUNK_TOKENS = 64  # answer tokens per head unit: the LM head is the widest matmul of the model (~0.15 s on a core)


@dataclass(frozen=True)
class Unit:
    """What the next unit of a pass is: its kind (forward | head | backward) and how many tokens it reads."""

    kind: str
    tokens: int


class ModelParts:
    """The pieces of a Hugging Face Llama-family causal LM that a layer-wise pass calls."""

    def __init__(self, hf_model: torch.nn.Module):
        from transformers.masking_utils import create_causal_mask

        inner = hf_model.model
        self.config = hf_model.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self._causal_mask = create_causal_mask

    def inputs(self, ids: torch.Tensor, mask: torch.Tensor):
        """(embeddings, causal mask, rotary embeddings, positions): what every layer takes, as HF builds them."""
        h = self.embed(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        causal = self._causal_mask(config=self.config, inputs_embeds=h, attention_mask=mask, cache=None,
                                   position_ids=pos)
        return h, causal, self.rotary(h, position_ids=pos), pos


class LayerwisePass:
    """One micro-batch, forward (and for training backward), one unit per `run_unit()` call.

    `binding` is the LoRA binding the layers apply (`TrainingBinding` for training, a
    `ServingBinding` or None for evaluation); `layer_params[i]` are the trainable tensors used in
    decoder layer i (training only). Results, once `done`: `loss_sum` (summed over answer
    tokens), `answer_tokens`, `correct` (argmax hits), `tokens` (non-pad input tokens) and, for
    training, `grads` (tensor id -> gradient of `loss_sum`).
    """

    def __init__(self, parts: ModelParts, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, binding,
                 layer_params: list[list[torch.Tensor]] | None = None, head_chunk: int = HEAD_CHUNK_TOKENS):
        self.parts = parts
        self.binding = binding
        self.train = layer_params is not None
        self.layer_params = layer_params
        self.ids, self.mask = ids, mask
        self.n_layers = len(parts.layers)
        self.tokens = int(mask.sum())
        self.width = ids.numel()  # tokens every layer computes (padding included)
        target = labels[:, 1:].reshape(-1)
        rows = torch.nonzero(target != -100).flatten()  # position t predicts token t+1
        seq = ids.shape[1]
        self._rows = (rows // (seq - 1)) * seq + rows % (seq - 1)  # the same positions in [B*seq]
        self._targets = target[rows]
        self.answer_tokens = int(rows.numel())
        self._chunks = [slice(i, min(i + head_chunk, self.answer_tokens))
                        for i in range(0, self.answer_tokens, head_chunk)]
        self.loss_sum = 0.0
        self.correct = 0
        self.grads: dict[int, torch.Tensor] = {}
        self._stage, self._i = "forward", 0
        self._h: torch.Tensor | None = None
        self._ctx = None  # causal mask, rotary embeddings, positions
        self._saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (layer input leaf, output)
        self._final: torch.Tensor | None = None  # last hidden state (a leaf in training)
        self._g_final: torch.Tensor | None = None

    # ------------------------------------------------------------------ progress
    @property
    def done(self) -> bool:
        return self._stage == "done"

    def next_unit(self) -> Unit | None:
        if self._stage == "forward":
            return Unit("forward", self.width)
        if self._stage == "head":
            c = self._chunks[self._i]
            return Unit("head", c.stop - c.start)
        if self._stage == "backward":
            return Unit("backward", self.width)
        return None

    def run_unit(self) -> Unit:
        unit = self.next_unit()
        if unit is None:
            raise RuntimeError("the pass is done")
        if self._stage == "forward":
            self._forward_layer()
        elif self._stage == "head":
            self._head_chunk()
        else:
            self._backward_layer()
        return unit

    def run_all(self) -> None:
        while not self.done:
            self.run_unit()

    # ------------------------------------------------------------------ units
    def _grad_mode(self):
        return torch.enable_grad() if self.train else torch.inference_mode()

    def _forward_layer(self) -> None:
        i = self._i
        with self._grad_mode(), bind(self.binding):
            if i == 0:
                h, causal, rope, pos = self.parts.inputs(self.ids, self.mask)
                self._h, self._ctx = h.detach(), (causal, rope, pos)
            causal, rope, pos = self._ctx
            h_in = self._h.detach().requires_grad_(i > 0) if self.train else self._h
            h_out = self.parts.layers[i](h_in, attention_mask=causal, position_embeddings=rope, position_ids=pos)
        if self.train:
            self._saved.append((h_in if i > 0 else None, h_out))
        self._h = h_out
        self._i += 1
        if self._i == self.n_layers:
            self._final = self._h.detach().requires_grad_(True) if self.train else self._h
            self._h = None
            self._stage, self._i = ("head", 0) if self._chunks else ("done", 0)

    def _head_chunk(self) -> None:
        c = self._chunks[self._i]
        rows, target = self._rows[c], self._targets[c]
        with self._grad_mode(), bind(self.binding):
            x = self._final.reshape(-1, self._final.shape[-1]).index_select(0, rows)
            logits = self.parts.lm_head(self.parts.norm(x)).float()
            loss = F.cross_entropy(logits, target, reduction="sum")
            self.correct += int((logits.argmax(-1) == target).sum())
            if self.train:
                (g,) = torch.autograd.grad(loss, self._final)
                self._g_final = g if self._g_final is None else self._g_final + g
        self.loss_sum += float(loss.detach())
        self._i += 1
        if self._i == len(self._chunks):
            self._final = None
            self._stage, self._i = ("backward", self.n_layers - 1) if self.train else ("done", 0)

    def _backward_layer(self) -> None:
        i = self._i
        h_in, h_out = self._saved.pop()
        params = self.layer_params[i]
        inputs = ([h_in] if h_in is not None else []) + list(params)
        if inputs:
            grads = torch.autograd.grad(h_out, inputs, grad_outputs=self._g_final)
            if h_in is not None:
                self._g_final, grads = grads[0], grads[1:]
            for p, g in zip(params, grads):
                self.grads[id(p)] = g
        self._i -= 1
        if self._i < 0:
            self._g_final = None
            self._stage = "done"


def timed_units(p: LayerwisePass) -> list[tuple[Unit, float]]:
    """Run a whole pass, timing each unit (warm-up and benchmarks measure the real pass this way)."""
    out = []
    while not p.done:
        t0 = time.perf_counter()
        unit = p.run_unit()
        out.append((unit, time.perf_counter() - t0))
    return out


def layer_params_of(adapter, lora_layers, n_layers: int) -> list[list[torch.Tensor]]:
    """For each decoder layer, the trainable LoRA tensors (A and B) of the projections inside it."""
    by_layer: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    for m, a, b in zip(lora_layers.layers, adapter.a, adapter.b):
        by_layer[decoder_layer_index(m.path)].extend([a, b])
    return by_layer


def decoder_layer_index(path: str) -> int:
    """`model.layers.7.self_attn.q_proj` -> 7."""
    parts = path.split(".")
    try:
        return int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        raise ValueError(f"LoRA target {path!r} is not inside a decoder layer (model.layers.N...)") from None
