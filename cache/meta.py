"""Per-token metadata of a KV cache, column-wise: what the policies rank by and what an archived span
carries with it. One row per cached token, always in the tensors' order.

Columns are always built as normal tensors, even inside inference mode (feeds and splices run there): the
store writes them in place (pins, importance, surprisal), which inference tensors refuse outside it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

ROLES = {"system": 0, "user": 1, "assistant": 2}
NOT_RECALLED = -1  # recalled_at of a token fed normally


@dataclass
class TokenMeta:
    """Column-wise metadata, one entry per cached token, always aligned with the tensors."""

    token: torch.Tensor  # long: token id (-1 when not given), for finding text to pin
    segment: torch.Tensor  # long: topic segment id
    turn: torch.Tensor  # long: dialogue turn (-1 = system prompt)
    role: torch.Tensor  # long: ROLES
    position: torch.Tensor  # long: RoPE position the key is rotated to
    pinned: torch.Tensor  # bool: never evicted while pinned
    importance: torch.Tensor  # float: accumulated attention mass received
    surprisal: torch.Tensor  # float: -log p(token | what preceded it), its information content when fed
    serial: torch.Tensor  # long: index in the whole conversation stream; never reused, kept through compaction
    recalled_at: torch.Tensor  # long: turn recall last brought its turn back at (re-injected or held), else NOT_RECALLED

    @classmethod
    def empty(cls) -> "TokenMeta":
        return cls.new(0, 0, 0, "system", 0)

    @classmethod
    @torch.inference_mode(False)
    def new(cls, count: int, start: int, turn: int, role: str, segment: int,
            ids: list[int] | None = None, serial: int | None = None) -> "TokenMeta":
        """`count` fresh tokens at positions start.. with serials from `serial` (default `start`: a
        stream that was never compacted)."""
        full = lambda value: torch.full((count,), value, dtype=torch.long)  # noqa: E731
        tokens = torch.tensor(ids, dtype=torch.long) if ids is not None else full(-1)
        first = start if serial is None else serial
        return cls(tokens, full(segment), full(turn), full(ROLES[role]), torch.arange(start, start + count),
                   torch.zeros(count, dtype=torch.bool), torch.zeros(count), torch.zeros(count),
                   torch.arange(first, first + count), full(NOT_RECALLED))

    def __len__(self) -> int:
        return self.turn.numel()

    @torch.inference_mode(False)
    def cat(self, *others: "TokenMeta") -> "TokenMeta":
        """These rows, then each of `others`' (one concatenation per column, however many)."""
        parts = (self, *others)
        return TokenMeta(*(torch.cat([getattr(part, f.name) for part in parts]) for f in fields(self)))

    @torch.inference_mode(False)
    def select(self, index: torch.Tensor | slice) -> "TokenMeta":
        return TokenMeta(*(getattr(self, f.name)[index] for f in fields(self)))

    def find(self, ids: list[int]) -> torch.Tensor:
        """Indices of every occurrence of the token sequence `ids`."""
        width = len(ids)
        if not width or self.token.numel() < width:
            return torch.zeros(0, dtype=torch.long)
        starts = torch.nonzero((self.token.unfold(0, width, 1) == torch.tensor(ids)).all(dim=1)).flatten()
        return (starts[:, None] + torch.arange(width)).flatten()

    @torch.inference_mode(False)
    def clone(self) -> "TokenMeta":
        return TokenMeta(*(getattr(self, f.name).clone() for f in fields(self)))

    def state(self) -> dict:
        return {f.name: getattr(self, f.name).clone() for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict) -> "TokenMeta":
        return cls(**{f.name: state[f.name].clone() for f in fields(cls)})
