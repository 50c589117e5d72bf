"""Instruction records: loading, non-IID / IID partitioning, holdout split, chat formatting.

Records are JSONL with `instruction`, `context`, `response`, `category` (the Dolly schema).
Partitioning by category gives each edge its own domain (a natural non-IID federation).
The holdout split hashes each record's text, so it does not depend on file order or on the
other records: the same record is in the same split on every edge and every run.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from collm.common.errors import UserError, reading

FIELDS = ("instruction", "context", "response", "category")


@dataclass(frozen=True)
class Record:
    instruction: str
    context: str
    response: str
    category: str

    @property
    def key(self) -> str:
        """Stable identity of the record's content."""
        h = hashlib.sha256("\x1f".join((self.instruction, self.context, self.response)).encode())
        return h.hexdigest()

    def prompt(self) -> str:
        """The user turn: the instruction, followed by its context when there is one."""
        if self.context.strip():
            return f"{self.instruction}\n\nContext:\n{self.context}"
        return self.instruction


def default_records_path() -> Path:
    from collm.data import DOLLY_SUBSET

    return DOLLY_SUBSET


def load_records(path: str | Path | None = None) -> list[Record]:
    p = Path(path).expanduser() if path else default_records_path()
    if not p.is_file():
        raise UserError(f"data.path: {p} does not exist")
    out = []
    with reading(p, "records"), open(p, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{p}:{lineno}: a record is a JSON object, got {type(obj).__name__}")
            missing = [k for k in ("instruction", "response") if not isinstance(obj.get(k), str)]
            if missing:
                raise UserError(f"{p}:{lineno}: record needs string field(s) {', '.join(missing)}")
            context, category = obj.get("context") or "", obj.get("category") or "uncategorized"
            if not isinstance(context, str) or not isinstance(category, str):
                raise UserError(f"{p}:{lineno}: context and category, where given, are strings")
            out.append(Record(obj["instruction"], context, obj["response"], category))
    if not out:
        raise UserError(f"{p}: no records")
    return out


def categories(records: list[Record]) -> list[str]:
    return sorted({r.category for r in records})


def partition_by_category(records: list[Record], num_edges: int) -> list[list[Record]]:
    """Deal whole categories to edges round-robin (sorted by name): edge i gets categories i, i+n, ..."""
    cats = categories(records)
    if num_edges > len(cats):
        raise UserError(f"cannot split {len(cats)} categories across {num_edges} edges")
    owner = {c: i % num_edges for i, c in enumerate(cats)}
    parts: list[list[Record]] = [[] for _ in range(num_edges)]
    for r in records:
        parts[owner[r.category]].append(r)
    return parts


def partition_iid(records: list[Record], num_shards: int, seed: int = 0) -> list[list[Record]]:
    """Seeded shuffle, then deal records to shards in turn (sizes differ by at most one)."""
    order = sorted(records, key=lambda r: r.key)
    random.Random(seed).shuffle(order)
    return [order[i::num_shards] for i in range(num_shards)]


def split_holdout(records: list[Record], fraction: float, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """(train, holdout): a record is held out iff its salted content hash falls under `fraction`."""
    train, hold = [], []
    for r in records:
        h = int(hashlib.sha256(f"{seed}:{r.key}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (hold if h < fraction else train).append(r)
    return train, hold


# ----------------------------------------------------------------------------- formatting
def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """Token ids of a one-turn chat prompt ending where the assistant starts to answer."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@dataclass
class Example:
    """A tokenized training example; `labels` is -100 on the prompt so only the answer is learned."""

    input_ids: list[int]
    labels: list[int]


def format_example(tokenizer, record: Record, max_len: int) -> Example:
    prompt = chat_prompt_ids(tokenizer, record.prompt())
    answer = tokenizer.encode(record.response, add_special_tokens=False) + [tokenizer.eos_token_id]
    if len(prompt) >= max_len:  # keep the end of the prompt (the question) and some answer
        prompt = prompt[-(max_len // 2):]
    ids = (prompt + answer)[:max_len]
    labels = ([-100] * len(prompt) + answer)[:max_len]
    return Example(ids, labels)
