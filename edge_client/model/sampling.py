"""Per-request sampling (temperature, top-p, seed) and incremental detokenization with stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# What torch.Generator.manual_seed accepts; a seed outside it would raise inside the engine loop.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop takes at most 4 non-empty strings")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be between {SEED_MIN} and {SEED_MAX}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def sample_next(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> list[int]:
    """One next token per row of `logits` [n, vocab], each row with its own params and generator."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0.0:
            out.append(greedy[i])
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # smallest prefix reaching top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        out.append(int(torch.multinomial(probs, 1, generator=gens[i]).item()))
    return out


class TextStream:
    """Turns generated token ids into text deltas; finds stop strings across token boundaries.

    Decoding is incremental (as vLLM and TGI do it): each token decodes only the last few ids, from
    `prefix` on, and keeps what they add beyond the text of ids[prefix:read], so a long answer costs
    linear time, not a decode of the whole output per token (issue #34). Text that could be the start
    of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] is the context the next delta is decoded against
        self.read = 0
        self.text = ""  # decoded text of all ids (minus a stop string once found)
        self.sent = 0  # characters of `text` already emitted
        self.stopped = False

    def _delta(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if now.endswith("\ufffd") or len(now) <= len(before):  # an incomplete character, or nothing yet
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to emit."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        added = self._delta()
        if not added:
            return ""
        start = len(self.text)
        self.text += added
        for s in self.stop:
            at = self.text.find(s, max(0, min(self.sent, start) - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                break
        hold = 0 if self.stopped else self._held_back()
        end = max(self.sent, len(self.text) - hold)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string (a stop string's
        length is bounded by the API: each check is a few C-level compares)."""
        best = 0
        for s in self.stop:
            tail = self.text[-(len(s) - 1):] if len(s) > 1 else ""
            for i in range(len(tail)):
                if s.startswith(tail[i:]):
                    best = max(best, len(tail) - i)
                    break
        return best

    def flush(self) -> str:
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
