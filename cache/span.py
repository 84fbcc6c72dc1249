"""A span of KV outside the live cache: tokens a compaction evicted (handed to `KVStore.on_evict`) or
tokens to splice back in (`KVStore.inject`). It carries everything a splice needs so nothing is
recomputed: the tokens' metadata rows (ids, turn, role, segment, importance, surprisal, serial...) and
every layer's keys and values as the cache held them. Keys keep RoPE applied at `meta.position`; a
splice re-rotates them by the difference to wherever they land (cache/rope.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.meta import TokenMeta


@dataclass
class KVSpan:
    """keys/values: one [kv_heads, tokens, head_dim] tensor per layer, tokens in `meta`'s row order."""

    meta: TokenMeta
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __post_init__(self) -> None:
        """Misaligned tensors fail here, where the caller can still see why, not inside a splice."""
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(f"a span needs the same number of key and value layers (>= 1), got {len(self.keys)} "
                             f"and {len(self.values)}")
        count = len(self.meta)
        for name, layers in (("keys", self.keys), ("values", self.values)):
            if any(t.dim() != 3 or t.shape[1] != count for t in layers):
                shapes = sorted({tuple(t.shape) for t in layers})
                raise ValueError(f"{name} must be [kv_heads, {len(self.meta)}, head_dim] in every layer, got {shapes}")

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def positions(self) -> torch.Tensor:
        """The RoPE positions the keys are rotated for."""
        return self.meta.position

    @property
    def serials(self) -> torch.Tensor:
        return self.meta.serial

    @classmethod
    def cat(cls, spans: list["KVSpan"]) -> "KVSpan":
        """One span of these spans' tokens, in the order given (a single span: itself)."""
        if len(spans) == 1:
            return spans[0]
        meta = spans[0].meta
        for span in spans[1:]:
            meta = meta.cat(span.meta)
        layers = range(len(spans[0].keys))
        return cls(meta, [torch.cat([span.keys[i] for span in spans], dim=1) for i in layers],
                   [torch.cat([span.values[i] for span in spans], dim=1) for i in layers])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSpan":
        """The same span with its KV on `device` in `dtype` (each None: unchanged); metadata stays on the CPU."""
        move = lambda t: t.to(device=device or t.device, dtype=dtype or t.dtype)  # noqa: E731
        return KVSpan(self.meta, [move(t) for t in self.keys], [move(t) for t in self.values])

    def select(self, index: torch.Tensor) -> "KVSpan":
        """Only these tokens (e.g. leaving out those the live cache already holds: `~store.holds(span.serials)`)."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        return KVSpan(self.meta.select(index), [t.index_select(1, index.to(t.device)) for t in self.keys],
                      [t.index_select(1, index.to(t.device)) for t in self.values])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def state(self) -> dict:
        """Plain CPU tensors (copies), for torch.save or an archive's own encoding."""
        cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        return {"meta": self.meta.state(), "keys": [cpu(t) for t in self.keys], "values": [cpu(t) for t in self.values]}

    @classmethod
    def from_state(cls, state: dict, device: torch.device | str | None = None) -> "KVSpan":
        """The span of a `state()`; its KV tensors are the state's own unless moved to another device."""
        return cls(TokenMeta.from_state(state["meta"]), list(state["keys"]), list(state["values"])).to(device)
