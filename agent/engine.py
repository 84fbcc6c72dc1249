"""Prefill and decode over the managed store (gpt-fast style: small functions, one readable loop).

The store persists across turns, so a turn prefills only its new tokens. Before each forward the store's
policy makes room for the incoming tokens; a long message is prefilled in chunks so it never outgrows the
budget. Every forward leaves the logits that predict the next token in `store.next_logits`.
Several stores can be fed in one forward (`prefill_packed`): their tokens are packed along the token
axis and attention (cache/attention.py) keeps each against its own store. On a CPU a forward of a few
dozen tokens costs about as much as reading the weights, so the evaluation harness feeds all its cache
policies' turns this way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from agent.lean import lean_forward
from cache.attention import Piece, causal_mask
from cache.store import KVStore


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class Feed:
    """What one store is to be fed: token ids with their metadata (a role, turn and segment per token;
    `turn` and `segment` are those of tokens added without their own)."""

    store: KVStore
    turn: int
    segment: int
    ids: list[int] = field(default_factory=list)
    marks: list[tuple[str, int, int]] = field(default_factory=list)  # (role, turn, segment), one per id

    def add(self, ids: list[int], role: str, turn: int | None = None, segment: int | None = None) -> "Feed":
        """Append ids of one role; `turn`/`segment` override the feed's (the profile block is turn -2)."""
        mark = (role, self.turn if turn is None else turn, self.segment if segment is None else segment)
        self.ids += ids
        self.marks += [mark] * len(ids)
        return self

    def then(self, other: "Feed") -> "Feed":
        """This feed followed by another of the same store, as one feed."""
        if other.store is not self.store:
            raise ValueError("Feed.then joins feeds of one store")
        self.ids += other.ids
        self.marks += other.marks
        return self

    def declare(self, start: int, count: int) -> None:
        """store.expect the metadata of ids[start:start+count], one call per run of equal marks."""
        end = start + count
        while start < end:
            run = start
            while run < end and self.marks[run] == self.marks[start]:
                run += 1
            role, turn, segment = self.marks[start]
            self.store.expect(run - start, turn, role, segment, self.ids[start:run])
            start = run


@torch.inference_mode()
def _packed(model: torch.nn.Module, stores: list[KVStore], ids: list[list[int]], positions: list[torch.Tensor],
            masks: list[torch.Tensor | None], keep: list[int]) -> torch.Tensor:
    """One forward over several sequences packed along the token axis: the weights are read once for all
    of them and attention keeps each against its own store. Returns the logits at the `keep` indices."""
    device = next(model.parameters()).device
    pieces = []
    for store, seq, mask in zip(stores, ids, masks):
        if mask is None and len(seq) > 1 and store.length:
            mask = causal_mask(len(seq), store.length + len(seq), device)
        pieces.append(Piece(store, len(seq), None if mask is None else mask.to(device)))
    tokens = torch.tensor([[t for seq in ids for t in seq]], device=device)
    where, kept = torch.cat(positions)[None].to(device), torch.tensor(keep, device=device)
    lean = lean_forward(model)
    if lean is not None:
        return lean(tokens, where, pieces, kept)
    return model(input_ids=tokens, position_ids=where, use_cache=False, logits_to_keep=kept, kv_pieces=pieces).logits[0]


def forward_packed(model: torch.nn.Module, stores: list[KVStore], ids: list[list[int]]) -> None:
    """Append ids[i] to stores[i] (metadata already declared with expect), all in one forward, each
    continuing its sequence causally, and leave each store's next-token logits in it; surprisal is
    filled for the stores that measure it (which needs the logits of every position)."""
    kept = [len(seq) if store.measuring_surprisal else 1 for store, seq in zip(stores, ids)]
    keep, end = [], 0
    for seq, count in zip(ids, kept):
        end += len(seq)
        keep += range(end - count, end)
    positions = [torch.arange(store.length, store.length + len(seq)) for store, seq in zip(stores, ids)]
    logits = torch.split(_packed(model, stores, ids, positions, [None] * len(stores), keep), kept)
    for store, seq, part in zip(stores, ids, logits):
        store.observe_logits(seq, part)


def forward(model: torch.nn.Module, store: KVStore, ids: list[int]) -> torch.Tensor:
    """Append `ids` to one store; its next-token logits."""
    forward_packed(model, [store], [ids])
    return store.next_logits


def forward_forks(model: torch.nn.Module, stores: list[KVStore], ids: list[list[int]], positions: list[torch.Tensor],
                  masks: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Feed each store `ids[i]` at explicit positions under an explicit [1, 1, len, kv_len] bool mask (None:
    causal), all in one forward, and return the logits of every fed position, per store. Scoring feeds
    several candidate replies side by side this way, inside a fork of each store."""
    logits = _packed(model, stores, ids, positions, masks, list(range(sum(len(seq) for seq in ids))))
    return [part.float() for part in torch.split(logits, [len(seq) for seq in ids])]


def prefill_packed(model, feeds: list[Feed]) -> None:
    """Feed every store its ids, all stores sharing each forward, in policy-sized chunks (each store's
    policy evicts before each of its chunks)."""
    fed = [0] * len(feeds)
    while active := [i for i, feed in enumerate(feeds) if fed[i] < len(feed.ids)]:
        pieces = []
        for i in active:
            feed = feeds[i]
            piece = feed.ids[fed[i] : fed[i] + (feed.store.policy.max_chunk() or len(feed.ids))]
            feed.store.make_room(len(piece))
            feed.declare(fed[i], len(piece))
            fed[i] += len(piece)
            pieces.append(piece)
        forward_packed(model, [feeds[i].store for i in active], pieces)


def prefill(model, store: KVStore, ids: list[int], turn: int, role: str, segment: int) -> torch.Tensor:
    """Feed one store `ids` of one role in policy-sized chunks, evicting before each; its next-token logits."""
    prefill_packed(model, [Feed(store, turn, segment).add(ids, role)])
    return store.next_logits


def greedy(logits: torch.Tensor) -> int:
    """The index of the first maximum. On the CPU through numpy: 3 us over this vocabulary, where
    torch.argmax takes 60-130 us, as long as an int4 layer's products."""
    if logits.device.type == "cpu":
        return int(logits.detach().float().reshape(-1).numpy().argmax())
    return int(torch.argmax(logits))


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    if config.temperature <= 0:
        return greedy(logits)
    logits = logits / config.temperature
    if config.top_k > 0:
        kth = torch.topk(logits, min(config.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > config.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def decode(model, store: KVStore, stop: list[int], config: SamplingConfig, turn: int, segment: int) -> Iterator[int]:
    """Sample from the store's next-token logits, yield and feed tokens one at a time until an
    end-of-turn token or `max_new_tokens`. The stop token itself is not fed: the next turn's pre-warm
    feeds the closing framing."""
    generator = torch.Generator().manual_seed(config.seed) if config.temperature > 0 else None
    for _ in range(config.max_new_tokens):
        token = sample(store.next_logits, config, generator)
        if token in stop:
            return
        try:
            yield token
        finally:  # fed even when the caller stops reading here: what it was given is in the cache
            store.make_room(1)
            store.expect(1, turn, "assistant", segment, [token])
            forward(model, store, [token])
