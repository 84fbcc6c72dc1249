"""The long-term memory loop an Agent runs: what the cache evicts is archived, and before a user turn is
prefilled, archived history the turn needs is found and its KV spliced back into the cache.

- Archive. The store hands every evicted stretch (one turn, one role: cache/store.py) to `evicted`, which
  only buffers it; `settle` archives the buffer after the reply, off the next turn's clock. Tokens that
  came back from the archive and are evicted again are already archived and are not stored twice.
- Unit. A stretch is archived under the embedding of the whole message it came from (`unit="message"`),
  or of its own words (`unit="span"`). The hybrid evicts piecemeal, so a stretch is often a few words
  without their subject; the message says what they were about.
- Recall. The unit of recall is a dialogue turn: every archived stretch of it that the cache no longer
  holds comes back together, so a fact returns with its frame, and what the cache still holds of it is
  marked used now, so the room made for the rest is not taken from it. Turns are chosen, within `share`
  of the budget (the tokens re-injected count), first those that name an entity the user's turn names
  (a name, a number, an address: whole words), then those of the topic the classifier says the user
  returns to and those similar to the user's turn (FAISS, cosine at least `threshold`); within each
  group, the more similar to the user's turn first. A turn that asks for a recap ("one line on what we
  sorted today") needs the whole dialogue's outcomes, and the names in it are whom the recap is for: it
  first brings back the archived replies that recorded an outcome ("I've booked ..."), newest first, the
  replies only, so that more of them fit; a turn that asks for an identifier by its noun ("what's my policy
  number?") first brings back the turns where a sentence names that noun and holds a code-like value
  ("I've found policy HPI-338207"), newest first (classifiers/acts.py). A name that says who asks ("Geoffrey
  wants to know ...", a signed "- Priya") is no clue to what is asked: its turns come last, after the similar ones.
- Scope. Every search and lookup is scoped by user and session id (memory/index.py)."""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from cache.meta import TokenMeta
from cache.span import KVSpan
from cache.store import KVStore, PLACEMENTS
from classifiers.acts import CODE, records_outcome
from classifiers.topics import analyse
from memory.archive import Archive, ArchiveConfig
from memory.embedder import Embedder
from memory.graph import CALENDAR
from memory.segment import ROLE_NAMES, Segment

UNITS = ("message", "span")
REASONS = ("recap", "asked", "referent", "entity", "topic", "similar", "summary")  # Recalled.reason: why it came back
_SPEAKER = re.compile(r"^\s*\w+:\s*(\w+)")  # "Helen: Remind me ...": a label, then a capitalised first word


@dataclass(frozen=True)
class MemoryConfig:
    share: float = 0.5  # of the budget: the most tokens one recall re-injects (measured: README, "Long-term memory")
    threshold: float = 0.4  # cosine similarity of the user's turn to an archived message (above 1: never)
    k: int = 8  # similar messages considered per recall
    placement: str = "end"  # where re-injected KV goes: "end" or "chronological" (cache/store.py; end won on data/)
    reinject: str = "kv"  # "kv": splice the archived KV; "text": re-prefill the archived tokens at the end (baseline)
    unit: str = "message"  # what an archived stretch is embedded as: "message" or "span" (its own words)
    entities: bool = True  # recall turns that name an entity the user's turn names
    topics: bool = True  # recall the turns of a topic the classifier says the user returns to
    referents: bool = True  # recall the turns the entity graph resolves the turn's references to (graph on)
    recaps: bool = True  # a recap request recalls the replies that recorded outcomes first
    identifiers: bool = True  # "what's my policy number?" first recalls the turns that gave one of that kind
    requesters: bool = True  # the turns naming who asks ("- Priya", "Tom's asking") come last, not first
    user_id: str = "local"
    session_id: str = "default"
    directory: str | None = None  # None: an in-memory archive (gone with the agent)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"memory share {self.share} must be in (0, 1]")
        if not -1 <= self.threshold < float("inf"):  # above 1: similarity alone never recalls (cosine <= 1)
            raise ValueError(f"memory threshold {self.threshold} must be a cosine similarity, -1 or more")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}: use one of {', '.join(PLACEMENTS)}")
        if self.reinject not in ("kv", "text"):
            raise ValueError(f"unknown reinject {self.reinject!r}: use kv or text")
        if self.unit not in UNITS:
            raise ValueError(f"unknown memory unit {self.unit!r}: use one of {', '.join(UNITS)}")


def names_in(text: str) -> list[str]:
    """What a user's turn names, to find the archived turns that name it too: capitalised words, numbers,
    codes and emails, without a possessive's "'s" ("Tom's" names Tom), without weekday and month names
    (the same word names another date each week) and without the first word after a speaker's label
    ("Helen: Remind me ..." names no Remind)."""
    label = _SPEAKER.match(text)
    dropped = {label.group(1).lower()} if label else set()
    names = {e.removesuffix("'s") for e in analyse(text).entities}
    return sorted(e for e in names if e not in CALENDAR and e not in dropped)


def _whole_word(word: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)", re.I)


@dataclass
class Recalled:
    """One turn brought back: which, why (a REASONS entry, with the entity or the similarity) and how
    many tokens were re-injected."""

    turn: int
    reason: str
    detail: str
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


class LongTermMemory:
    """One conversation's archive, attached to its store. `messages` maps (turn, role) to the text a
    stretch of that message is embedded as (unit "message"); the Agent fills it as turns go by."""

    def __init__(self, store: KVStore, embedder: Embedder, decode: Callable[[list[int]], str],
                 config: MemoryConfig = MemoryConfig(), feed: Callable[[list[int], int], None] | None = None):
        """`feed(ids, turn)` prefills tokens into the store (the model's job): needed for reinject "text"."""
        if config.reinject == "text" and feed is None:
            raise ValueError('reinject "text" needs a feed function to re-prefill with')
        self.store, self.embedder, self.decode, self.config, self.feed = store, embedder, decode, config, feed
        self.archive = Archive.create(config.directory, config.archive)
        self.pending: list[KVSpan] = []
        self.messages: dict[tuple[int, str], str] = {}
        self.vectors: dict[tuple[int, str], np.ndarray] = {}
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}  # segment id -> its turn and serials, read without I/O
        self.archived = torch.zeros(0, dtype=torch.bool)  # by serial: whether a token is archived already
        self.last: list[Recalled] = []  # what the latest recall brought back
        self.steps: dict[str, float] = {}  # the latest turn's memory work in ms, by step (see STEPS)
        store.on_evict, store.evict_filter = self.evicted, self.archivable

    # --- archiving ------------------------------------------------------------------------------
    def archivable(self, meta: TokenMeta) -> torch.Tensor:
        """The store's eviction filter: what is new to the archive (not the system prompt or the notes,
        not tokens the archive holds already, such as those recalled from it)."""
        serial = meta.serial.to("cpu")
        inside = serial < len(self.archived)  # serials past the mask's end are new
        known = torch.zeros_like(inside)
        known[inside] = self.archived[serial[inside]]
        return ~known.to(meta.turn.device) & (meta.turn >= 0)

    def _mark_archived(self, serials: torch.Tensor) -> None:
        if serials.numel() and int(serials.max()) >= len(self.archived):
            grown = torch.zeros(max(int(serials.max()) + 1, 2 * len(self.archived)), dtype=torch.bool)
            grown[: len(self.archived)] = self.archived
            self.archived = grown
        self.archived[serials] = True

    def evicted(self, span: KVSpan) -> None:
        """The store's eviction sink (after `archivable`): buffer it for `settle`."""
        self.pending.append(span)

    def settle(self) -> None:
        """Archive the stretches evicted since the last call, one segment per message they came from,
        under its text's embedding."""
        if not self.pending:
            return
        started = time.perf_counter()
        by_message: dict[tuple[int, int], list[KVSpan]] = {}
        for span in self.pending:
            by_message.setdefault((int(span.meta.turn[0]), int(span.meta.role[0])), []).append(span)
        self.pending = []
        spans = [KVSpan.cat(group) for group in by_message.values()]
        texts = [self._text(span) for span in spans]
        known = [self.vectors.get(self._message(span)) if self.config.unit == "message" else None for span in spans]
        todo = [k for k, vector in enumerate(known) if vector is None]
        for k, vector in zip(todo, self.embedder.embed([texts[k] for k in todo]) if todo else []):
            known[k] = vector
        for span, text, vector in zip(spans, texts, known):
            segment_id = self.archive.add(
                Segment.from_span(span.to("cpu"), self.config.user_id, self.config.session_id, text), vector)
            self.kept[segment_id] = int(span.meta.turn[0]), span.serials.clone()
            self._mark_archived(self.kept[segment_id][1].cpu())
        if len(self.kept) > 2 * len(self.archive) + 64:  # the disk cap forgot segments: so do we (amortised)
            self.kept = {segment_id: kept for segment_id, kept in self.kept.items() if segment_id in self.archive}
        self.charge("archive", started)

    @property
    def last_ms(self) -> float:
        """Memory work of the latest turn: embedding it, its recall, archiving after its reply (and the
        graph and notes work the agent charges)."""
        return sum(self.steps.values())

    def charge(self, step: str, started: float) -> None:
        """Count the time since `started` (time.perf_counter()) as the turn's work of `step`."""
        self.steps[step] = self.steps.get(step, 0.0) + (time.perf_counter() - started) * 1000

    @staticmethod
    def _message(span: KVSpan) -> tuple[int, str]:
        return int(span.meta.turn[0]), ROLE_NAMES[int(span.meta.role[0])]

    def _text(self, span: KVSpan) -> str:
        words = self.decode(span.meta.token.tolist())
        if self.config.unit == "span":
            return words
        return self.messages.get(self._message(span)) or words

    # --- recall ---------------------------------------------------------------------------------
    def embed_turn(self, text: str) -> np.ndarray:
        """The user's turn as the query (the topic classifier shares it); starts the turn's memory clock."""
        started = time.perf_counter()
        vector = self.embedder.embed(text)[0]
        self.steps = {}
        self.charge("embed", started)
        return vector

    def recall(self, turn: int, query: np.ndarray, entities: list[str], topic: int | None,
               referents: dict[int, str] | None = None, summarised: dict[int, str] | None = None,
               forget: Callable[[TokenMeta], torch.Tensor] | None = None, recap: bool = False,
               asked: list[str] | None = None, requesters: set[str] | None = None) -> list[Recalled]:
        """Bring back the archived turns the user's turn `turn` needs (see the module docstring) and
        splice their missing KV into the store, within `share` of the budget (the missing tokens count);
        a turn comes back whole (a recap's reply alone), so what the cache still holds of it is marked used now too
        (`KVStore.touch`). `query`: the turn's embedding; `entities`: what it names; `topic`: the topic
        segment it returns to, if any; `referents`: turns where what its references resolve to was last
        named, with the entity; `summarised`: turns of a summary keyframe like it, with the similarity;
        `forget`: which tokens of an archived segment must not come back (a bool per token: the pieces of
        superseded values); `recap`: the turn asks for a recap; `asked`: the nouns of the identifiers it asks
        for ("policy"); `requesters`: the entities that are who asks, not what about ("priya")."""
        self.settle()
        started = time.perf_counter()
        self.last = []
        budget = self.store.policy.budget
        if budget is not None and len(self.archive):
            room = int(budget * self.config.share)
            chosen: list[tuple[int, torch.Tensor]] = []  # archived segments, each with the mask of its missing tokens
            live = torch.zeros(self.store.next_serial, dtype=torch.bool)
            live[self.store.meta.serial] = True
            candidates = self._candidates(query, entities, topic, referents or {}, summarised or {},
                                          requesters if self.config.requesters else set())
            if asked and self.config.identifiers:
                candidates = self._holding(asked) + candidates
            if recap and self.config.recaps:
                candidates = self._outcomes() + candidates
            taken: set[int] = set()  # segments chosen: a recap's reply may come up again with its turn
            for old_turn, reason, detail in candidates:
                missing = [(segment_id, mask) for segment_id, mask in self._missing(
                    old_turn, live, "assistant" if reason == "recap" else None) if segment_id not in taken]
                count = sum(int(mask.sum()) for _, mask in missing)
                if not count or count > room:
                    continue
                chosen += missing
                taken.update(segment_id for segment_id, _ in missing)
                room -= count
                self.last.append(Recalled(old_turn, reason, detail, count))
            span = self._span(chosen, forget) if chosen else None
            if self.last:
                self.store.touch([r.turn for r in self.last], turn)
            self.charge("search", started)
            started = time.perf_counter()
            if span is not None and self.config.reinject == "kv":
                self.store.inject(span, turn, self.config.placement)
            elif span is not None:  # the baseline: the same tokens re-encoded after the cache, as a note
                self.feed(span.meta.token.tolist(), turn)
                self.store.mark_recalled(span.meta, turn)
        self.charge("splice", started)
        return self.last

    def _candidates(self, query: np.ndarray, entities: list[str], topic: int | None, referents: dict[int, str],
                    summarised: dict[int, str], requesters: set[str] | None = None) -> list[tuple[int, str, str]]:
        """Archived turns worth recalling, each once, as (turn, reason, detail): those naming one of the
        turn's entities first (a whole-word match), then the turns its references resolve to (rules, less
        sure), then those of the topic it returns to, similar to it or in a keyframe like it, and last those
        naming one of `requesters` (who asks); each group by similarity to the turn."""
        scope = self.config.user_id, self.config.session_id
        similarity: dict[int, float] = {}
        for segment_id, score in self.archive.search(query, *scope, k=self.config.k * 8):
            turn = self.kept[segment_id][0]
            similarity[turn] = max(similarity.get(turn, -1.0), score)

        def ranked(turns: dict[int, tuple[str, str]]) -> list[tuple[int, str, str]]:
            return [(t, *turns[t]) for t in sorted(turns, key=lambda t: (-similarity.get(t, -1.0), -t))]

        named: dict[int, tuple[str, str]] = {}
        asker: dict[int, tuple[str, str]] = {}
        if self.config.entities:
            for entity in (e for e in entities if len(e) >= 3):  # "2" or "of" names nothing
                whole, group = _whole_word(entity), asker if entity in (requesters or ()) else named
                for record in self.archive.segments_for(*scope, contains=entity):
                    if whole.search(record.text):  # "mot" is no part of "mother"
                        group.setdefault(record.turn, ("entity", entity))
        related: dict[int, tuple[str, str]] = {}
        if self.config.topics and topic is not None:
            for record in self.archive.segments_for(*scope, topic=topic):
                related.setdefault(record.turn, ("topic", str(topic)))
        similar = sorted((t for t, s in similarity.items() if s >= self.config.threshold), key=lambda t: -similarity[t])
        for t in similar[: self.config.k]:
            related.setdefault(t, ("similar", f"{similarity[t]:.2f}"))
        for t, detail in summarised.items():
            related.setdefault(t, ("summary", detail))
        resolved = {t: ("referent", entity) for t, entity in referents.items() if t not in named}
        related = {t: why for t, why in related.items() if t not in named and t not in resolved}
        return ranked(named) + ranked(resolved) + ranked(related) + ranked(
            {t: why for t, why in asker.items() if t not in named and t not in resolved and t not in related})

    def _outcomes(self) -> list[tuple[int, str, str]]:
        """The turns whose reply recorded an outcome, newest first, as recap candidates."""
        return [(turn, "recap", "outcome") for (turn, role), text in sorted(self.messages.items(), reverse=True)
                if role == "assistant" and records_outcome(text)]

    def _holding(self, kinds: list[str]) -> list[tuple[int, str, str]]:
        """The archived turns with a sentence that names one of `kinds` and holds a code-like value
        ("Your membership number is HGC-40716"), newest first: where an asked-for identifier was given."""
        scope = self.config.user_id, self.config.session_id
        found: dict[int, str] = {}
        for kind in kinds:
            whole = _whole_word(kind)
            for record in self.archive.segments_for(*scope, contains=kind):
                if any(whole.search(s) and CODE.search(s) for s in re.split(r"(?<=[.!?])\s+", record.text)):
                    found.setdefault(record.turn, kind)
        return [(turn, "asked", found[turn]) for turn in sorted(found, reverse=True)]

    def _missing(self, turn: int, live: torch.Tensor, role: str | None = None) -> list[tuple[int, torch.Tensor]]:
        """The archived segments of `turn` (of one `role`'s message, or both) holding tokens the cache does
        not (`live`: by serial, whether the cache holds it), each with the mask of those tokens (a token is
        in one segment only: recalled tokens are not archived again)."""
        scope = self.config.user_id, self.config.session_id
        missing = []
        for record in self.archive.segments_for(*scope, turns=range(turn, turn + 1)):
            if role is not None and record.role != role:
                continue
            mask = ~live[self.kept[record.id][1]]
            if bool(mask.any()):
                missing.append((record.id, mask))
        return missing

    def _span(self, missing: list[tuple[int, torch.Tensor]],
              forget: Callable[[TokenMeta], torch.Tensor] | None) -> KVSpan | None:
        """The missing tokens' KV, read from the archive, in serial order (the recalled turns oldest first,
        each in the order it was said), each token taken copied once into the span (a lone segment in order
        and whole is handed over uncopied: the splice reads a span and writes the store, never the span)."""
        read = list(zip(self.archive.spans([segment_id for segment_id, _ in missing]), (mask for _, mask in missing)))
        if forget is not None:  # one call over every segment, a token -1 between them so no value spans two
            gap = TokenMeta.new(1, 0, -1, "system", 0, ids=[-1])
            joined = TokenMeta.cat(*(part for span, _ in read for part in (span.meta, gap)))
            stale = forget(joined).split([part for span, _ in read for part in (len(span), 1)])[::2]
            read = [(span, mask & ~gone) for (span, mask), gone in zip(read, stale)]
        read = [(span, mask) for span, mask in read if bool(mask.any())]
        return KVSpan.in_serial_order(*map(list, zip(*read))) if read else None

    def stats(self) -> dict:
        return {"archived_segments": len(self.archive), "archive_kv_bytes": self.archive.nbytes(),
                "recalled": [r.as_dict() for r in self.last], "memory_ms": round(self.last_ms, 2),
                "memory_ms_by_step": {step: round(ms, 2) for step, ms in self.steps.items()}}

    # --- sessions -------------------------------------------------------------------------------
    def state(self) -> dict:
        """The texts and embeddings of the conversation's messages (the archive keeps its own files):
        archive what is pending first (`settle`)."""
        if self.pending:
            raise RuntimeError("settle() the pending evictions before saving the memory")
        keys = sorted(self.vectors)
        return {"messages": [(turn, role, text) for (turn, role), text in sorted(self.messages.items())],
                "vector_keys": keys,
                "vectors": torch.from_numpy(np.stack([self.vectors[key] for key in keys])) if keys else None}

    def attach(self, archive: Archive) -> None:
        """Continue over `archive` (a copy of this memory's, or a saved session's); the current one is closed."""
        self.archive.close()
        self.archive = archive
        self.kept = archive.token_serials()
        self.archived = torch.zeros(0, dtype=torch.bool)
        for _, serials in self.kept.values():
            self._mark_archived(serials.cpu())

    def load_state(self, state: dict, archive: Archive) -> None:
        """Continue a saved conversation over its reopened archive."""
        self.attach(archive)
        self.messages = {(turn, role): text for turn, role, text in state["messages"]}
        vectors = [] if state["vectors"] is None else state["vectors"].numpy()
        self.vectors = {tuple(key): vector for key, vector in zip(state["vector_keys"], vectors)}

    def close(self) -> None:
        self.archive.close()
