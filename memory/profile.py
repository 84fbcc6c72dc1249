"""The notes the permanent tier carries: a profile of the user's current facts (from the entity graph)
and the running summary, as one short text within a token cap.

The profile lists current values only as values; a corrected one says what it replaced ("(corrected,
not 2QE)"), so the model reads which is current. Lines are taken in priority order (who the user is,
how to reach them and how not, where they live, their references, other preferences and taboos, then
amounts and dates, newest first, then the summary) until the cap is reached: the notes never grow past
their share of the budget, and they are replaced, not appended, when they change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memory.graph import EntityGraph, Fact
from memory.summaries import RunningSummary


@dataclass(frozen=True)
class ProfileConfig:
    share: float = 0.08  # of the budget: the most tokens the notes take (the permanent tier is 5-10 %)
    min_tokens: int = 48  # the cap when the budget is small or unbounded
    max_tokens: int = 160
    summary_every: int = 5  # user turns per running-summary keyframe
    superseded: bool = True  # say what a corrected value replaced

    def __post_init__(self) -> None:
        if not 0 < self.share < 0.5:
            raise ValueError(f"profile share {self.share} must be in (0, 0.5)")

    def cap(self, budget: int | None) -> int:
        if budget is None:
            return self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, int(budget * self.share)))


LABELS = {"name": "Name", "preference:form of address": "Address them as", "taboo:channel": "Never",
          "preference:channel": "Contact", "address": "Address", "postcode": "Postcode", "email": "Email",
          "phone": "Phone", "related name": "Also named"}
ORDER = ("name", "preference:form of address", "taboo:channel", "preference:channel", "address", "postcode",
         "email", "phone", "mobile phone", "related name")


def _rank(fact: Fact) -> tuple[int, int]:
    if fact.attribute in ORDER:
        return ORDER.index(fact.attribute), -fact.valid_from_turn
    group = {"contact": 8, "identity": 10, "preference": 11, "taboo": 11, "address": 12, "amount": 13, "date": 14}
    return len(ORDER) + group.get(fact.type, 15), -fact.valid_from_turn


def _line(fact: Fact, graph: EntityGraph, superseded: bool) -> str:
    label = LABELS.get(fact.attribute) or fact.attribute.split(":")[-1].capitalize()
    if fact.type in ("preference", "taboo") and fact.attribute not in LABELS:
        label = "Prefers" if fact.type == "preference" else "Avoid"
    line = f"{label}: {fact.value}"
    if superseded:
        old = [f.value for f in graph.superseded() if f.superseded_by == fact.value]
        if old:
            line += f" (corrected, not {old[-1]})"
    return line


def current_wording(text: str, graph: EntityGraph | None) -> str:
    """A keyframe as the facts stand now: a value corrected since is replaced by its correction."""
    for fact in graph.superseded() if graph is not None else []:
        if fact.value in text and fact.superseded_by:
            text = text.replace(fact.value, fact.superseded_by)
    return text


SUMMARY_SHARE = 0.4  # of the cap, kept for the running summary once there is one


def render(graph: EntityGraph | None, summary: RunningSummary | None, count: Callable[[str], int], cap: int,
           superseded: bool = True) -> str:
    """The notes' text, at most `cap` tokens as `count` measures them ("" when there is nothing): facts
    in priority order within what the summary leaves, then the summary's newest keyframes that fit."""
    frames = [current_wording(frame, graph) for frame in summary.texts()] if summary is not None else []
    text = "Notes (current facts):"
    facts_cap = cap - int(cap * SUMMARY_SHARE) if frames else cap
    facts = sorted(graph.current_facts(), key=_rank) if graph is not None else []
    for line in (_line(f, graph, superseded) for f in facts):
        if count(f"{text}\n{line}") <= facts_cap:
            text = f"{text}\n{line}"
    while frames and count(f"{text}\nEarlier: " + " / ".join(frames)) > cap:
        frames = frames[1:]
    if frames:
        text = f"{text}\nEarlier: " + " / ".join(frames)
    return text if (facts or frames) else ""
