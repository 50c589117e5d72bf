"""`collm-edge --config edge.yaml`: one edge replica (model loaded once, served and trained)."""

from __future__ import annotations

import argparse
import sys

from collm.common.config import EdgeConfig, dump_config, load_config
from collm.common.errors import cli_entry
from collm.common.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collm-edge", description=__doc__)
    p.add_argument("--config", required=True, help="edge YAML config (see configs/)")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("--prompt", help="load the model, answer this one prompt, and exit")
    p.add_argument("--max-tokens", type=int, default=64)
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config(EdgeConfig, args.config)
    if args.check:
        sys.stdout.write(dump_config(cfg))
        return 0
    setup_logging()
    if args.prompt is not None:
        return answer_once(cfg, args.prompt, args.max_tokens)
    print("collm-edge: nothing to do yet (use --check or --prompt)", file=sys.stderr)
    return 2


def answer_once(cfg: EdgeConfig, prompt: str, max_tokens: int) -> int:
    import torch

    from collm.common.data import chat_prompt_ids
    from collm.common.models import load_model

    lm = load_model(cfg.model)
    ids = torch.tensor([chat_prompt_ids(lm.tokenizer, prompt)], device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)
    print(lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return 0
