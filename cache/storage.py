"""How one layer's keys and values are held. Every storage kind has the same small surface
(mlx-lm style): `append` appends new tokens, `chunks` reads them back for attention a chunk at a time in
compute precision (so a compact kind never holds a float copy of the whole layer), `view` gives a float
kind's tokens without a copy, `fetch` / `update_and_fetch` return all of them in one float tensor (a
transient copy for compaction, saving and transformers' own attention, never retained), `replace`
installs a compacted (kept, re-rotated) sequence (a contiguous float layer compacts in place, `compact`, and
takes a splice's rows turned on the way, `place`), `truncate` crops back (keeping its memory, as a fork
rolls back to refill at once), `fit` gives back what is held beyond the tokens and room for a few more
when that is a large share (after a compaction that truncated and appended), `nbytes` counts the memory
really held, and `state` / `load_state` save and restore it (`from_state` builds a new one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

GROW = 64  # tokens: capacity grows in steps, so appends rarely reallocate and nbytes stays close to use
CHUNK = 4096  # tokens per chunk read by attention: the most float KV a compact layer materializes at once


class FloatChunk:
    """A run of float tokens as attention reads it: keys and values [kv_heads, n, head_dim], in the
    compute dtype. (The quantized kind has its own, `cache.quant.QuantChunk`, with the same two methods.)"""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.kv_heads = keys.shape[0]

    def scores(self, grouped: torch.Tensor) -> torch.Tensor:
        """grouped queries [kv_heads, rows, head_dim] -> [kv_heads, rows, n] dot products (float32)."""
        return torch.matmul(grouped.to(self.keys.dtype), self.keys.transpose(-1, -2)).float()

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [kv_heads, rows, n] -> [kv_heads, rows, head_dim] weighted sum of the values (float32)."""
        return torch.matmul(weights.to(self.values.dtype), self.values).float()


class LayerStorage(Protocol):
    length: int

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def chunks(self, dtype: torch.dtype) -> Iterator[tuple[int, FloatChunk]]: ...

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def truncate(self, length: int) -> None: ...

    def fit(self, reserve: int = 0) -> None: ...

    def nbytes(self) -> int: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...

    exact_truncate: bool  # whether truncate() gives back exactly the state before the tokens it cuts


class ContiguousStorage:
    """Keys and values [1, kv_heads, capacity, head_dim] in the model's dtype (or a wider float)."""

    exact_truncate = True  # truncate() restores exactly what was held before the cut (a fork relies on it)

    def __init__(self, dtype: torch.dtype | None = None, ceiling: int | None = None):
        """`ceiling`: the most tokens the store keeps between turns (its budget; None: unbounded)."""
        self.dtype, self.ceiling = dtype, ceiling
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        new_capacity = _steps(needed)
        shape = (like.shape[0], like.shape[1], new_capacity, like.shape[3])
        dtype = self.dtype or like.dtype
        keys = torch.empty(shape, dtype=dtype, device=like.device)
        values = torch.empty(shape, dtype=dtype, device=like.device)
        if self.keys is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def append(self, keys, values):
        start, count = self.length, keys.shape[2]
        self._reserve(start + count, keys)
        self.keys[:, :, start : start + count] = keys
        self.values[:, :, start : start + count] = values
        self.length = start + count

    def claim(self, count: int) -> int:
        """Room for `count` more tokens, counted as held from now: the first row of theirs, for a writer that
        fills the buffers in place (the native decode step writes the new key and value, then attends)."""
        start = self.length
        self._reserve(start + count, self.keys)
        self.length = start + count
        return start

    def update_and_fetch(self, keys, values):
        self.append(keys, values)
        compute = keys.dtype
        return self.keys[:, :, : self.length].to(compute), self.values[:, :, : self.length].to(compute)

    def fetch(self):
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def view(self, dtype):
        """The held tokens without a copy, when they are already in the compute dtype."""
        return self.fetch() if self.keys is not None and self.keys.dtype == dtype else None

    def chunks(self, dtype):
        """Views of CHUNK tokens at a time (converted one chunk at a time when stored in another dtype).
        Every float kind cuts chunks at the same positions, so they compute the same sums in the same order."""
        for start in range(0, self.length, CHUNK):
            stop = min(start + CHUNK, self.length)
            yield start, FloatChunk(self.keys[0, :, start:stop].to(dtype), self.values[0, :, start:stop].to(dtype))

    def replace(self, keys, values):
        """Install a compacted sequence, in the memory held when it fits (`fit` then gives back a large
        excess): `keys`/`values` are new tensors or views of the held ones from their first token."""
        self.length = 0
        if not keys.shape[2]:  # nothing kept: nothing to hold
            self.keys = self.values = None
            return
        self.append(keys, values)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def fit(self, reserve: int = 0) -> None:
        """Shrink capacity to the growth step that holds the tokens and `reserve` more, unless what it
        would free is at most a quarter of it and within the ceiling's growth step. Shrinking is a copy
        of the whole layer (40 % of a compaction's time at 1K tokens), and a cache under a budget refills
        what one compaction freed within a turn or two: a small excess is kept, not copied away and grown
        back; capacity a scoring fork grew past the budget is given back."""
        needed = _steps(self.length + reserve)
        if self.keys is None or self.keys.shape[2] <= needed:
            return
        small = self.keys.shape[2] - needed <= max(GROW, self.keys.shape[2] // 4)
        if small and (self.ceiling is None or self.keys.shape[2] <= _steps(self.ceiling)):
            return
        if not self.length and not reserve:
            self.keys = self.values = None
            return
        self.keys, self.values = self.keys[:, :, :needed].contiguous(), self.values[:, :, :needed].contiguous()

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def state(self) -> dict:
        keys, values = self.fetch() if self.keys is not None else (None, None)
        return {"kind": "contiguous", "keys": keys, "values": values}

    def load_state(self, state: dict) -> None:
        check_kind(state, "contiguous")
        self.keys = self.values = None  # allocated to the state's size
        self.length = 0
        if state["keys"] is not None:
            self.replace(state["keys"], state["values"])

    @classmethod
    def from_state(cls, state: dict, dtype: torch.dtype | None = None) -> "ContiguousStorage":
        storage = cls(dtype)
        storage.load_state(state)
        return storage


def compact_layers(storages: list[ContiguousStorage], start: int, order: torch.Tensor,
                   rotation: tuple[torch.Tensor, torch.Tensor], turned: torch.Tensor) -> bool:
    """In every layer: keep rows [0, start), then row start + j takes row start + order[j] (`order`
    ascending), its key turned by `rotation` (cos, sin [n, head_dim]) where `turned` [n] is set: in place, in
    one pass over all layers by the native kernel (cache/native.py). False when it cannot (not on the CPU,
    another dtype, no compiler): the caller rewrites the general way."""
    from cache import native

    if not _native_rows(storages):
        return False
    half = storages[0].keys.shape[3] // 2
    native.compact_rows([(s.keys[:, :, start:], s.values[:, :, start:]) for s in storages], order,
                        rotation[0][:, :half], rotation[1][:, :half], turned)
    for storage in storages:
        storage.length = start + order.numel()
    return True


def place_layers(storages: list[ContiguousStorage], keys: torch.Tensor, values: torch.Tensor,
                 rotation: tuple[torch.Tensor, torch.Tensor], turned: torch.Tensor) -> bool:
    """Append a span's rows to every layer (keys and values [layers, kv_heads, n, head_dim]), each key turned
    by `rotation` (cos, sin [n, head_dim]) where `turned` [n] is set: in one pass over all layers by the native
    kernel (cache/native.py). False when it cannot (not on the CPU, another dtype, no compiler): the caller
    rotates and appends the general way."""
    from cache import native

    if not _native_rows(storages) or keys.dtype != storages[0].keys.dtype or values.dtype != keys.dtype \
            or not native.available(keys, values):
        return False
    keys, values = keys.contiguous(), values.contiguous()
    half = storages[0].keys.shape[3] // 2
    starts = [storage.claim(keys.shape[2]) for storage in storages]
    native.place_rows([(s.keys[:, :, a:], s.values[:, :, a:]) for s, a in zip(storages, starts)], keys, values,
                      rotation[0][:, :half], rotation[1][:, :half], turned)
    return True


def _native_rows(storages: list[ContiguousStorage]) -> bool:
    """Whether the native kernels can move these layers' rows: all held, on the CPU, in one dtype they know."""
    from cache import native

    first = storages[0].keys
    return first is not None and first.dtype in native.COMPACT_DTYPES and \
        all(s.keys is not None and s.keys.dtype == first.dtype for s in storages) and \
        native.available(*(s.keys for s in storages))


def _steps(tokens: int) -> int:
    """Capacity for `tokens`: whole growth steps."""
    return -(-tokens // GROW) * GROW


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes under these tensors, each memory block once however many tensors (or layers) share it."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def check_kind(state: dict, kind: str) -> None:
    """A layer's saved state goes back only into the same kind of storage."""
    if state.get("kind") != kind:
        raise ValueError(f"a {state.get('kind')!r} layer state cannot be loaded into {kind!r} storage")


FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_KV = ("int8", "int4", "fp8")
KV_DTYPES = (*FLOAT_KV, *QUANT_KV, "dynamic")


@dataclass(frozen=True)
class StorageConfig:
    """How a store holds its layers' KV. Float kinds store in that dtype (contiguous, or paged in
    `block_size`-token blocks from one pool per layer, so a layer's blocks are allocated in order and
    attention reads runs of them as views); int8/int4/fp8 quantize all but the newest
    `residual` tokens in groups of `group` tokens; `dynamic` is full -> int8 (`int8_tokens`) -> int4 by age.
    Paging is for float kinds only: quantized tiers already hold whole token groups. `max_tokens` bounds a
    paged pool when the policy has no budget."""

    kv_dtype: str = "float32"
    paged: bool = False
    block_size: int = 16
    residual: int = 32
    group: int = 32
    int8_tokens: int = 512
    max_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv dtype {self.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        if self.paged and self.kv_dtype not in FLOAT_KV:
            raise ValueError(f"paged storage holds float kv dtypes only ({', '.join(FLOAT_KV)}), not {self.kv_dtype!r}")

    def build(self, num_layers: int, capacity: int | None = None) -> list[LayerStorage]:
        """One storage per layer. `capacity`: the most tokens a layer will hold (a paged store's pool is
        sized from it, with headroom for scoring forks); None: `max_tokens`."""
        from cache.paged import BlockPool, PagedStorage
        from cache.quant import DynamicConfig, DynamicStorage, QuantConfig, QuantizedStorage

        if self.kv_dtype in FLOAT_KV:
            dtype = FLOAT_KV[self.kv_dtype]
            if not self.paged:
                return [ContiguousStorage(dtype, capacity) for _ in range(num_layers)]
            tokens = self.max_tokens if capacity is None else capacity + max(256, capacity // 2)
            return [PagedStorage(BlockPool(-(-tokens // self.block_size) + 1, self.block_size, dtype))
                    for _ in range(num_layers)]
        if self.kv_dtype == "dynamic":
            config = DynamicConfig(residual=self.residual, int8_tokens=self.int8_tokens, group=self.group)
            return [DynamicStorage(config) for _ in range(num_layers)]
        config = QuantConfig(kind=self.kv_dtype, residual=self.residual, group=self.group)
        return [QuantizedStorage(config) for _ in range(num_layers)]
