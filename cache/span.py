"""A span of KV outside the live cache: tokens a compaction evicted (handed to `KVStore.on_evict`) or
tokens to splice back in (`KVStore.inject`). It carries everything a splice needs so nothing is
recomputed: the tokens' metadata rows (ids, turn, role, segment, importance, surprisal, serial...) and
every layer's keys and values as the cache held them. Keys keep RoPE applied at `meta.position`; a
splice re-rotates them by the difference to wherever they land (cache/rope.py).

All layers sit in one tensor per side, so joining or selecting spans is one operation, not one per layer:
at a few dozen tokens a span's work is per-call overhead (30 layers x 2 sides), not arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache import native
from cache.meta import TokenMeta


@dataclass
class KVSpan:
    """keys/values: [layers, kv_heads, tokens, head_dim], tokens in `meta`'s row order."""

    meta: TokenMeta
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        """Misaligned tensors fail here, where the caller can still see why, not inside a splice."""
        for name in ("keys", "values"):
            shape = tuple(getattr(self, name).shape)
            if len(shape) != 4 or not shape[0] or shape[2] != len(self.meta):
                raise ValueError(f"{name} must be [layers >= 1, kv_heads, {len(self.meta)}, head_dim], got {list(shape)}")
        if self.keys.shape[:3] != self.values.shape[:3]:
            raise ValueError(f"keys {list(self.keys.shape)} and values {list(self.values.shape)} differ in layers, "
                             "heads or tokens")

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
        meta = spans[0].meta.cat(*(span.meta for span in spans[1:]))
        return cls(meta, torch.cat([span.keys for span in spans], dim=2), torch.cat([span.values for span in spans], dim=2))

    @classmethod
    def in_serial_order(cls, spans: list["KVSpan"], keep: list[torch.Tensor | None] | None = None) -> "KVSpan":
        """One span of these spans' tokens sorted by serial (spans evicted at different times interleave: the
        hybrid evicts a message in pieces, runs of 4-5 tokens in a recall); `keep`: per span, a bool mask of
        the tokens to take (None: all). On the CPU each token taken is copied once, straight to its place
        (cache/native.py: gather_tokens); elsewhere the spans are cut, joined, then gathered."""
        keep = keep or [None] * len(spans)
        rows = [torch.arange(len(span)) if mask is None else torch.nonzero(mask).flatten() for span, mask in zip(spans, keep)]
        whole = [mask is None or len(taken) == len(span) for span, mask, taken in zip(spans, keep, rows)]
        metas = [span.meta if all_of_it else span.meta.select(taken) for span, all_of_it, taken in zip(spans, whole, rows)]
        meta = metas[0].cat(*metas[1:])
        order = torch.argsort(meta.serial)
        if len(spans) == 1 and whole[0] and bool((order == torch.arange(len(order))).all()):
            return spans[0]
        tensors = [(span.keys, span.values) for span in spans]
        if not all(k.is_contiguous() and v.is_contiguous() and k.dtype == tensors[0][0].dtype and v.dtype == tensors[0][1].dtype
                   for k, v in tensors) or not native.available(*(t for pair in tensors for t in pair)):
            return cls.cat([span if all_of_it else span.select(taken)
                            for span, all_of_it, taken in zip(spans, whole, rows)]).select(order)
        part = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([len(taken) for taken in rows]))
        part, index = part[order], torch.cat(rows)[order]
        return cls(meta.select(order), native.gather_tokens([k for k, _ in tensors], part, index),
                   native.gather_tokens([v for _, v in tensors], part, index))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "KVSpan":
        """The same span with its KV on `device` in `dtype` (each None: unchanged); metadata stays on the CPU."""
        move = lambda t: t.to(device=device or t.device, dtype=dtype or t.dtype)  # noqa: E731
        return KVSpan(self.meta, move(self.keys), move(self.values))

    def select(self, index: torch.Tensor) -> "KVSpan":
        """Only these tokens (e.g. leaving out those the live cache already holds: `~store.holds(span.serials)`)."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        device_index = index.to(self.keys.device)
        return KVSpan(self.meta.select(index), self.keys.index_select(2, device_index),
                      self.values.index_select(2, device_index))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def state(self) -> dict:
        """Plain CPU tensors (copies), for torch.save or an archive's own encoding."""
        cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
        return {"meta": self.meta.state(), "keys": cpu(self.keys), "values": cpu(self.values)}

    @classmethod
    def from_state(cls, state: dict, device: torch.device | str | None = None) -> "KVSpan":
        """The span of a `state()`; its KV tensors are the state's own unless moved to another device."""
        return cls(TokenMeta.from_state(state["meta"]), state["keys"], state["values"]).to(device)
