"""Runners: one surface over what evaluation drives through a scripted dialogue. `CacheRunner` drives an
`Agent` by teacher forcing through the Agent's own turn steps; `Reprefill` (agent/eval/reprefill.py)
keeps no cache at all. The harness packs the runners' feeds into shared forwards."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Protocol

import torch

from agent.agent import Agent, AgentConfig, Turn
from agent.engine import Feed, SamplingConfig, decode, prefill
from agent.model import LoadedModel
from cache.policies import HybridConfig, PolicyConfig, make_policy
from cache.storage import StorageConfig
from cache.store import KVStore
from memory.profile import ProfileConfig
from memory.recall import MemoryConfig


class Runner(Protocol):
    def start(self, system: str | None) -> None: ...
    def user_turn(self, text: str) -> float:
        """Prefill a user message alone; returns its time to first token's logits in ms."""
    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]:
        """A turn whose answer is not needed: everything it feeds, to be packed with other runners'."""
    def reply(self, text: str | None) -> list[Feed]:
        """After a probe: the reference reply and the next header, to be packed."""
    def settle(self) -> None:
        """After a turn's feeds: the work that follows a reply (archiving what was evicted)."""
    def memory(self) -> tuple[list[dict], float] | None:
        """With long-term memory: what the latest turn re-injected, and its memory milliseconds."""
    def scoring_store(self) -> KVStore | None:
        """The store to score choices against in a shared packed forward, or None to score alone."""
    def score(self, choices: list[str]) -> list[float]: ...
    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        """A greedy reply from the current state, rolled back; the ids and the seconds spent."""
    def resident(self) -> Counter[int]:
        """Tokens held per dialogue turn."""
    def kv_tokens(self) -> int: ...
    def kv_bytes(self) -> int: ...
    def close(self) -> None:
        """Release what the current dialogue holds (an archive's scratch directory)."""


class CacheRunner:
    """The Agent under one cache policy."""

    def __init__(self, loaded: LoadedModel, config: AgentConfig):
        self.loaded, self.config = loaded, config
        self.agent: Agent | None = None

    def start(self, system: str | None) -> None:
        self.close()
        self.agent = Agent(self.loaded, replace(self.config, system=system))
        self.turn: Turn | None = None

    def close(self) -> None:
        """Close the dialogue's agent now: its archive's scratch directory would otherwise wait for the
        cycle collector, which a worker process terminated by its pool never runs."""
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def user_turn(self, text: str) -> float:
        started = time.perf_counter()
        self.turn = self.agent.observe(text)
        self.agent.recall(self.turn)
        self.agent.prefill(self.turn)
        return (time.perf_counter() - started) * 1000

    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]:
        turn = self.agent.observe(text)
        self.agent.recall(turn)
        self.agent.note_reply(turn, reply)
        user = self.agent.user_feed(turn)
        return [user.then(self.agent.reply_feed(turn, reply, ahead=len(user.ids)))]

    def reply(self, text: str | None) -> list[Feed]:
        self.agent.note_reply(self.turn, text)
        return [self.agent.reply_feed(self.turn, text)]

    def settle(self) -> None:
        self.agent.settle()

    def memory(self) -> tuple[list[dict], float] | None:
        memory = self.agent.memory
        return None if memory is None else ([r.as_dict() for r in memory.last], memory.last_ms)

    def scoring_store(self) -> KVStore:
        return self.agent.store

    def score(self, choices: list[str]) -> list[float]:
        return self.agent.score(choices)

    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        """Room for the draft is made first (what a chat's decode would evict stays evicted); the
        draft itself is decoded in a fork and rolled back, so the reference reply can follow."""
        agent, store = self.agent, self.agent.store
        started = time.perf_counter()
        store.make_room(max_new_tokens)
        with store.fork():
            ids = list(decode(agent.model, store, agent.format.end_of_turn, SamplingConfig(max_new_tokens=max_new_tokens),
                              self.turn.index, self.turn.segment))
        return ids, time.perf_counter() - started

    def resident(self) -> Counter[int]:
        turns, counts = torch.unique(self.agent.store.meta.turn, return_counts=True)
        return Counter(dict(zip(turns.tolist(), counts.tolist())))

    def kv_tokens(self) -> int:
        return self.agent.store.length

    def kv_bytes(self) -> int:
        return self.agent.store.memory_bytes()


class RecomputedScoring(CacheRunner):
    """`<policy>+memory-recompute`: the `+memory` run, each probe scored on its cache's tokens, in their
    order, re-encoded from scratch: what recomputing the re-injected KV (CacheBlend, EPIC) could restore at
    best. The cache itself follows the `+memory` run's path exactly, so the two lanes differ only in the KV
    the probes read: spliced (its keys re-rotated, its values from the context it was first encoded in) or
    computed fresh in the context it sits in now."""

    def scoring_store(self) -> KVStore:
        live = self.agent.store
        ids = live.meta.token.tolist()
        if min(ids, default=0) < 0:
            raise ValueError("the cache holds tokens of unknown id: it cannot be re-encoded")
        store = KVStore.for_model(self.loaded.model, make_policy("full", PolicyConfig()), self.config.storage)
        prefill(self.loaded.model, store, ids, int(live.meta.turn[-1]), "user", -1)
        return store


BASELINE = "reprefill"
MEMORY = "+memory"  # a policy name's suffix: that policy with long-term memory (and the topic classifier)
MEMORY_TEXT = "+memory-text"  # the same, recalled turns re-prefilled as text instead of spliced as KV (baseline)
GRAPH = "+graph"  # long-term memory whose recall the entity graph's resolved references also steer
NOTES = "+notes"  # long-term memory with the profile and running summary as notes in the permanent tier
PALACE = "+palace"  # both: the whole memory palace (the cache drops what corrections superseded: AgentConfig.forget_stale)
KEEP = "+palace-keep"  # the palace with superseded values left in the cache (the default until the twenty-second session)
RECOMPUTE = "+memory-recompute"  # the +memory run, its probes scored on its cache's tokens re-encoded (RecomputedScoring)
TOPICS = "+topics"  # no memory: the topic classifier's segments, which the hybrid evicts whole (granularity "segment")
KINDS = ("", MEMORY, MEMORY_TEXT, RECOMPUTE, GRAPH, NOTES, PALACE, KEEP, TOPICS)


def make_runner(policy: str, budget: int | None, kv_dtype: str, loaded: LoadedModel,
                memory: MemoryConfig = MemoryConfig(), profile: ProfileConfig = ProfileConfig()) -> Runner:
    """`memory`: the long-term memory of "<policy>+memory" runs, each dialogue its own session; `profile`:
    the notes of the runs that keep them."""
    from agent.eval.reprefill import Reprefill

    if policy == BASELINE:
        return Reprefill(loaded)
    cache_policy, plus, kind = policy.partition("+")
    if plus + kind not in KINDS:
        raise ValueError(f"unknown policy {policy!r}: a cache policy, optionally with {', '.join(KINDS[1:])}")
    kind = plus + kind
    if kind == MEMORY_TEXT:
        memory = replace(memory, reinject="text")
    if kind == NOTES:
        memory = replace(memory, referents=False)
    notes = kind in (NOTES, PALACE, KEEP)
    runner = RecomputedScoring if kind == RECOMPUTE else CacheRunner
    return runner(loaded, AgentConfig(policy=cache_policy, budget_tokens=budget, storage=StorageConfig(kv_dtype),
                                      hybrid=HybridConfig(granularity="segment" if kind == TOPICS else "token"),
                                      topics=bool(kind), memory=memory if kind and kind != TOPICS else None,
                                      graph=kind in (GRAPH, NOTES, PALACE, KEEP), forget_stale=kind == PALACE,
                                      profile=profile if notes else None))
