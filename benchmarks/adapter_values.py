"""Does a decode step cost more once the served adapter is a trained one? Zero-B against trained, same runner.

    python benchmarks/adapter_values.py docs/.../round-0006/adapter_model.safetensors   # a collm checkpoint

collm's decode steps of 2-4 rows ran 1.12x slower after its first federated version than before it
(`benchmarks/step_context.py`). The serving path's cost should not depend on the adapter's values: this times
the engine's ModelRunner (SmolLM2, fp32, one thread) decoding 1-8 rows under the initial state (B = 0, what
a replica serves before round 1 and serve-only always), under a trained adapter (the checkpoint), and with
the rows split between the two (a batch that spans a swap). Decode steps interleaved in random order, 4
repeats of 12 steps per row count; medians and their ratio to the zero-B steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from benchkit import load_lm, random_adapter_state, shared_copy  # noqa: E402
from engine_kernels import _OursVariant  # noqa: E402

from collm.common.config import LORA_TARGETS_LLAMA  # noqa: E402
from collm.edge_client.model.lora import inject_lora  # noqa: E402
from collm.edge_client.model.runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="a trained adapter: a collm checkpoint's adapter_model.safetensors")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    a = ap.parse_args()
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        trained = {k: v.float() for k, v in load_file(str(a.checkpoint)).items()}
    except (OSError, ValueError, SafetensorError) as e:
        print(f"adapter_values: checkpoint: cannot read {a.checkpoint} ({e})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    lm = load_lm("smollm2", "cpu", "float32")
    model = shared_copy(lm.model)
    layers = inject_lora(model, LORA_TARGETS_LLAMA, a.rank, a.alpha)
    zero = random_adapter_state(layers, 1, 0.0)
    if set(zero) - set(trained):
        print(f"adapter_values: checkpoint: {len(set(zero) - set(trained))} LoRA tensors missing for rank {a.rank} "
              "on SmolLM2's targets (--rank)", file=sys.stderr)
        return 2
    dev = torch.device("cpu")
    w0 = layers.serving_weights(zero, 0, dev, lm.dtype)
    w1 = layers.serving_weights(trained, 1, dev, lm.dtype)
    runner = ModelRunner(model)
    P, K, rng = 100, 12, random.Random(0)
    g = torch.Generator().manual_seed(0)
    print("rows  zero-B ms  trained ms (x)  half and half ms (x)")
    for n in (1, 2, 3, 4, 8):
        prompts = [torch.randint(3, lm.model.config.vocab_size, (P,), generator=g).tolist() for _ in range(n)]
        variants = {k: _OursVariant(k, runner, runner.new_pool(8, P + K + 8), w)
                    for k, w in (("zero", w0), ("trained", w1), ("mixed", [w0, w1]))}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(4):
            for v in variants.values():
                v.reset()
                v.prefill(prompts)
            for _ in range(K):
                order = list(variants.items())
                rng.shuffle(order)
                for k, v in order:
                    t = time.perf_counter()
                    v.decode()
                    times[k].append(time.perf_counter() - t)
        z, t1, mx = (statistics.median(times[k]) for k in ("zero", "trained", "mixed"))
        print(f"{n:>4}  {1000 * z:9.1f}  {1000 * t1:7.1f} ({t1 / z:.3f})  {1000 * mx:10.1f} ({mx / z:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
