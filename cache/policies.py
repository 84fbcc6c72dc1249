"""Cache policies decide *what* to keep under a token budget; the store does the keeping.

kvpress-style: a policy gives every cached token a score and marks the tokens it promises to keep
(sinks, a recent window); one shared mechanism, `select`, keeps pinned tokens, then promised ones, then
the best-scored, up to the target. Eviction happens in steps of `slack` tokens below the budget so that
decode does not compact after every token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.store import KVStore, TokenMeta

PINNED, PROMISED = 2e30, 1e30


@dataclass
class PolicyConfig:
    budget: int | None = None  # tokens; None = unbounded
    sink_tokens: int = 4  # StreamingLLM attention sinks
    recent_ratio: float = 0.5  # H2O: share of the target kept as the recent window
    slack: int | None = None  # tokens freed beyond what is needed; default budget // 16


class Policy:
    """Base: score = recency, nothing promised."""

    name = "base"
    needs_importance = False

    def __init__(self, config: PolicyConfig):
        if config.budget is not None and config.budget < 16:
            raise ValueError(f"budget {config.budget} is too small: a cache policy needs at least 16 tokens")
        self.config = config

    @property
    def budget(self) -> int | None:
        return self.config.budget

    @property
    def slack(self) -> int:
        if self.config.slack is not None:
            return self.config.slack
        return max(1, (self.config.budget or 0) // 16)

    def scores(self, meta: TokenMeta) -> torch.Tensor:
        return meta.position.float()

    def promised(self, meta: TokenMeta, target: int) -> torch.Tensor:
        return torch.zeros(len(meta), dtype=torch.bool)

    def select(self, meta: TokenMeta, target: int) -> torch.Tensor:
        """Indices of the tokens to keep: pinned, then promised, then by score, `target` at most."""
        priority = self.scores(meta).clone()
        priority[self.promised(meta, target)] = PROMISED
        priority[meta.pinned] = PINNED
        return torch.topk(priority, k=min(target, len(meta))).indices.sort().values

    def make_room(self, store: KVStore, incoming: int) -> None:
        """Evict so that `incoming` more tokens fit within the budget."""
        if self.budget is None or store.length + incoming <= self.budget:
            return
        target = max(0, self.budget - incoming - self.slack)
        store.keep(self.select(store.meta, target))

    def max_chunk(self) -> int | None:
        """Largest prefill chunk that still leaves room for what the policy promises."""
        return None if self.budget is None else max(1, self.budget // 4)


class Full(Policy):
    """No eviction: the reference every other policy is measured against."""

    name = "full"

    def __init__(self, config: PolicyConfig):
        super().__init__(PolicyConfig(budget=None))


class Window(Policy):
    """Static FIFO window: the most recent tokens only."""

    name = "window"


class Sink(Policy):
    """StreamingLLM: the first `sink_tokens` tokens (attention sinks) plus the most recent window."""

    name = "sink"

    def promised(self, meta, target):
        promised = torch.zeros(len(meta), dtype=torch.bool)
        promised[: min(self.config.sink_tokens, target)] = True
        return promised


class H2O(Policy):
    """Heavy hitters (accumulated attention mass) plus a recent window."""

    name = "h2o"
    needs_importance = True

    def scores(self, meta):
        return meta.importance

    def promised(self, meta, target):
        recent = int(target * self.config.recent_ratio)
        promised = torch.zeros(len(meta), dtype=torch.bool)
        if recent:
            promised[-recent:] = True
        return promised


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Window, Sink, H2O)}


def make_policy(name: str, config: PolicyConfig) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    return POLICIES[name](config)
