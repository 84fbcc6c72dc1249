"""Prefill and decode over the managed store (gpt-fast style: small functions, one readable loop).

The store persists across turns, so a turn prefills only its new tokens. Before each forward the policy
makes room for the incoming tokens; a long message is prefilled in chunks so it never outgrows the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from cache.policies import Policy
from cache.store import KVStore


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@torch.inference_mode()
def forward(model: torch.nn.Module, store: KVStore, ids: list[int]) -> torch.Tensor:
    """Append `ids` (metadata already declared with store.expect) and return the last position's logits."""
    device = next(model.parameters()).device
    start = store.length
    input_ids = torch.tensor([ids], device=device)
    positions = torch.arange(start, start + len(ids), device=device)[None]
    keep = 0 if store.measuring_surprisal else 1
    out = model(input_ids=input_ids, position_ids=positions, cache=store, use_cache=True, logits_to_keep=keep,
                kv_store=store)
    if store.measuring_surprisal:
        store.add_surprisal(ids, out.logits[0])
    return out.logits[0, -1].float()


@torch.inference_mode()
def forward_all(model: torch.nn.Module, store: KVStore, ids: list[int], positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed `ids` and return logits for every fed position. By default they continue the sequence
    causally; scoring several candidate replies in one forward passes explicit positions and a
    [1, 1, len(ids), kv_len] bool mask instead."""
    device = next(model.parameters()).device
    if positions is None:
        positions = torch.arange(store.length, store.length + len(ids))[None]
    out = model(input_ids=torch.tensor([ids], device=device), position_ids=positions.to(device), cache=store,
                use_cache=True, attention_mask=None if mask is None else mask.to(device), kv_store=store)
    return out.logits[0].float()


def prefill(model, store: KVStore, policy: Policy, ids: list[int], turn: int, role: str, segment: int) -> torch.Tensor:
    """Feed `ids` in policy-sized chunks, evicting before each, and return the last logits."""
    chunk = policy.max_chunk() or max(1, len(ids))
    logits = None
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        policy.make_room(store, len(piece))
        store.expect(len(piece), turn, role, segment, piece)
        logits = forward(model, store, piece)
    return logits


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    if config.temperature <= 0:
        return int(torch.argmax(logits))
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


def decode(model, store: KVStore, policy: Policy, logits: torch.Tensor, stop: list[int], config: SamplingConfig,
           turn: int, segment: int) -> Iterator[int]:
    """Sample, yield and feed tokens one at a time until an end-of-turn token or `max_new_tokens`.
    The stop token itself is not fed: the next turn's pre-warm feeds the closing framing."""
    generator = torch.Generator().manual_seed(config.seed) if config.temperature > 0 else None
    for _ in range(config.max_new_tokens):
        token = sample(logits, config, generator)
        if token in stop:
            return
        yield token
        policy.make_room(store, 1)
        store.expect(1, turn, "assistant", segment, [token])
        logits = forward(model, store, [token])
