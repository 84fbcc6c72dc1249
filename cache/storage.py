"""How one layer's keys and values are held. Every storage kind has the same small surface
(mlx-lm style): `update_and_fetch` appends new tokens and returns all of them in compute precision,
`replace` installs a compacted (kept, re-rotated) sequence, `truncate` crops back, `nbytes` counts the
memory really held, and `state`/`from_state` save and restore it."""

from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

import torch

GROW = 64  # tokens: capacity grows in steps, so appends rarely reallocate and nbytes stays close to use


class LayerStorage(Protocol):
    length: int

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fetch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def truncate(self, length: int) -> None: ...

    def nbytes(self) -> int: ...

    def state(self) -> dict: ...


class ContiguousStorage:
    """Keys and values [1, kv_heads, capacity, head_dim] in the model's dtype (or a wider float)."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        new_capacity = -(-needed // GROW) * GROW
        shape = (like.shape[0], like.shape[1], new_capacity, like.shape[3])
        dtype = self.dtype or like.dtype
        keys = torch.empty(shape, dtype=dtype, device=like.device)
        values = torch.empty(shape, dtype=dtype, device=like.device)
        if self.keys is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys, values):
        start, count = self.length, keys.shape[2]
        self._reserve(start + count, keys)
        self.keys[:, :, start : start + count] = keys
        self.values[:, :, start : start + count] = values
        self.length = start + count
        compute = keys.dtype
        return self.keys[:, :, : self.length].to(compute), self.values[:, :, : self.length].to(compute)

    def fetch(self):
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def replace(self, keys, values):
        """Install a compacted sequence; capacity shrinks to fit so evicted memory is really released."""
        self.keys = self.values = None
        self.length = 0
        self._reserve(keys.shape[2], keys)
        self.keys[:, :, : keys.shape[2]] = keys
        self.values[:, :, : keys.shape[2]] = values
        self.length = keys.shape[2]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def state(self) -> dict:
        keys, values = self.fetch() if self.keys is not None else (None, None)
        return {"kind": "contiguous", "keys": keys, "values": values}

    @classmethod
    def from_state(cls, state: dict, dtype: torch.dtype | None = None) -> "ContiguousStorage":
        storage = cls(dtype)
        if state["keys"] is not None:
            storage.replace(state["keys"], state["values"])
        return storage


FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_KV = ("int8", "int4", "fp8")
KV_DTYPES = (*FLOAT_KV, *QUANT_KV, "dynamic")


def make_storage(kv_dtype: str, paged: bool = False, block_size: int = 16, residual: int = 32) -> Callable[[], LayerStorage]:
    """A per-layer storage factory for KVStore (`KVStore.for_model(model, storage=make_storage("int8"))`).
    Float kinds store in that dtype (contiguous, or paged in `block_size`-token blocks); int8/int4/fp8
    quantize all but the newest `residual` tokens; `dynamic` is full -> int8 -> int4 by age. Paging is for
    float kinds only: quantized tiers already hold whole token groups and reallocate per group."""
    from cache.paged import PagedStorage
    from cache.quant import DynamicConfig, DynamicStorage, QuantConfig, QuantizedStorage

    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown kv dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if kv_dtype in FLOAT_KV:
        dtype = FLOAT_KV[kv_dtype]
        return partial(PagedStorage, dtype, block_size) if paged else partial(ContiguousStorage, dtype)
    if paged:
        raise ValueError(f"paged storage holds float kv dtypes only ({', '.join(FLOAT_KV)}), not {kv_dtype!r}")
    if kv_dtype == "dynamic":
        return partial(DynamicStorage, DynamicConfig(residual=residual))
    return partial(QuantizedStorage, QuantConfig(kind=kv_dtype, residual=residual))
