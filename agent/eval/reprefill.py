"""The naive baseline the cache policies are measured against: no KV reuse at all.

Whenever it must answer, it re-encodes the whole chat-template history (up to and including the user's
message and the assistant header) with a fresh transformers `DynamicCache`, so its time to first token
grows with the dialogue and a dialogue costs quadratic work. Between answers it holds no cache."""

from __future__ import annotations

import time
from collections import Counter

import torch
from transformers import DynamicCache

from agent.chat_format import ChatFormat
from agent.engine import Feed, greedy
from agent.model import LoadedModel
from agent.scoring import ChoiceBatch


class Reprefill:
    """Runs a scripted dialogue the naive way (agent/eval/runners.py: Runner)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.format = ChatFormat.from_tokenizer(loaded.tokenizer)
        self.bytes_per_token = loaded.kv_bytes_per_token()

    def start(self, system: str | None) -> None:
        self.ids: list[int] = []
        self.per_turn: Counter[int] = Counter()
        self.turn = 0
        self.cache: DynamicCache | None = None
        self.last_logits: torch.Tensor | None = None
        self._append(self.format.system_prompt(system), -1)

    def _append(self, ids: list[int], turn: int) -> None:
        self.ids += ids
        self.per_turn[turn] += len(ids)

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed `ids` over the current cache; the last position's logits."""
        out = self.loaded.model(input_ids=torch.tensor([ids], device=self.loaded.device), cache=self.cache,
                                use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def user_turn(self, text: str) -> float:
        """Append the user's message and re-encode everything, as the naive way must to answer.
        Returns the time to the first token's logits in ms."""
        self._append(self.format.user_message(text), self.turn)
        started = time.perf_counter()
        self.cache = DynamicCache(config=self.loaded.config)
        self.last_logits = self._forward(self.ids)
        return (time.perf_counter() - started) * 1000

    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]:
        """A turn whose answer is not needed: only the history grows; nothing to feed."""
        self._append(self.format.user_message(text), self.turn)
        return self.reply(reply)

    def settle(self) -> None:
        """Nothing follows a reply: no cache, no memory."""

    def memory(self) -> None:
        return None

    def scoring_store(self) -> None:
        """Scored alone, over its transient DynamicCache."""
        return None

    def score(self, choices: list[str]) -> list[float]:
        """Total log-probability of each choice after this turn's history, all choices in one forward
        over the history's keys (agent/scoring.py), then cropped back."""
        batch = ChoiceBatch.build(self.format, choices)
        logits = None
        if batch.ids:
            device, start = self.loaded.device, len(self.ids)
            with torch.inference_mode():
                out = self.loaded.model(input_ids=torch.tensor([batch.ids], device=device),
                                        position_ids=batch.positions(start).to(device),
                                        attention_mask=batch.mask(start).to(device), cache=self.cache,
                                        use_cache=True)
            logits = out.logits[0]
            self._crop()
        return batch.totals(self.last_logits, logits)

    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy reply from this turn's encode, cropped back; returns the ids and seconds spent."""
        started = time.perf_counter()
        logits, ids = self.last_logits, []
        for _ in range(max_new_tokens):
            token = greedy(logits)
            if token in self.format.end_of_turn:
                break
            ids.append(token)
            logits = self._forward([token])
        elapsed = time.perf_counter() - started
        self._crop()
        return ids, elapsed

    def _crop(self) -> None:
        """Drop what was fed beyond the history (transformers crops by a negative count of tokens)."""
        extra = self.cache.get_seq_length() - len(self.ids)
        if extra:
            self.cache.crop(-extra)

    def reply(self, text: str | None) -> list[Feed]:
        """Append the scripted reply (if any) and the next user header; drop the transient cache.
        Nothing to feed: the history is only encoded when an answer is needed."""
        reply = self.format.assistant_reply(text) if text is not None else []
        self._append(reply + self.format.next_user_header(), self.turn)
        self.turn += 1
        self.cache = None
        return []

    def resident(self) -> Counter[int]:
        """Every token is re-encoded, so every turn is fully present."""
        return self.per_turn

    def kv_tokens(self) -> int:
        return len(self.ids)

    def kv_bytes(self) -> int:
        """The transient cache a re-encode of the history builds (held only while answering)."""
        return len(self.ids) * self.bytes_per_token
