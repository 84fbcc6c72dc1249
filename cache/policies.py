"""Cache policies decide *what* to keep under a token budget; the store does the keeping.

kvpress-style: a policy gives every cached token a score and marks the tokens it promises to keep
(sinks, a recent window); one shared mechanism, `select`, keeps pinned tokens, then promised ones, then
the best-scored, up to the target. Eviction happens in steps of `slack` tokens below the budget so that
decode does not compact after every token."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from cache.meta import TokenMeta
from cache.store import KVStore

PINNED, PROMISED = 2e30, 1e30
MIN_BUDGET = 16


@dataclass(frozen=True)
class Budget:
    """A KV budget as the user writes it: `1024` (tokens), `25%` (of a reference cache size, e.g. the
    longest full dialogue cache in an evaluation) or `none` (unbounded)."""

    value: int | None
    percent: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Budget":
        if spec.strip().lower() in ("none", "full"):
            return cls(None)
        match = re.fullmatch(r"(\d+)(%?)", spec.strip())
        if not match or int(match.group(1)) == 0:
            raise ValueError(f"--budget must be a token count like 1024, a percentage like 25% or 'none', got {spec!r}")
        budget = cls(int(match.group(1)), bool(match.group(2)))
        if budget.percent and budget.value > 100:
            raise ValueError(f"--budget percentage must be at most 100%, got {spec!r}")
        return budget

    def tokens(self, reference: int | None = None) -> int | None:
        """The budget in tokens; a percentage needs the `reference` size it is a share of."""
        if self.value is None:
            return None
        if self.percent and reference is None:
            raise ValueError(f"--budget {self} is a share of a reference cache, which only an evaluation has; give tokens")
        tokens = reference * self.value // 100 if self.percent else self.value
        if tokens < MIN_BUDGET:
            raise ValueError(f"--budget {self} is {tokens} tokens; a cache policy needs at least {MIN_BUDGET}")
        return tokens

    def __str__(self) -> str:
        return "none" if self.value is None else f"{self.value}{'%' if self.percent else ''}"


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
    needs_surprisal = False

    def __init__(self, config: PolicyConfig):
        if config.budget is not None and config.budget < MIN_BUDGET:
            raise ValueError(f"budget {config.budget} is too small: a cache policy needs at least {MIN_BUDGET} tokens")
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

    def tiers(self, meta: TokenMeta) -> dict[str, torch.Tensor]:
        """Boolean masks of the tiers this policy manages (none for single-tier policies)."""
        return {}

    def select(self, meta: TokenMeta, target: int) -> torch.Tensor:
        """Indices of the tokens to keep: pinned, then promised, then by score, `target` at most."""
        priority = self.scores(meta).clone()
        priority[self.promised(meta, target)] = PROMISED
        priority[meta.pinned] = PINNED
        return torch.topk(priority, k=min(target, len(meta))).indices.sort().values

    def room_for(self, meta: TokenMeta, incoming: int) -> torch.Tensor | None:
        """The tokens to keep so that `incoming` more fit within the budget; None if they fit already."""
        if self.budget is None or len(meta) + incoming <= self.budget:
            return None
        return self.select(meta, max(0, self.budget - incoming - self.slack))

    def make_room(self, store: KVStore, incoming: int) -> bool:
        """Evict so that `incoming` more tokens fit within the budget; whether that took an eviction."""
        kept = self.room_for(store.meta, incoming)
        if kept is not None:
            store.keep(kept, reserve=incoming)
        return kept is not None

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


@dataclass
class HybridConfig:
    """Tier shares of the budget (lent to each other when unused) and how the temporary tier is ranked."""

    permanent_share: float = 0.10  # system prompt, profile, summary, pins: never evicted
    hot_share: float = 0.30  # the last `hot_turns` turns used, whole (LRU: the oldest is demoted first)
    hot_turns: int = 4
    granularity: str = "token"  # temporary tier evicted by "token" or by whole "segment"
    score: str = "mix"  # temporary ranking: "attention" (H2O mass received), "surprisal" (when fed), or "mix" (both)
    context: int = 2  # tokens kept on each side of a kept temporary token, so a fact keeps its frame


def last_used(meta: TokenMeta) -> torch.Tensor:
    """The turn each token last entered the conversation: the turn it was fed at, or the turn it was
    recalled at from the archive if later. Recall counts as use, so a recalled span is as hot as the
    turn that asked for it, not as cold as the turn it was first said in."""
    return torch.maximum(meta.turn, meta.recalled_at)


class Hybrid(Policy):
    """Three tiers: permanent (never evicted), hot (the recently used turns, whole; a turn's tokens
    recalled from the archive count as used at the turn they were recalled at) and temporary (older
    material ranked by information: attention mass received and/or surprisal when it was fed). Unused
    share of one tier is lent to the others; pins count against the budget."""

    name = "hybrid"

    def __init__(self, config: PolicyConfig, hybrid: HybridConfig | None = None):
        super().__init__(config)
        self.hybrid = hybrid or HybridConfig()
        shares = self.hybrid.permanent_share + self.hybrid.hot_share
        if not 0 < shares < 1 or min(self.hybrid.permanent_share, self.hybrid.hot_share) < 0:
            raise ValueError("hybrid shares must be >= 0 and leave a temporary share above 0")
        if self.hybrid.granularity not in ("token", "segment") or self.hybrid.score not in ("attention", "surprisal", "mix"):
            raise ValueError(f"unknown hybrid granularity/score {self.hybrid.granularity!r}/{self.hybrid.score!r}")

    @property
    def needs_importance(self) -> bool:  # attention mass costs an extra QK^T per layer: only when ranked by it
        return self.hybrid.score in ("attention", "mix")

    @property
    def needs_surprisal(self) -> bool:
        return self.hybrid.score in ("surprisal", "mix")

    def tiers(self, meta: TokenMeta) -> dict[str, torch.Tensor]:
        """Boolean masks: which tokens belong to which tier (before any eviction decision)."""
        permanent = (meta.turn < 0) | meta.pinned
        used = last_used(meta)
        recent_turns = torch.unique(used[~permanent])[-self.hybrid.hot_turns:]
        hot = torch.isin(used, recent_turns) & ~permanent
        return {"permanent": permanent, "hot": hot, "temporary": ~(permanent | hot)}

    def scores(self, meta):
        def normalised(values: torch.Tensor) -> torch.Tensor:
            return values / values.max().clamp_min(1e-9) if values.numel() else values

        attention, surprisal = normalised(meta.importance), normalised(meta.surprisal)
        return {"attention": attention, "surprisal": surprisal, "mix": attention + surprisal}[self.hybrid.score]

    def select(self, meta, target):
        tiers = self.tiers(meta)
        keep = tiers["permanent"].clone()  # never evicted, even past its share (reported in stats)
        room = target - int(keep.sum())
        temporary_share = int(target * (1 - self.hybrid.permanent_share - self.hybrid.hot_share))
        hot_room = max(0, room - min(temporary_share, int(tiers["temporary"].sum())))
        keep |= self._recent_whole_turns(meta, tiers["hot"], hot_room)
        room = target - int(keep.sum())
        if room > 0:
            keep |= self._best_temporary(meta, ~keep, room)
        return torch.nonzero(keep).flatten()

    @staticmethod
    def _recent_whole_turns(meta: TokenMeta, hot: torch.Tensor, room: int) -> torch.Tensor:
        """The most recently used hot turns that fit whole; if even the newest does not fit, its most
        recent tokens."""
        keep = torch.zeros_like(hot)
        used = last_used(meta)
        for turn in torch.unique(used[hot]).flip(0):
            members = hot & (used == turn)
            size = int(members.sum())
            if size <= room:
                keep |= members
                room -= size
            else:
                if not keep.any():
                    keep[torch.nonzero(members).flatten()[-room:] if room else []] = True
                break
        return keep

    def _best_temporary(self, meta: TokenMeta, candidates: torch.Tensor, room: int) -> torch.Tensor:
        """Fill `room` with the best-ranked candidates. Token granularity keeps each chosen token with
        `context` neighbours (the largest top-k whose spans fit, found by bisection, then single tokens)
        and ranks a token by the summed score of that span: a fact's information is spread over several
        tokens (this tokenizer splits numbers into single digits of ~3 nats each, while one unexpected
        word at the start of a message can carry 10), so what a kept span holds is its total.
        Segment granularity ranks whole segments by their mean score."""
        score = self.scores(meta)
        width = 0 if self.hybrid.granularity == "segment" else self.hybrid.context
        if width:  # rank by the span a kept token brings along (a sum; the mean ranks the same)
            score = torch.nn.functional.avg_pool1d(score[None, None], 2 * width + 1, 1, width)[0, 0]
        if self.hybrid.granularity == "segment":
            segment_ids, inverse = torch.unique(meta.segment, return_inverse=True)
            totals = torch.zeros(segment_ids.numel()).index_add_(0, inverse, score)
            counts = torch.zeros(segment_ids.numel()).index_add_(0, inverse, torch.ones_like(score))
            score = (totals / counts)[inverse] - meta.position.float() * 1e-9  # whole segments, newest first
        order = torch.argsort(score.masked_fill(~candidates, float("-inf")), descending=True)[: int(candidates.sum())]

        def spread(count: int) -> torch.Tensor:
            chosen = torch.zeros(len(meta))
            chosen[order[:count]] = 1.0
            if width:
                chosen = torch.nn.functional.max_pool1d(chosen[None, None], 2 * width + 1, 1, width)[0, 0]
            return (chosen > 0) & candidates

        low, high = 0, min(room, order.numel())
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if int(spread(middle).sum()) <= room else (low, middle - 1)
        keep = spread(low)
        rest = order[~keep[order]][: room - int(keep.sum())]
        keep[rest] = True
        return keep


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Window, Sink, H2O, Hybrid)}


def make_policy(name: str, config: PolicyConfig, hybrid: HybridConfig | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    return Hybrid(config, hybrid) if name == "hybrid" else POLICIES[name](config)
