"""Rebuild data/dolly/dolly-subset.jsonl from a full databricks-dolly-15k JSONL file.

Usage: python scripts/make_dolly_subset.py ../shared/data/dolly-15k/databricks-dolly-15k.jsonl
Picks, per category, a seeded random sample of records short enough to train on a CPU
(instruction + context + response <= 1500 characters), so every edge of a category split
gets realistic but small examples.
"""

import json
import random
import sys
from collections import defaultdict
from pathlib import Path

PER_CATEGORY = 300
MAX_CHARS = 1500
SEED = 15


def main(src: str, dst: str = "data/dolly/dolly-subset.jsonl") -> None:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    with open(src, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            text_len = len(r["instruction"]) + len(r["context"]) + len(r["response"])
            if r["response"].strip() and text_len <= MAX_CHARS:
                by_cat[r["category"]].append(r)
    rng = random.Random(SEED)
    out = []
    for cat in sorted(by_cat):
        recs = sorted(by_cat[cat], key=lambda r: (r["instruction"], r["context"], r["response"]))
        rng.shuffle(recs)
        out.extend(recs[:PER_CATEGORY])
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        for r in out:
            keys = ("instruction", "context", "response", "category")
            f.write(json.dumps({k: r[k] for k in keys}, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} records ({PER_CATEGORY} per category max) to {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:])
