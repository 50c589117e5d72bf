"""One forward pass over a scheduler step: a flattened, variable-length batch of requests.

A step mixes decode tokens (one per running request) and prefill chunks. The linear layers run
on all the step's tokens at once, as one [tokens, hidden] matrix, with each request's pinned LoRA
version applied to its rows. Attention reads each request's slot of a preallocated KV pool:
decodes in one masked batched call, prefill chunks one by one (causal within the chunk).

Works for Llama-family decoders from transformers (Llama, Mistral, Qwen2/3, SmolLM): RMSNorm,
rotary embeddings, grouped-query attention, gated MLP. The projections that read the same input
(q|k|v, gate|up) run as one matmul each, with their LoRA deltas in two more
(`collm.edge_client.model.fused`); the HF modules' weights become views of the fused tensors, so
the base is still held once. A bitsandbytes-quantized base cannot be concatenated: its modules
are called one by one, as HF does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from collm.edge_client.model.fused import FusedLinear
from collm.edge_client.model.lora import AdapterWeights, ServingBinding, bind
from collm.edge_client.model.row_kernels import RowKernels


@dataclass
class Segment:
    """The tokens one request contributes to a step."""

    slot: int  # its KV pool slot
    start: int  # position of tokens[0] in the sequence
    tokens: list[int]
    adapter: AdapterWeights
    want_logits: bool  # sample a token after the last of `tokens`


class KVPool:
    """Preallocated KV memory: `slots` sequences of up to `slot_len` tokens each.

    The lowest free slot is handed out first, so running requests stay in a compact slot range
    and a batched decode attends over few idle slots.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, slots: int, slot_len: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, slots, n_kv_heads, slot_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.slot_len = slot_len
        self._free = list(range(slots))

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def allocate(self) -> int | None:
        if not self._free:
            return None
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    """Runs segments through the frozen base model (with LoRA layers injected) and a KV pool."""

    def __init__(self, hf_model: torch.nn.Module, fuse: bool = True):
        self.hf = hf_model
        inner = hf_model.model
        cfg = hf_model.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.vocab_size = cfg.vocab_size
        self.n_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        # per layer: q|k|v and gate|up as one projection each (`collm.edge_client.model.fused`), their
        # base matmuls by `kernels` (aten's until the warm-up finds a faster one for few rows)
        self.kernels = k = RowKernels()
        self.qkv, self.o, self.gate_up, self.down, self.act = [], [], [], [], []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(FusedLinear([attn.q_proj, attn.k_proj, attn.v_proj], fuse, k))
            self.o.append(FusedLinear([attn.o_proj], matmul=k))
            self.gate_up.append(FusedLinear([mlp.gate_proj, mlp.up_proj], fuse, k))
            self.down.append(FusedLinear([mlp.down_proj], matmul=k))
            self.act.append(mlp.act_fn)
        self._head_plain = type(self.lm_head) is torch.nn.Linear and self.lm_head.weight.is_floating_point()
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.inter = self.gate_up[0].out_features // 2

    def kernel_sample(self) -> list[torch.Tensor]:
        """The weights the few-rows kernel choice is timed on: one layer's projections and the LM head
        (what a decode step pays, in proportion), those `RowKernels` would multiply."""
        sample = [f.weight for f in (self.qkv[0], self.o[0], self.gate_up[0], self.down[0]) if f.weight is not None]
        return sample + ([self.lm_head.weight] if self._head_plain else [])

    def new_pool(self, slots: int, slot_len: int) -> KVPool:
        return KVPool(self.n_layers, self.n_kv, self.head_dim, slots, slot_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, segments: list[Segment], pool: KVPool) -> torch.Tensor:
        """Logits [n, vocab] for the segments with `want_logits`, in segment order.

        Segments must be ordered by adapter version so each version's rows are contiguous.
        """
        dev = self.device
        ids, pos, groups = [], [], []
        row = 0
        for s in segments:
            n = len(s.tokens)
            ids.extend(s.tokens)
            pos.extend(range(s.start, s.start + n))
            if groups and groups[-1][2] is s.adapter:
                groups[-1] = (groups[-1][0], row + n, s.adapter)
            else:
                groups.append((row, row + n, s.adapter))
            row += n
        T = row
        ids_t = torch.tensor(ids, device=dev)
        pos_t = torch.tensor(pos, device=dev)
        h = self.embed(ids_t)
        cos, sin = self.rotary(h[None], pos_t[None])
        cos, sin = cos[0, :, None, :].to(h.dtype), sin[0, :, None, :].to(h.dtype)  # [T, 1, hd]

        # Decode segments (one token, continuing a sequence) share one batched attention call.
        dec = [(i, s) for i, s in enumerate(segments) if len(s.tokens) == 1 and s.start > 0]
        pre = [(i, s) for i, s in enumerate(segments) if not (len(s.tokens) == 1 and s.start > 0)]
        offsets = [0]
        for s in segments:
            offsets.append(offsets[-1] + len(s.tokens))
        if dec:
            d_rows = torch.tensor([offsets[i] for i, _ in dec], device=dev)
            d_slots = torch.tensor([s.slot for _, s in dec], device=dev)
            d_pos = torch.tensor([s.start for _, s in dec], device=dev)
            n_range = max(s.slot for _, s in dec) + 1
            max_len = max(s.start for _, s in dec) + 1
            lens = torch.ones(n_range, dtype=torch.long, device=dev)  # idle slots: attend key 0 (no NaN)
            lens[d_slots] = d_pos + 1
            d_mask = (torch.arange(max_len, device=dev)[None, :] < lens[:, None])[:, None, None, :]

        with bind(ServingBinding(groups)):
            for li, layer in enumerate(self.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                q, k, v = self.qkv[li](x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
                q = q.view(T, self.n_heads, self.head_dim)
                k = k.view(T, self.n_kv, self.head_dim)
                v = v.view(T, self.n_kv, self.head_dim)
                if hasattr(attn, "q_norm"):
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
                out = torch.empty_like(q)
                kc, vc = pool.k[li], pool.v[li]  # [slots, n_kv, slot_len, hd]
                if dec:
                    kc[d_slots, :, d_pos] = k.index_select(0, d_rows)
                    vc[d_slots, :, d_pos] = v.index_select(0, d_rows)
                    qd = q.new_zeros(n_range, self.n_kv, self.group, self.head_dim)
                    qd[d_slots] = q.index_select(0, d_rows).view(-1, self.n_kv, self.group, self.head_dim)
                    od = F.scaled_dot_product_attention(qd, kc[:n_range, :, :max_len], vc[:n_range, :, :max_len],
                                                        attn_mask=d_mask, scale=self.scaling)
                    out.index_copy_(0, d_rows, od[d_slots].view(-1, self.n_heads, self.head_dim))
                for i, s in pre:
                    a, b = offsets[i], offsets[i + 1]
                    n, end = b - a, s.start + b - a
                    kc[s.slot, :, s.start:end] = k[a:b].transpose(0, 1)
                    vc[s.slot, :, s.start:end] = v[a:b].transpose(0, 1)
                    qs = q[a:b].transpose(0, 1)[None]  # [1, nh, n, hd]
                    ks, vs = kc[s.slot, :, :end][None], vc[s.slot, :, :end][None]
                    if s.start == 0:
                        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scaling,
                                                           enable_gqa=True)
                    else:  # a later chunk: query i (position start+i) sees keys 0..start+i
                        mask = torch.arange(end, device=dev)[None, :] <= torch.arange(s.start, end, device=dev)[:, None]
                        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scaling,
                                                           enable_gqa=True)
                    out[a:b] = o[0].transpose(0, 1)
                h = h + self.o[li](out.view(T, self.n_heads * self.head_dim))
                gate, up = self.gate_up[li](layer.post_attention_layernorm(h)).split((self.inter, self.inter), dim=-1)
                h = h + self.down[li](self.act[li](gate) * up)
            want = [offsets[i + 1] - 1 for i, s in enumerate(segments) if s.want_logits]
            if not want:
                return h.new_empty(0, self.vocab_size)
            last = self.norm(h.index_select(0, torch.tensor(want, device=dev)))
            head = self.kernels(last, self.lm_head.weight, self.lm_head.bias) if self._head_plain else self.lm_head(last)
            return head.float()
