"""FAISS vector index over segment embeddings, scoped by (user_id, session_id).

Scoping is structural: each scope has its own FAISS index, and a query only ever reaches the index of its
own scope, so one user's memories cannot come back for another (mem0 #1805 leaked exactly this way: a
filter that could be left out). Per-scope indexes also keep search cost proportional to the scope, not to
everything stored, and avoid HNSW's recall collapse under highly selective filters.

Kinds (IndexConfig.kind), all returning a similarity where higher is closer:
- flat: exact inner product (cosine for the Embedder's unit vectors), the default; 1.5 KB a vector.
- hnsw: HNSW graph over the same inner product; sublinear search for large scopes, ~1.8 KB a vector.
  HNSW cannot delete in place, so removed ids become tombstones filtered out at search (IDSelector) and
  the scope's graph is rebuilt once tombstones pass a quarter of its vectors.
- lsh: random-hyperplane LSH (SimHash), `lsh_bits` sign bits a vector (96 bytes at 768 bits); the score
  is the angle estimate cos(pi * hamming / bits), so thresholds mean roughly the same as for cosine.
  The projection is shared by all scopes and regenerated from `lsh_seed` (a frozen legacy NumPy stream).

File format (save/load): MAGIC, an 8-byte little-endian header length, a JSON header (version, config,
stamp, per-scope sizes and tombstones, CRC32 of the payload), then each scope's faiss.serialize_index
bytes. The CRC is checked before FAISS parses anything, so a corrupt file gives an ArchiveError rather
than whatever FAISS's deserializer does with garbage sizes."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import faiss
import numpy as np

from memory.files import ArchiveError, atomic_write, read_file

KINDS = ("flat", "hnsw", "lsh")
MAGIC = b"MPALACE-INDEX\n"
VERSION = 1
UNIT_TOLERANCE = 1e-3

Scope = tuple[str, str]  # (user_id, session_id)


@dataclass(frozen=True)
class IndexConfig:
    kind: str = "flat"
    dim: int = 384
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 64
    lsh_bits: int = 768
    lsh_seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"index kind {self.kind!r}: expected one of {', '.join(KINDS)}")


@dataclass
class _ScopeIndex:
    index: faiss.IndexIDMap
    removed: set[int] = field(default_factory=set)  # HNSW tombstones

    @property
    def live(self) -> int:
        return self.index.ntotal - len(self.removed)


class VectorIndex:
    """Segment id -> unit vector, searchable only within one (user_id, session_id) scope."""

    def __init__(self, config: IndexConfig = IndexConfig()):
        self.config = config
        self._scopes: dict[Scope, _ScopeIndex] = {}
        self._scope_of: dict[int, Scope] = {}
        self._projection = (np.random.RandomState(config.lsh_seed)
                            .standard_normal((config.dim, config.lsh_bits)).astype(np.float32)
                            if config.kind == "lsh" else None)

    def __len__(self) -> int:
        return len(self._scope_of)

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._scope_of

    def ids(self) -> set[int]:
        return set(self._scope_of)

    def add(self, ids: Sequence[int], vectors: np.ndarray, user_id: str, session_id: str) -> None:
        """vectors: float32 [len(ids), dim] unit vectors (the Embedder's)."""
        scope = _scope(user_id, session_id)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        vectors = self._check(vectors, len(ids))
        if len(set(ids.tolist())) != len(ids) or any(int(i) in self._scope_of for i in ids):
            raise ValueError("segment ids must be new and distinct")
        if scope not in self._scopes:
            self._scopes[scope] = _ScopeIndex(faiss.IndexIDMap(self._new_base()))
        self._scopes[scope].index.add_with_ids(self._encode(vectors), ids)
        self._scope_of.update((int(i), scope) for i in ids)

    def search(self, query: np.ndarray, user_id: str, session_id: str, k: int = 5,
               threshold: float | None = None) -> list[tuple[int, float]]:
        """The k closest segments of this scope as (segment_id, score), best first; with `threshold`,
        only those scoring at least that."""
        query = self._check(query, 1)
        entry = self._scopes.get(_scope(user_id, session_id))
        k = min(k, entry.live) if entry else 0
        if k <= 0:
            return []
        params = selector = None
        if self.config.kind == "hnsw":
            params = faiss.SearchParametersHNSW()
            params.efSearch = max(self.config.hnsw_ef_search, k)
            if entry.removed:
                # a local name keeps the batch alive through the search: IDSelectorNot does not own it
                selector = faiss.IDSelectorBatch(np.fromiter(entry.removed, dtype=np.int64))
                params.sel = faiss.IDSelectorNot(selector)
        scores, found = entry.index.search(self._encode(query), k, params=params)
        scores = scores[0]
        if self.config.kind == "lsh":
            scores = np.cos(np.pi * scores / self.config.lsh_bits)
        return [(int(i), float(s)) for i, s in zip(found[0], scores)
                if i >= 0 and (threshold is None or s >= threshold)]

    def remove(self, ids: Iterable[int]) -> int:
        """Drop these ids (unknown ones are ignored); returns how many were removed."""
        by_scope: dict[Scope, list[int]] = {}
        for segment_id in ids:
            scope = self._scope_of.pop(int(segment_id), None)
            if scope is not None:
                by_scope.setdefault(scope, []).append(int(segment_id))
        for scope, gone in by_scope.items():
            entry = self._scopes[scope]
            if self.config.kind == "hnsw":
                entry.removed.update(gone)
                if len(entry.removed) * 4 > entry.index.ntotal:
                    self._compact(entry)
            else:
                entry.index.remove_ids(np.asarray(gone, dtype=np.int64))
            if entry.live == 0:
                del self._scopes[scope]
        return sum(map(len, by_scope.values()))

    def save(self, path: str | Path, stamp: int = 0) -> None:
        """Atomically write every scope to `path`; `stamp` is an opaque number load() returns (the
        archive's save generation, to tell a stale index from a current one)."""
        scopes = list(self._scopes.items())
        blobs = [faiss.serialize_index(entry.index).tobytes() for _, entry in scopes]
        payload = b"".join(blobs)
        header = json.dumps({
            "version": VERSION, "config": asdict(self.config), "stamp": stamp, "crc32": zlib.crc32(payload),
            "scopes": [{"user_id": user, "session_id": session, "bytes": len(blob), "removed": sorted(entry.removed)}
                       for ((user, session), entry), blob in zip(scopes, blobs)],
        }).encode()
        atomic_write(Path(path), MAGIC + len(header).to_bytes(8, "little") + header + payload)

    @classmethod
    def load(cls, path: str | Path) -> tuple["VectorIndex", int]:
        """The index saved at `path` and its stamp; ArchiveError naming the file if it is unreadable."""
        path = Path(path)
        data = read_file(path)
        header, payload = _split(path, data)
        try:
            index = cls(IndexConfig(**header["config"]))
            offset = 0
            for scope in header["scopes"]:
                blob = np.frombuffer(payload, dtype=np.uint8, count=scope["bytes"], offset=offset)
                offset += scope["bytes"]
                entry = _ScopeIndex(faiss.deserialize_index(blob), set(scope["removed"]))
                index._adopt(_scope(scope["user_id"], scope["session_id"]), entry)
            stamp = int(header["stamp"])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise ArchiveError(path, f"not a valid index file ({type(error).__name__}: {error})") from error
        return index, stamp

    def _adopt(self, scope: Scope, entry: _ScopeIndex) -> None:
        """Register a deserialized scope, checking it is what this config would have built."""
        if not isinstance(entry.index, faiss.IndexIDMap) or entry.index.d != self._encoded_dim():
            raise ValueError(f"scope {scope} holds a {type(entry.index).__name__} of dim {entry.index.d}")
        ids = faiss.vector_to_array(entry.index.id_map).tolist()
        if not entry.removed <= set(ids):
            raise ValueError(f"scope {scope} has tombstones for ids it does not hold")
        live = [i for i in ids if i not in entry.removed]
        if scope in self._scopes or any(i in self._scope_of for i in live):
            raise ValueError(f"scope {scope} repeats a scope or a segment id")
        self._scopes[scope] = entry
        self._scope_of.update((i, scope) for i in live)

    def _compact(self, entry: _ScopeIndex) -> None:
        """Rebuild an HNSW scope without its tombstones (vectors are read back from the graph's storage)."""
        ids = faiss.vector_to_array(entry.index.id_map)
        keep = ~np.isin(ids, np.fromiter(entry.removed, dtype=np.int64))
        vectors = entry.index.index.reconstruct_n(0, entry.index.ntotal)[keep]
        entry.index = faiss.IndexIDMap(self._new_base())
        entry.index.add_with_ids(vectors, ids[keep])
        entry.removed.clear()

    def _new_base(self) -> faiss.Index:
        config = self.config
        if config.kind == "flat":
            return faiss.IndexFlatIP(config.dim)
        if config.kind == "hnsw":
            base = faiss.IndexHNSWFlat(config.dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction = config.hnsw_ef_construction
            base.hnsw.efSearch = config.hnsw_ef_search
            return base
        # the shared projection is applied by _encode, so the LSH index just takes sign bits
        return faiss.IndexLSH(config.lsh_bits, config.lsh_bits, False, False)

    def _encoded_dim(self) -> int:
        return self.config.lsh_bits if self.config.kind == "lsh" else self.config.dim

    def _encode(self, vectors: np.ndarray) -> np.ndarray:
        return vectors if self._projection is None else np.ascontiguousarray(vectors @ self._projection)

    def _check(self, vectors: np.ndarray, count: int) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.size != count * self.config.dim:
            raise ValueError(f"expected {count} vector(s) of dim {self.config.dim}, got shape {vectors.shape}")
        vectors = np.ascontiguousarray(vectors.reshape(count, self.config.dim))
        if not np.all(np.abs(np.linalg.norm(vectors, axis=1) - 1) <= UNIT_TOLERANCE):
            raise ValueError("vectors must be finite and unit length (scores are cosine similarities)")
        return vectors

def _scope(user_id: str, session_id: str) -> Scope:
    if not (isinstance(user_id, str) and user_id and isinstance(session_id, str) and session_id):
        raise ValueError("user_id and session_id must be non-empty strings: every search is scoped by both")
    return user_id, session_id


def _split(path: Path, data: bytes) -> tuple[dict, bytes]:
    """Header and payload of an index file, after checking magic, version and CRC."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ArchiveError(path, "not an index file (bad magic)")
    start = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + length])
        version, sizes = header["version"], [scope["bytes"] for scope in header["scopes"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ArchiveError(path, f"index header is corrupt or truncated ({error})") from error
    if version != VERSION:
        raise ArchiveError(path, f"index format version {version}, this code reads version {VERSION}")
    payload = data[start + length:]
    if len(payload) != sum(sizes) or zlib.crc32(payload) != header.get("crc32"):
        raise ArchiveError(path, "index payload is corrupt or truncated (size or CRC mismatch)")
    return header, payload
