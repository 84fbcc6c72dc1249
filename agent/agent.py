"""The Agent: one object that owns a model, a managed KV store and a cache policy, and runs turns.

A turn reads as observe -> recall -> prefill -> decode -> remember:
- observe: number the turn and assign its segment (the topic classifier plugs in here);
- recall: bring back archived history (the long-term store plugs in here);
- prefill: the user's words and the assistant header, evicting as needed;
- decode: stream the reply;
- remember: pre-warm the next turn's fixed header so its time to first token covers only the user's words.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from agent.chat_format import ChatFormat
from agent.engine import Feed, SamplingConfig, decode, forward_forks, prefill_packed
from agent.model import EMBEDDED, LoadedModel, load_model
from agent.scoring import ChoiceBatch
from cache.policies import HybridConfig, PolicyConfig, make_policy
from cache.storage import make_storage
from cache.store import ROLES, KVStore


@dataclass
class AgentConfig:
    model: str = EMBEDDED
    device: str = "auto"
    dtype: str = "float32"
    weights: str = "float"  # or "int8" (CPU)
    policy: str = "hybrid"
    budget_tokens: int | None = 1024
    sink_tokens: int = 4
    kv_dtype: str = "float32"  # float32 | bfloat16 | float16 | int8 | int4 | fp8 | dynamic
    paged: bool = False  # KV in fixed-size blocks from a pool
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    system: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class Turn:
    index: int
    text: str
    segment: int


@dataclass
class TurnTiming:
    ttft_ms: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Agent:
    def __init__(self, loaded: LoadedModel, config: AgentConfig | None = None):
        self.loaded = loaded
        self.config = config or AgentConfig()
        self.format = ChatFormat.from_tokenizer(loaded.tokenizer)
        self.policy = make_policy(
            self.config.policy, PolicyConfig(budget=self.config.budget_tokens, sink_tokens=self.config.sink_tokens),
            self.config.hybrid,
        )
        self.storage = make_storage(self.config.kv_dtype, paged=self.config.paged)
        self.reset()

    @classmethod
    def from_pretrained(cls, config: AgentConfig | None = None) -> "Agent":
        config = config or AgentConfig()
        return cls(load_model(config.model, config.device, config.dtype, config.weights), config)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    def reset(self) -> None:
        """Forget the conversation: a fresh store holding only the system prompt and first user header."""
        self.store = KVStore.for_model(self.model, self.storage)
        self.store.recording = self.policy.needs_importance
        self.store.measuring_surprisal = self.policy.needs_surprisal
        self.turn_index = 0
        self.timing = TurnTiming()
        system = Feed(self.store, self.policy, turn=-1, segment=-1).add(self.format.system_prompt(self.config.system), "system")
        self.last_logits = self._feed(system)

    # --- the turn ---------------------------------------------------------------------------------
    def stream(self, text: str) -> Iterator[str]:
        started = time.perf_counter()
        turn = self.observe(text)
        self.recall(turn)
        logits = self.prefill_user(turn)
        ids: list[int] = []
        shown = ""
        first_at = None
        for token in decode(self.model, self.store, self.policy, logits, self.format.end_of_turn,
                            self.config.sampling, turn.index, turn.segment):
            if first_at is None:
                first_at = time.perf_counter()
                self.timing = TurnTiming(ttft_ms=(first_at - started) * 1000)
            ids.append(token)
            text_so_far = self.format.decode(ids)
            if len(text_so_far) > len(shown) and not text_so_far.endswith("\ufffd"):
                yield text_so_far[len(shown):]
                shown = text_so_far
        if first_at is not None:
            self.timing.decode_tokens = len(ids) - 1
            self.timing.decode_s = time.perf_counter() - first_at
        else:
            self.timing = TurnTiming(ttft_ms=(time.perf_counter() - started) * 1000)
        self.remember(turn)

    def chat(self, text: str) -> str:
        return "".join(self.stream(text))

    def observe(self, text: str) -> Turn:
        """Number the turn and choose its segment. Each turn is its own segment until a topic classifier
        groups turns into topic segments."""
        turn = Turn(self.turn_index, text, segment=self.turn_index)
        self.turn_index += 1
        return turn

    def recall(self, turn: Turn) -> None:
        """Re-inject archived history relevant to this turn. No long-term store is attached yet."""

    def prefill_user(self, turn: Turn) -> torch.Tensor:
        self.last_logits = self._feed(self.user_feed(turn))
        return self.last_logits

    def remember(self, turn: Turn) -> None:
        """Pre-warm: feed the reply's closing and the next user header now, off the next turn's clock."""
        self._feed(self.reply_feed(turn, None))

    def user_feed(self, turn: Turn) -> Feed:
        """The user's message and the assistant header."""
        return Feed(self.store, self.policy, turn.index, turn.segment).add(self.format.user_message(turn.text), "user")

    def reply_feed(self, turn: Turn, text: str | None) -> Feed:
        """A reply's text (None: already fed by decode), its closing and the next user header (pre-warm)."""
        feed = Feed(self.store, self.policy, turn.index, turn.segment)
        return feed.add(self.format.assistant_reply(text) if text is not None else [], "assistant").add(
            self.format.next_user_header(), "assistant")

    def _feed(self, feed: Feed) -> torch.Tensor:
        return prefill_packed(self.model, [feed])[0]

    # --- scripted dialogues (teacher forcing) and choice scoring ------------------------------------------
    def user_turn(self, text: str) -> Turn:
        """Observe, recall and prefill a user message without replying; returns the turn (timing.ttft_ms
        holds the time to the first token's logits)."""
        started = time.perf_counter()
        turn = self.observe(text)
        self.recall(turn)
        self.prefill_user(turn)
        self.timing = TurnTiming(ttft_ms=(time.perf_counter() - started) * 1000)
        return turn

    def reference_reply(self, turn: Turn, text: str) -> None:
        """Feed a scripted assistant reply as history and pre-warm the next turn, in one forward."""
        self._feed(self.reply_feed(turn, text))

    def scripted_turn(self, text: str, reply: str | None) -> Feed:
        """Observe and recall a scripted turn whose answer is not needed, and return all of it (the user's
        message, the reference reply, the next header) as one feed, for the caller to prefill, possibly
        packed with other agents' turns in shared forwards."""
        turn = self.observe(text)
        self.recall(turn)
        return self.user_feed(turn).add(self.reply_feed(turn, reply).ids, "assistant")

    def score(self, choices: list[str]) -> list[float]:
        """Total log-probability of each choice as the assistant's reply, from the cache as it is now;
        the store is left exactly as it was (see score_together)."""
        return score_together([self], choices)[0]

    def draft(self, turn: Turn, max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy reply from the current state, then cropped off so a scripted history can continue with
        its reference reply; returns the ids and seconds spent decoding. Importance is not recorded for
        tokens that will not stay; eviction the policy does while decoding stays, as it would in a chat."""
        config = SamplingConfig(max_new_tokens=max_new_tokens)
        started = time.perf_counter()
        self.store.frozen = True
        try:
            ids = list(decode(self.model, self.store, self.policy, self.last_logits, self.format.end_of_turn,
                              config, turn.index, turn.segment))
        finally:
            self.store.frozen = False
        elapsed = time.perf_counter() - started
        meta = self.store.meta
        drafted = (meta.turn == turn.index) & (meta.role == ROLES["assistant"])  # the tail: no reply fed yet
        self.store.truncate(self.store.length - int(drafted.sum()))
        return ids, elapsed

    # --- persistent markers -----------------------------------------------------------------------
    def pin(self, text: str) -> int:
        """Pin every cached occurrence of `text` (an order number, a preference) so no policy evicts it
        while pinned. Pins count against the budget; returns how many tokens are now pinned for it."""
        found = self._occurrences(text)
        if found.numel() == 0:
            raise ValueError(f"nothing to pin: {text!r} is not in the cache")
        budget = self.policy.budget
        total = int(self.store.meta.pinned.sum()) + int((~self.store.meta.pinned[found]).sum())
        if budget is not None and total > budget // 2:
            raise ValueError(f"pinning {text!r} would pin {total} tokens, over half the {budget}-token budget")
        self.store.pin(found)
        return found.numel()

    def unpin(self, text: str | None = None) -> None:
        """Release the pins on `text`, or all pins."""
        self.store.pin(slice(None) if text is None else self._occurrences(text), pinned=False)

    def _occurrences(self, text: str) -> torch.Tensor:
        """Cached token indices of `text`, however it was tokenized (start of a line or after a space)."""
        return torch.cat([self.store.find(self.format.words(form)) for form in (text, " " + text)]).unique()

    # --- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        meta = self.store.meta
        return {
            "kv_tokens": self.store.length,
            "kv_bytes": self.store.memory_bytes(),
            "policy": self.policy.name,
            "budget": self.policy.budget,
            "kv_dtype": self.config.kv_dtype,
            "pinned_tokens": int(meta.pinned.sum()),
            "tiers": {name: int(mask.sum()) for name, mask in self.policy.tiers(meta).items()},
            "turns": self.turn_index,
            "ttft_ms": round(self.timing.ttft_ms, 2),
            "decode_tok_s": round(self.timing.decode_tok_s, 2),
        }


def score_together(agents: list[Agent], choices: list[str]) -> list[list[float]]:
    """Score the same choices against each agent's cache, all in one forward: every agent's choices are
    fed side by side after its history (each masked to see the history and itself only), then cropped
    off with importance and surprisal frozen, so every store is left exactly as it was. The agents share
    one model."""
    if not agents:
        return []
    batch = ChoiceBatch.build(agents[0].format, choices)
    if not batch.ids:
        return [batch.totals(agent.last_logits, None) for agent in agents]
    stores = [agent.store for agent in agents]
    lengths = [store.length for store in stores]
    try:
        for agent, store in zip(agents, stores):
            store.frozen = True
            store.expect(len(batch.ids), agent.turn_index, "assistant", -1, batch.ids)
        logits = forward_forks(agents[0].model, stores, [batch.ids] * len(agents),
                               [batch.positions(length)[0] for length in lengths], [batch.mask(length) for length in lengths])
    finally:
        for store, length in zip(stores, lengths):
            store.truncate(length)
            store.frozen = False
    return [batch.totals(agent.last_logits, fed) for agent, fed in zip(agents, logits)]
