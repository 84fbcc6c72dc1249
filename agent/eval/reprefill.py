"""The naive baseline the cache policies are measured against: no KV reuse at all.

Whenever it must answer, it re-encodes the whole chat-template history (up to and including the user's
message and the assistant header) into a fresh store that evicts nothing, through the engine's forward
as every policy is, so its time to first token grows with the dialogue and a dialogue costs quadratic
work. Between answers it holds no cache."""

from __future__ import annotations

import time
from collections import Counter

from agent.chat_format import ChatFormat
from agent.engine import Feed, SamplingConfig, decode, prefill
from agent.model import LoadedModel
from agent.scoring import score_together
from cache.policies import PolicyConfig, make_policy
from cache.storage import StorageConfig
from cache.store import KVStore


class Reprefill:
    """Runs a scripted dialogue the naive way (agent/eval/runners.py: Runner)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.format = ChatFormat.from_tokenizer(loaded.tokenizer)
        self.bytes_per_token = loaded.kv_bytes_per_token()
        self.storage = StorageConfig(str(loaded.dtype).removeprefix("torch."))

    def start(self, system: str | None) -> None:
        self.ids: list[int] = []
        self.per_turn: Counter[int] = Counter()
        self.turn = 0
        self.store: KVStore | None = None
        self._append(self.format.system_prompt(system), -1)

    def _append(self, ids: list[int], turn: int) -> None:
        self.ids += ids
        self.per_turn[turn] += len(ids)

    def user_turn(self, text: str) -> float:
        """Append the user's message and re-encode everything into a fresh store, as the naive way must to
        answer. Returns the time to the first token's logits in ms."""
        self._append(self.format.user_message(text), self.turn)
        started = time.perf_counter()
        self.store = KVStore.for_model(self.loaded.model, make_policy("full", PolicyConfig()), self.storage)
        prefill(self.loaded.model, self.store, self.ids, self.turn, "user", 0)
        return (time.perf_counter() - started) * 1000

    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]:
        """A turn whose answer is not needed: only the history grows; nothing to feed."""
        self._append(self.format.user_message(text), self.turn)
        return self.reply(reply)

    def settle(self) -> None:
        """Nothing follows a reply: no cache, no memory."""

    def memory(self) -> None:
        return None

    def close(self) -> None:
        """Nothing outlives a dialogue but its token ids."""

    def scoring_store(self) -> None:
        """Scored alone: its long history would slow the packed forward the cached policies share."""
        return None

    def score(self, choices: list[str]) -> list[float]:
        """Total log-probability of each choice after this turn's history, all choices in one forward over
        the re-encoded store, rolled back (agent/scoring.py)."""
        return score_together(self.loaded.model, self.format, [self.store], choices)[0]

    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy reply from this turn's encode, rolled back; returns the ids and seconds spent."""
        started = time.perf_counter()
        with self.store.fork():
            ids = list(decode(self.loaded.model, self.store, self.format.end_of_turn,
                              SamplingConfig(max_new_tokens=max_new_tokens), self.turn, 0))
        return ids, time.perf_counter() - started

    def reply(self, text: str | None) -> list[Feed]:
        """Append the scripted reply (if any) and the next user header; drop the store. Nothing to feed:
        the history is only encoded when an answer is needed."""
        reply = self.format.assistant_reply(text) if text is not None else []
        self._append(reply + self.format.next_user_header(), self.turn)
        self.turn += 1
        self.store = None
        return []

    def resident(self) -> Counter[int]:
        """Every token is re-encoded, so every turn is fully present."""
        return self.per_turn

    def kv_tokens(self) -> int:
        return len(self.ids)

    def kv_bytes(self) -> int:
        """The store a re-encode of the history builds (held only while answering)."""
        return len(self.ids) * self.bytes_per_token
