"""A segment: one archived span of dialogue (a turn, a summary...) with everything needed to splice it back
into a live cache without recomputing it: its token ids and text, where it sat in the dialogue, its original
RoPE positions, and its per-layer KV. Keys are stored rotated to `positions`, exactly as the cache held them,
so a splice at other positions re-rotates them by the difference (cache/rope.py) instead of re-prefilling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.meta import NOT_RECALLED, ROLES, TokenMeta
from cache.span import KVSpan

ROLE_NAMES = {code: name for name, code in ROLES.items()}


@dataclass
class Segment:
    """keys/values are [layers, kv_heads, n_tokens, head_dim]; one entry of the per-token tensors per token.
    `id` is None until an Archive assigns one."""

    user_id: str
    session_id: str
    tokens: list[int]
    text: str
    turn: int
    role: str
    topic: int  # topic segment id
    positions: torch.Tensor  # long [n_tokens]: RoPE position each key is rotated to
    keys: torch.Tensor
    values: torch.Tensor
    importance: torch.Tensor  # float [n_tokens]: accumulated attention mass
    surprisal: torch.Tensor  # float [n_tokens]: -log p(token | prefix)
    serials: torch.Tensor  # long [n_tokens]: index of each token in the conversation stream (cache/meta.py)
    kind: str = "turn"  # "turn", "summary", ...
    id: int | None = None

    def __post_init__(self) -> None:
        """Catch misaligned tensors here, where the caller can still see why, not at splice time."""
        count = len(self.tokens)
        if count == 0:
            raise ValueError("a segment needs at least one token")
        if not self.user_id or not self.session_id:
            raise ValueError("a segment needs a user_id and a session_id (they scope every search)")
        for name in ("keys", "values"):
            tensor = getattr(self, name)
            if tensor.dim() != 4 or not tensor.shape[0] or tensor.shape[2] != count:
                raise ValueError(f"{name} must be [layers >= 1, kv_heads, {count}, head_dim], got {list(tensor.shape)}")
            if not tensor.is_floating_point():
                raise ValueError(f"{name} must be floating point")
        if self.keys.shape[:3] != self.values.shape[:3]:
            raise ValueError(f"keys {list(self.keys.shape)} and values {list(self.values.shape)} differ in layers or heads")
        for name in ("positions", "importance", "surprisal", "serials"):
            if tuple(getattr(self, name).shape) != (count,):
                raise ValueError(f"{name} must have shape ({count},), got {tuple(getattr(self, name).shape)}")
        for name in ("positions", "serials"):
            if getattr(self, name).dtype != torch.long:
                raise ValueError(f"{name} must be long, got {getattr(self, name).dtype}")
        if not (self.importance.is_floating_point() and self.surprisal.is_floating_point()):
            raise ValueError("importance and surprisal must be float tensors")

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_layers(self) -> int:
        return self.keys.shape[0]

    @classmethod
    def from_span(cls, span: KVSpan, user_id: str, session_id: str, text: str, kind: str = "turn") -> "Segment":
        """An evicted span as an archive segment (a span holds one turn and one role: cache/store.py)."""
        meta = span.meta
        return cls(user_id, session_id, meta.token.tolist(), text, int(meta.turn[0]), ROLE_NAMES[int(meta.role[0])],
                   int(meta.segment[0]), meta.position.clone(), span.keys, span.values,
                   meta.importance.clone(), meta.surprisal.clone(), meta.serial.clone(), kind)

    def to_span(self) -> KVSpan:
        """The segment as a span to splice into a live cache (`KVStore.inject`); not pinned, not yet recalled."""
        count = self.n_tokens
        full = lambda value: torch.full((count,), value, dtype=torch.long)  # noqa: E731
        meta = TokenMeta(torch.tensor(self.tokens, dtype=torch.long), full(self.topic), full(self.turn),
                         full(ROLES[self.role]), self.positions.cpu(), torch.zeros(count, dtype=torch.bool),
                         self.importance.cpu().float(), self.surprisal.cpu().float(), self.serials.cpu(),
                         full(NOT_RECALLED))
        return KVSpan(meta, self.keys, self.values)


@dataclass(frozen=True)
class Record:
    """A segment's metadata without its KV: what metadata lookups return, so listing a topic reads no KV."""

    id: int
    user_id: str
    session_id: str
    kind: str
    role: str
    turn: int
    topic: int
    text: str
    n_tokens: int
