"""The Agent: one object that owns a model, a managed KV store and a cache policy, and runs turns.

A turn reads as observe -> recall -> prefill -> decode -> remember:
- observe: number the turn, embed it, and assign its segment (the topic classifier's decision);
- recall: bring back archived history the turn needs, as KV (memory/recall.py), when memory is on;
- prefill: the user's words and the assistant header, evicting as needed;
- decode: stream the reply;
- remember: pre-warm the next turn's fixed header so its time to first token covers only the user's words,
  and archive what this turn evicted (embedding included), off the next turn's clock.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from agent.chat_format import ChatFormat
from agent.engine import Feed, SamplingConfig, decode, prefill_packed
from agent.model import EMBEDDED, LoadedModel, load_model
from agent.scoring import score_together
from agent.session import new_conversation_id
from cache.meta import TokenMeta
from cache.policies import HybridConfig, PolicyConfig, make_policy
from cache.storage import StorageConfig
from cache.store import KVStore
from classifiers.acts import asked_kinds, asks_recap, requesters
from memory.graph import EntityGraph, Resolution
from memory.profile import ProfileConfig, render
from memory.recall import LongTermMemory, MemoryConfig, Recalled, names_in
from memory.summaries import RunningSummary

NOTES_TURN = -2  # the turn the notes' tokens carry: below 0, so the permanent tier holds them


class AgentBusyError(RuntimeError):
    """An Agent was called from a second thread while one is running a turn on it."""


def one_thread(method):
    """Run `method` holding the agent's lock; a call from another thread meanwhile fails at once."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with self._exclusive():
            return method(self, *args, **kwargs)
    return guarded


@dataclass
class AgentConfig:
    model: str = EMBEDDED
    device: str = "auto"
    dtype: str = "float32"
    weights: str = "float"  # or "int8" / "int4" (CPU), or "auto" (palace chat's: agent.model.resolve_weights)
    policy: str = "hybrid"
    budget_tokens: int | None = 1024
    sink_tokens: int = 4
    storage: StorageConfig = field(default_factory=StorageConfig)  # kv dtype, paged blocks
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    system: str | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    topics: bool = False  # classify each turn's topic (classifiers/topics.py); segments become topics
    memory: MemoryConfig | None = None  # archive evicted KV and recall it (memory/recall.py); None: off
    graph: bool = False  # entity graph: facts, corrections, references resolved (memory/graph.py)
    forget_stale: bool = True  # with the graph: the cache drops what corrections superseded, recall leaves it out
    # (with the notes' corrected values, +10 of 331 development probes over keeping them; README, "What must persist")
    profile: ProfileConfig | None = None  # notes in the permanent tier: profile and running summary; None: off


@dataclass
class Turn:
    """One user turn as the agent handles it: its index, the user's words, its topic segment (the topic's
    first turn when topics are tracked, else the turn itself), the topic decision and the reply."""

    index: int
    text: str
    segment: int
    topic: str | None = None  # "new", "continue" or "return:<k>"
    reply: str | None = None
    embedding: np.ndarray | None = None  # the user's words (all-MiniLM-L6-v2), when topics or memory need it
    recalled: list[Recalled] = field(default_factory=list)  # archived turns re-injected before this one
    resolutions: list[Resolution] = field(default_factory=list)  # its references, resolved by the entity graph


@dataclass
class TurnTiming:
    ttft_ms: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Agent:
    """A chat over one model, one managed KV store and its cache policy.

    Chat and embedding programs use `chat`, `stream`, `score`, `pin`/`unpin`, `stats`, `reset`, and
    `save` / `Agent.load` (agent/session.py); `interrupt` ends the reply being streamed at the next token.
    One thread at a time: a call from a second thread while a turn runs raises AgentBusyError (the cache
    is one sequence; interleaved turns would corrupt it). Agents share no mutable state, so one Agent per
    thread is safe; only `interrupt` may be called from anywhere, a signal handler included.
    A turn is also available step by step (`observe`, `recall`, `prefill`, `remember`), and each step that
    feeds tokens has a `*_feed` twin that returns the tokens instead of feeding them, so a caller can
    pack several agents' feeds into shared forwards (`agent.engine.prefill_packed`); evaluation drives
    agents that way, by teacher forcing."""

    def __init__(self, loaded: LoadedModel, config: AgentConfig | None = None):
        self.loaded = loaded
        self.config = config or AgentConfig()
        self.format = ChatFormat.from_tokenizer(loaded.tokenizer)
        self.policy = make_policy(
            self.config.policy, PolicyConfig(budget=self.config.budget_tokens, sink_tokens=self.config.sink_tokens),
            self.config.hybrid,
        )
        self.topic_model = self.embedder = self.memory = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.session_dir: Path | None = None  # where save() with no directory writes (the last save or load)
        self.session_lock = None  # the lock on session_dir (agent/session.py)
        self._count_tokens = functools.lru_cache(maxsize=4096)(lambda text: len(self.format.words(text)))  # notes' pieces
        self._words = functools.lru_cache(maxsize=1024)(lambda text: tuple(self.format.words(text)))  # pins, stale values
        if self.config.profile is not None and not self.config.graph:
            raise ValueError("the profile is built from the entity graph: turn the graph on too")
        if self.config.topics or self.config.memory is not None or self.config.profile is not None:
            from memory.embedder import shared_embedder

            self.embedder = shared_embedder()
        if self.config.topics:
            from classifiers.topics import TopicModel

            self.topic_model = TopicModel.shared()
        self.reset()

    @classmethod
    def from_pretrained(cls, config: AgentConfig | None = None) -> "Agent":
        config = config or AgentConfig()
        return cls(load_model(config.model, config.device, config.dtype, config.weights), config)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @classmethod
    def load(cls, directory: str | Path, loaded: LoadedModel | None = None, device: str | None = None) -> "Agent":
        """The agent a session directory holds (agent/session.py), continuing where it was saved."""
        from agent.session import load

        agent = load(directory, loaded, device)
        agent.session_dir = Path(directory)
        return agent

    @one_thread
    def save(self, directory: str | Path | None = None, overwrite: bool = False) -> Path:
        """Save the conversation (cache, history, topics, graph, summary, archive) atomically into
        `directory` (default: the last one saved to or loaded from); see agent/session.py."""
        from agent.session import save

        directory = Path(directory) if directory is not None else self.session_dir
        if directory is None:
            raise ValueError("save() needs a directory: this conversation was never saved")
        self.session_dir = save(self, directory, overwrite)
        return self.session_dir

    @one_thread
    def restore(self, state: dict, conversation_id: str, device: torch.device | str | None = None) -> None:
        """Continue a saved conversation (`agent.session.load` calls this, then restores the memory over
        its reopened archive)."""
        from classifiers.topics import TopicTracker

        self.reset()
        self.store.load_state(state["store"], device)
        self.turn_index, self.notes = state["agent"]["turn_index"], state["agent"]["notes"]
        self.history = [Turn(**turn) for turn in state["agent"]["history"]]
        if self.tracker is not None:
            self.tracker = TopicTracker.from_state(state["tracker"], self.topic_model, self.embedder)
        if self.graph is not None:
            self.graph = EntityGraph.from_state(state["graph"])
        if self.summary is not None:
            self.summary = RunningSummary.from_state(state["summary"])
        self.conversation_id = conversation_id

    @one_thread
    def close(self) -> None:
        """Release the archive and the session directory's lock (unsaved turns are not saved)."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.session_lock is not None:
            self.session_lock.release()
            self.session_lock = None

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise AgentBusyError("this Agent is running a turn in another thread: use one Agent per thread")
        try:
            yield
        finally:
            self._lock.release()

    def interrupt(self) -> None:
        """End the reply being streamed after the token it is on (safe from any thread or a signal
        handler); the turn completes as usual with the partial reply. No effect between replies."""
        self._stop.set()

    @one_thread
    def reset(self) -> None:
        """Forget the conversation: a fresh store holding only the system prompt and first user header."""
        self.store = KVStore.for_model(self.model, self.policy, self.config.storage)
        self.tracker = None
        if self.topic_model is not None:
            from classifiers.topics import TopicTracker

            self.tracker = TopicTracker(self.topic_model, self.embedder)
        if self.memory is not None:
            self.memory.close()
        self.memory = None if self.config.memory is None else LongTermMemory(
            self.store, self.embedder, self.format.decode, self.config.memory, self._feed_note)
        self.graph = EntityGraph() if self.config.graph else None
        profile = self.config.profile
        self.summary = RunningSummary(profile.summary_every) if profile is not None else None
        self.notes = ""  # the notes text the permanent tier holds now
        self.turn_index = 0
        self.history: list[Turn] = []  # every turn so far, with its reply
        self.conversation_id = new_conversation_id()
        self.timing = TurnTiming()
        system = Feed(self.store, turn=-1, segment=-1).add(self.format.system_prompt(self.config.system), "system")
        prefill_packed(self.model, [system])

    # --- the turn ---------------------------------------------------------------------------------
    def stream(self, text: str) -> Iterator[str]:
        """Reply to `text`, yielding the reply's text as it is decoded. The reply ends early, and the turn
        completes with what was decoded (every yielded token is in the cache), when `interrupt` is called
        or the caller stops iterating (closes the generator)."""
        with self._exclusive():
            started = time.perf_counter()
            self._stop.clear()
            turn = self.observe(text)
            self.recall(turn)
            self.prefill(turn)
            ids: list[int] = []
            shown = ""
            first_at = None
            tokens = decode(self.model, self.store, self.format.end_of_turn, self.config.sampling, turn.index, turn.segment)
            try:
                for token in tokens:
                    if first_at is None:
                        first_at = time.perf_counter()
                        self.timing = TurnTiming(ttft_ms=(first_at - started) * 1000)
                    ids.append(token)
                    text_so_far = self.format.decode(ids)
                    if len(text_so_far) > len(shown) and not text_so_far.endswith("\ufffd"):
                        yield text_so_far[len(shown):]
                        shown = text_so_far
                    if self._stop.is_set():
                        break
            finally:  # also when the caller closed us: the turn is completed, never left half-fed
                tokens.close()  # feeds the token it last yielded
                self._stop.clear()
                if first_at is not None:
                    self.timing.decode_tokens = len(ids) - 1
                    self.timing.decode_s = time.perf_counter() - first_at
                else:
                    self.timing = TurnTiming(ttft_ms=(time.perf_counter() - started) * 1000)
                turn.reply = self.format.decode(ids)
                self.remember(turn)

    def chat(self, text: str) -> str:
        return "".join(self.stream(text))

    @one_thread
    def observe(self, text: str) -> Turn:
        """Number the turn, embed it once when topics or memory need it (both share the vector), and
        choose its segment: with topics tracked, the classifier says whether the user opens a new topic,
        continues, or returns to an earlier one, and the turn joins that topic's segment; otherwise each
        turn is its own segment."""
        turn = Turn(self.turn_index, text, segment=self.turn_index)
        if self.memory is not None:
            turn.embedding = self.memory.embed_turn(text)
        elif self.embedder is not None:
            turn.embedding = self.embedder.embed(text)[0]
        if self.tracker is not None:
            started = time.perf_counter()
            decision = self.tracker.observe(text, embedding=turn.embedding)
            turn.segment, turn.topic = decision.topic_turn, decision.label
            self._charge("topics", started)
        if self.graph is not None:
            started = time.perf_counter()
            turn.resolutions = self.graph.observe(turn.index, text)[1]
            self._charge("graph", started)
        if self.memory is not None:
            self.memory.messages[(turn.index, "user")] = text
            self.memory.vectors[(turn.index, "user")] = turn.embedding
        self.turn_index += 1
        self.history.append(turn)
        return turn

    @one_thread
    def recall(self, turn: Turn) -> None:
        """With memory on: re-inject the archived turns this one names an entity of, returns to the topic
        of, or resembles, for a recap request the replies that recorded outcomes, and for a question for an
        identifier the turns that gave one of that kind (memory/recall.py), within the memory's share of the
        budget; the turns naming only who asks ("- Priya", "Tom's asking") come last."""
        if self.memory is None:
            return
        returns_to = turn.segment if turn.topic and turn.topic.startswith("return") else None  # the topic's first turn
        referents = {r.antecedent: r.entity for r in turn.resolutions} if self.memory.config.referents else {}
        summarised = {}
        if self.summary is not None:  # the keyframe most like the turn brings back its block's turns
            for frame, score in self.summary.search(turn.embedding, self.memory.config.threshold)[:1]:
                summarised = {old: f"{score:.2f}" for old in range(frame.first_turn, frame.last_turn + 1)}
        stale = self.graph.stale() if self._forgets else []  # pieces of superseded values: never re-injected
        turn.recalled = self.memory.recall(turn.index, turn.embedding, names_in(turn.text), returns_to,
                                           referents, summarised,
                                           forget=functools.partial(self._stale, pieces=stale) if stale else None,
                                           recap=asks_recap(turn.text), asked=asked_kinds(turn.text),
                                           requesters=requesters(turn.text))

    @one_thread
    def prefill(self, turn: Turn) -> None:
        """Feed the user's words and the assistant header; the store's next-token logits then start the reply."""
        prefill_packed(self.model, [self.user_feed(turn)])

    @one_thread
    def remember(self, turn: Turn, reply: str | None = None) -> None:
        """After the reply: feed its closing and pre-warm the next user header, off the next turn's clock.
        `reply`: a reply's text to feed as history first (teacher forcing), when decode did not feed it."""
        self.note_reply(turn, reply)
        prefill_packed(self.model, [self.reply_feed(turn, reply)])
        self.settle()

    @one_thread
    def note_reply(self, turn: Turn, reply: str | None) -> None:
        """The reply joins the turn's topic and is what its evicted stretches are archived as (callers
        that feed `reply_feed` themselves call this too). A `reply` given is on record and may move the
        user's values in the graph; `None` means the model decoded `turn.reply`, which may not."""
        on_record = reply is not None
        turn.reply = reply if on_record else turn.reply
        if not turn.reply:
            return
        started = time.perf_counter()
        reply_vector = self.embedder.embed(turn.reply)[0] if self.tracker is not None else None
        self._charge("embed_reply", started)
        if self.tracker is not None:
            self.tracker.reply(turn.reply, embedding=reply_vector)
        if self.memory is not None:
            self.memory.messages[(turn.index, "assistant")] = turn.reply
            if reply_vector is not None:
                self.memory.vectors[(turn.index, "assistant")] = reply_vector
        started = time.perf_counter()
        if self.graph is not None:
            self.graph.mention(turn.index, turn.reply, changes=on_record)
        if self.summary is not None and turn.embedding is not None:
            self.summary.add(turn.index, turn.text, turn.embedding)
        self._charge("graph_reply", started)

    def _charge(self, step: str, started: float) -> None:
        """Count graph and notes work since `started` as the turn's memory work."""
        if self.memory is not None:
            self.memory.charge(step, started)

    @one_thread
    def settle(self) -> None:
        """After a turn's feeds (callers that feed themselves call this after): drop the live tokens of
        values a correction superseded (pins and the notes excepted), then archive what was evicted."""
        if self._forgets:
            started = time.perf_counter()
            meta = self.store.meta
            stale = self._stale(meta) & ~meta.pinned & (meta.turn != NOTES_TURN)
            if bool(stale.any()):
                self.store.make_room(0, drop=stale)
            self._charge("forget", started)
        if self.config.profile is not None and self.config.profile.placement == "front":
            self._notes_to_front()
        if self.memory is not None:
            self.memory.settle()

    def _notes_to_front(self) -> None:
        """Move the notes' KV from where they were encoded (before the newest user header) to the front: after
        the system message, before its user header, the tokens between re-rotated (`ProfileConfig.placement`)."""
        turns = self.store.meta.turn.cpu()
        notes = turns == NOTES_TURN
        if not bool(notes.any()):
            return
        started = time.perf_counter()
        system = torch.nonzero(turns == -1).flatten()
        header = len(self.format.closing_note_header("")[2])  # the first user header closes the system prompt
        rank = torch.full((len(turns),), 3)
        rank[system[: max(0, len(system) - header)]] = 0
        rank[notes] = 1
        rank[system[max(0, len(system) - header):]] = 2
        self.store.reorder(torch.argsort(rank, stable=True))
        self._charge("notes", started)

    def _feed_note(self, ids: list[int], turn: int) -> None:
        """Re-prefill recalled tokens as text (the memory's "text" baseline), as part of the user's turn."""
        prefill_packed(self.model, [Feed(self.store, turn, turn).add(ids, "user")])

    def user_feed(self, turn: Turn) -> Feed:
        """What `prefill` feeds: the user's message and the assistant header."""
        return Feed(self.store, turn.index, turn.segment).add(self.format.user_message(turn.text), "user")

    @one_thread
    def reply_feed(self, turn: Turn, reply: str | None = None, ahead: int = 0) -> Feed:
        """What `remember` feeds: a reply's text (None: already fed by decode), then its closing and the
        next user header, which opens the user's next message. When the notes changed, the new ones go
        between the closing and the header, and the old ones' KV is dropped now. `ahead`: tokens fed before
        this feed in the same prefill (a caller that joins the user's message to it)."""
        feed = Feed(self.store, turn.index, turn.segment)
        feed.add(self.format.assistant_reply(reply) if reply is not None else [], "assistant")
        notes = self._renewed_notes()
        if notes is None:
            return feed.add(self.format.next_user_header(), "user")
        closing, block, header = self.format.closing_note_header(notes)
        feed.add(closing, "user").add(block, "system", turn=NOTES_TURN, segment=NOTES_TURN).add(header, "user")
        incoming, chunk = ahead + len(feed.ids), self.policy.max_chunk()
        self._drop_old_notes(incoming if chunk is None else min(incoming, chunk))  # what prefill feeds first
        return feed

    def _renewed_notes(self) -> str | None:
        """The notes' new text when the profile or summary changed (it becomes `self.notes`); None when
        unchanged."""
        if self.config.profile is None:
            return None
        started = time.perf_counter()
        profile = self.config.profile
        notes = render(self.graph, self.summary, self._count_tokens, profile.cap(self.policy.budget), profile.superseded,
                       profile.corrections)
        changed = bool(notes) and notes != self.notes
        if changed:
            self.notes = notes
        self._charge("notes", started)  # rendering counts every turn, not only when the notes change
        return notes if changed else None

    def _drop_old_notes(self, incoming: int) -> None:
        """Drop the old notes' KV (replaced, not appended) in the compaction that makes room for the
        `incoming` tokens prefilled first (the feed's first chunk), keeping what those two compactions
        would. It counts as the notes' work only when the chunk needed no room of its own (else the policy
        would have compacted anyway)."""
        started = time.perf_counter()
        old = self.store.meta.turn == NOTES_TURN
        if bool(old.any()) and not self.store.make_room(incoming, drop=old):
            self._charge("notes", started)

    @one_thread
    def score(self, choices: list[str]) -> list[float]:
        """Total log-probability of each choice as the continuation of the cache as it is now (after
        `prefill`, as the assistant's reply); the store is left exactly as it was."""
        return score_together(self.model, self.format, [self.store], choices)[0]

    # --- persistent markers -----------------------------------------------------------------------
    @one_thread
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

    @one_thread
    def unpin(self, text: str | None = None) -> None:
        """Release the pins on `text`, or all pins."""
        self.store.pin(slice(None) if text is None else self._occurrences(text), pinned=False)

    def _occurrences(self, text: str, meta: TokenMeta | None = None) -> torch.Tensor:
        """Token indices of `text` in the cache (or in `meta`), however it was tokenized (start of a line
        or after a space)."""
        meta = self.store.meta if meta is None else meta
        return torch.cat([meta.find(self._words(form)) for form in (text, " " + text)]).unique()

    def _stale(self, meta: TokenMeta, pieces: list[str] | None = None) -> torch.Tensor:
        """Which rows of `meta` hold a piece of a value a correction superseded (`pieces`, default
        `EntityGraph.stale()`), as a bool per row: what the cache drops and recall leaves out, so the model
        reads the current value only (the old one stays in the graph and the archive, Graphiti-style:
        invalidated, not deleted)."""
        stale = torch.zeros(len(meta), dtype=torch.bool)
        for piece in self.graph.stale() if pieces is None else pieces:
            stale[self._occurrences(piece, meta)] = True
        return stale

    @property
    def _forgets(self) -> bool:
        return self.graph is not None and self.config.forget_stale

    # --- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        meta = self.store.meta
        return {
            "kv_tokens": self.store.length,
            "kv_bytes": self.store.memory_bytes(),
            "policy": self.policy.name,
            "budget": self.policy.budget,
            "kv_dtype": self.config.storage.kv_dtype,
            "pinned_tokens": int(meta.pinned.sum()),
            "tiers": {name: int(mask.sum()) for name, mask in self.policy.tiers(meta).items()},
            "turns": self.turn_index,
            **({"topic": self.tracker.current_topic,
                "topic_stack": sorted(self.tracker.topics, key=lambda k: -self.tracker.topics[k].last)[:5]}
               if self.tracker is not None and self.tracker.turns else {}),
            **({"memory": self.memory.stats()} if self.memory is not None else {}),
            **({"graph": self.graph.stats(self.turn_index - 1)} if self.graph is not None else {}),
            **({"notes": self.notes, "notes_tokens": int((meta.turn == NOTES_TURN).sum())}
               if self.config.profile is not None else {}),
            "ttft_ms": round(self.timing.ttft_ms, 2),
            "decode_tok_s": round(self.timing.decode_tok_s, 2),
        }

