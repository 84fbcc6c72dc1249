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
    """Tensors are [kv_heads, n_tokens, head_dim] per layer; one entry of the per-token tensors per token.
    `id` is None until an Archive assigns one."""

    user_id: str
    session_id: str
    tokens: list[int]
    text: str
    turn: int
    role: str
    topic: int  # topic segment id
    positions: torch.Tensor  # long [n_tokens]: RoPE position each key is rotated to
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
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
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        for name, layers in (("keys", self.keys), ("values", self.values)):
            shapes = {tuple(t.shape) for t in layers}
            if len(shapes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[1] != count:
                raise ValueError(f"{name} must be [kv_heads, {count}, head_dim] in every layer, got {sorted(shapes)}")
            if not all(t.is_floating_point() for t in layers):
                raise ValueError(f"{name} must be floating point")
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
        return len(self.keys)

    @classmethod
    def from_span(cls, span: KVSpan, user_id: str, session_id: str, text: str, kind: str = "turn") -> "Segment":
        """An evicted span as an archive segment (a span holds one turn and one role: cache/store.py)."""
        meta = span.meta
        return cls(user_id, session_id, meta.token.tolist(), text, int(meta.turn[0]), ROLE_NAMES[int(meta.role[0])],
                   int(meta.segment[0]), meta.position.clone(), list(span.keys), list(span.values),
                   meta.importance.clone(), meta.surprisal.clone(), meta.serial.clone(), kind)

    def to_span(self) -> KVSpan:
        """The segment as a span to splice into a live cache (`KVStore.inject`); not pinned, not yet recalled."""
        count = self.n_tokens
        full = lambda value: torch.full((count,), value, dtype=torch.long)  # noqa: E731
        meta = TokenMeta(torch.tensor(self.tokens, dtype=torch.long), full(self.topic), full(self.turn),
                         full(ROLES[self.role]), self.positions.cpu(), torch.zeros(count, dtype=torch.bool),
                         self.importance.cpu().float(), self.surprisal.cpu().float(), self.serials.cpu(),
                         full(NOT_RECALLED))
        return KVSpan(meta, list(self.keys), list(self.values))


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
