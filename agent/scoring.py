"""Scoring a probe's choices in one forward instead of one per choice.

On CPU a forward of a few tokens costs about as much as reading the weights once, so k choices in
k forwards cost k times that. Here all choices are fed as one sequence after the shared history: each
choice gets the positions it would have alone and a mask that lets it see the history and its own
earlier tokens only, so every choice's log-probability equals the one-at-a-time score. Several stores
(one per cache policy, in evaluation) are scored in one forward, each inside a fork that rolls it back."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from agent.chat_format import ChatFormat
from agent.engine import forward_forks
from cache.store import KVStore


@dataclass
class ChoiceBatch:
    replies: list[list[int]]  # per choice: its reply ids plus the token that closes the reply

    @classmethod
    def build(cls, fmt: ChatFormat, choices: list[str]) -> "ChoiceBatch":
        return cls([fmt.assistant_reply(choice) + fmt.next_user_header()[:1] for choice in choices])

    @property
    def ids(self) -> list[int]:
        """What is fed: each reply but its last token (the first token is predicted by the history)."""
        return [token for reply in self.replies for token in reply[:-1]]

    def _owner(self) -> torch.Tensor:
        return torch.cat([torch.full((len(reply) - 1,), k) for k, reply in enumerate(self.replies)])

    def positions(self, start: int) -> torch.Tensor:
        """[1, fed]: every choice continues at `start`, as if it were the only one."""
        return torch.cat([torch.arange(start, start + len(reply) - 1) for reply in self.replies])[None]

    def mask(self, start: int) -> torch.Tensor:
        """[1, 1, fed, start + fed] bool: the history, then causal within each choice only."""
        owner = self._owner()
        index = torch.arange(owner.numel())
        own = (owner[:, None] == owner[None, :]) & (index[None, :] <= index[:, None])
        return torch.cat([torch.ones(owner.numel(), start, dtype=torch.bool), own], dim=1)[None, None]

    def totals(self, first_logits: torch.Tensor, logits: torch.Tensor | None) -> list[float]:
        """Total log-probability per choice from the history's last logits and the fed positions' logits."""
        first = torch.log_softmax(first_logits.float(), dim=-1)
        fed = torch.log_softmax(logits.float(), dim=-1) if logits is not None else None
        totals, offset = [], 0
        for reply in self.replies:
            total = float(first[reply[0]])
            if len(reply) > 1:
                targets = torch.tensor(reply[1:], device=fed.device)[:, None]
                total += float(fed[offset : offset + len(reply) - 1].gather(1, targets).sum())
                offset += len(reply) - 1
            totals.append(total)
        return totals


def score_together(model: torch.nn.Module, fmt: ChatFormat, stores: list[KVStore], choices: list[str]) -> list[list[float]]:
    """Total log-probability of each choice as the continuation of each store, all stores in one
    forward: every store's choices are fed side by side after its history (each masked to see the
    history and itself only) inside a fork, so every store is left exactly as it was."""
    batch = ChoiceBatch.build(fmt, choices)
    if not batch.ids:
        return [batch.totals(store.next_logits, None) for store in stores]
    with ExitStack() as forks:
        for store in stores:
            forks.enter_context(store.fork())
        lengths = [store.length for store in stores]
        for store in stores:
            turn = int(store.meta.turn[-1]) if len(store.meta) else -1
            store.expect(len(batch.ids), turn, "assistant", -1, batch.ids)
        logits = forward_forks(model, stores, [batch.ids] * len(stores),
                               [batch.positions(length)[0] for length in lengths], [batch.mask(length) for length in lengths])
        return [batch.totals(store.next_logits, fed) for store, fed in zip(stores, logits)]
