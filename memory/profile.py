"""The notes the permanent tier carries: a profile of the user's current facts (from the entity graph)
and the running summary, as one short text within a token cap (and a few corrected values beyond it).

The profile lists current values only; a corrected one is marked "(corrected)" (optionally with the value
it replaced), so the model reads which is current; the superseded values stay in the graph, queryable.
Preferences and taboos are the user's own words ("Asked: never phone me at work"). Lines are taken in
priority order (who the user is, how to reach them and how not, where they live, their references, other
preferences and taboos, then amounts and dates, newest first, then the summary) until the cap is reached,
and then the newest corrected values the cap left out (a few lines: the model answers with an old value
when the turn that corrected it is gone). The notes are replaced, not appended, when they change."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from memory.graph import EntityGraph, Fact
from memory.summaries import RunningSummary


NOTES_PLACEMENTS = ("newest", "front")


@dataclass(frozen=True)
class ProfileConfig:
    share: float = 0.08  # of the budget: the most tokens the notes take (the permanent tier is 5-10 %)
    min_tokens: int = 64  # the cap when the budget is small, but never over a quarter of it
    max_tokens: int = 160
    summary_every: int = 5  # user turns per running-summary keyframe
    superseded: bool = False  # also say what a corrected value replaced ("corrected, not 2QE"), not just "corrected"
    corrections: int = 2  # the newest corrected values the cap left out, listed beyond it: a date or an amount
    # ranks last, and where the correcting turn was evicted the model has only the old value (README)
    placement: str = "newest"  # where the notes' KV sits: "newest" (encoded before the next user turn, drifting
    # back as turns follow) or "front" (moved after the system prompt, the rest re-rotated; README, "What must persist")

    def __post_init__(self) -> None:
        if not 0 < self.share < 0.5:
            raise ValueError(f"profile share {self.share} must be in (0, 0.5)")
        if self.placement not in NOTES_PLACEMENTS:
            raise ValueError(f"unknown notes placement {self.placement!r}: use one of {', '.join(NOTES_PLACEMENTS)}")

    def cap(self, budget: int | None) -> int:
        if budget is None:
            return self.max_tokens
        return min(budget // 4, max(self.min_tokens, min(self.max_tokens, int(budget * self.share))))


LABELS = {"name": "Name", "preference:form of address": "Asked", "taboo:channel": "Asked",
          "preference:channel": "Asked", "address": "Address", "postcode": "Postcode", "email": "Email",
          "phone": "Phone", "related name": "Also named"}
ORDER = ("name", "preference:form of address", "taboo:channel", "preference:channel", "address", "postcode",
         "email", "phone", "mobile phone")


def _rank(fact: Fact) -> tuple[int, int]:
    """Who the user is and how to reach them first, then their reference numbers, preferences and taboos,
    other addresses, amounts and dates, and last the other names mentioned; newest first within each."""
    if fact.attribute in ORDER:
        return ORDER.index(fact.attribute), -fact.valid_from_turn
    if fact.attribute.endswith("reference"):
        return len(ORDER), -fact.valid_from_turn
    group = {"contact": 1, "preference": 2, "taboo": 2, "address": 3, "amount": 4, "date": 5, "identity": 6}
    return len(ORDER) + group.get(fact.type, 7), -fact.valid_from_turn


_PLEASE = re.compile(r"^(?:please|pls|and|also|oh)[\s,]+", re.I)


def _line(fact: Fact, replaced: dict[str, str], superseded: bool) -> str:
    """One fact as a note; `replaced`: each correcting value and the last value it superseded."""
    label = LABELS.get(fact.attribute) or ("Asked" if fact.type in ("preference", "taboo")
                                           else fact.attribute.split(":")[-1].capitalize())
    value = _PLEASE.sub("", fact.value) if fact.type in ("preference", "taboo") else fact.value
    line = f"{label}: {value}"
    if fact.value in replaced:
        line += f" (corrected, not {replaced[fact.value]})" if superseded else " (corrected)"
    return line


def current_wording(text: str, graph: EntityGraph | None) -> str:
    """A keyframe as the facts stand now: a value corrected since is replaced by its correction."""
    for fact in graph.superseded() if graph is not None else []:
        if fact.value in text and fact.superseded_by:
            text = text.replace(fact.value, fact.superseded_by)
    return text


SUMMARY_SHARE = 0.3  # of the cap, kept for the running summary once there is one


def render(graph: EntityGraph | None, summary: RunningSummary | None, count: Callable[[str], int], cap: int,
           superseded: bool = False, corrections: int = 0) -> str:
    """The notes' text, at most `cap` tokens as `count` measures them ("" when there is nothing) plus the
    lines of the `corrections` newest corrected values the cap left out: facts in priority order within
    what the summary leaves, then the summary's newest keyframes that fit.
    Pieces are measured one by one (a caching `count` makes a turn's rendering cost what changed, not
    the whole history: facts and keyframes accumulate over a long session), and the whole once."""
    frames = [current_wording(frame, graph) for frame in summary.texts()] if summary is not None else []
    header, earlier = "Notes (current facts):", "\nEarlier: "
    facts_cap = cap - int(cap * SUMMARY_SHARE) if frames else cap
    facts = sorted(graph.current_facts(), key=_rank) if graph is not None else []
    replaced = {f.superseded_by: f.value for f in graph.superseded()} if graph is not None else {}
    used, lines = count(header), []
    for line in (_line(f, replaced, superseded) for f in facts):
        if used + count("\n" + line) <= facts_cap:
            lines.append(line)
            used += count("\n" + line)
    room, kept = cap - used - count(earlier), []
    for frame in reversed(frames):  # the newest keyframes that fit
        room -= count(" / " + frame)
        if room < 0:
            break
        kept.insert(0, frame)
    compose = lambda: "\n".join([header, *lines]) + (earlier + " / ".join(kept) if kept else "")  # noqa: E731
    while count(compose()) > cap and (kept or lines):  # pieces measured apart may tokenize longer together
        kept, lines = (kept[1:], lines) if kept else (kept, lines[:-1])
    corrected = [f for f in sorted(facts, key=lambda f: -f.valid_from_turn) if f.value in replaced]  # newest first
    lines += [line for line in (_line(f, replaced, superseded) for f in corrected) if line not in lines][:corrections]
    return compose() if (lines or kept) else ""
