"""Which earlier value a changed one replaces.

A turn that moves, changes or corrects something (the user's, or a reply: in a service dialogue the
assistant is the one who books the slot and moves it) names a new date, time, amount or measure:
"Moved: your first lesson is now Thursday 12 June". The value it replaces is an earlier one of the
same kind said about the same thing, found in this order:
- an explicit pair: "raised from £6,000 to £9,000", "£250 instead of £500", "£9,120, replacing the £8,460";
- else the earlier value this turn denies ("the caravan isn't 7.2 metres", "36kg ..., not 34") or names
  the day of ("cancelled the Wednesday slot"), or whose sentence shares the most words with the new
  value's ("Booked: your first lesson is Tuesday 10 June" for the move above).
An earlier value is never replaced by one it was said beside ("from 6 September to 29 November": two
ends, not one slot moved), nor when this turn says it again without denying it ("still ends on ...").
The ledger only answers which pairs; the entity graph records them as superseded facts."""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass

from classifiers.persistence import Span
from classifiers.topics import STOPWORDS

_CONTENT = re.compile(r"[a-z0-9]+")
KINDS = {("date", "date"): "date", ("date", "time"): "time", ("amount", "amount"): "amount"}  # span -> kind
_UNITS = {"m": "metres", "metre": "metres", "metres": "metres", "meter": "metres", "meters": "metres", "cm": "cm",
          "mm": "mm", "km": "km", "kg": "kg", "kilo": "kg", "kilos": "kg", "inch": "inches", "inches": "inches",
          "ft": "feet", "foot": "feet", "feet": "feet", "litre": "litres", "litres": "litres", "liter": "litres",
          "liters": "litres", "ml": "ml", "mile": "miles", "miles": "miles", "stone": "stone", "lb": "lb", "lbs": "lb"}
_MEASURE = re.compile(rf"(?<![\w.£$€])(\d+(?:\.\d+)?)[\s-]?({'|'.join(sorted(_UNITS, key=len, reverse=True))})\b(?!-\w)",
                      re.I)
CHANGE = re.compile(  # a turn that may replace a value
    r"\b(?:move[ds]?|moving|now|instead|change[ds]?|changing|update[ds]?|correct(?:ed|ion)?|reduc(?:e|ed)|"
    r"increas(?:e|ed)|lower(?:ed)?|extend(?:ed)?|brought forward|bring (?:it )?forward|push(?:ed)? back|put back|"
    r"make it|rather than|switch(?:ed)?|swap(?:ped)?|not|isn't|wasn't|no longer|amended|rebooked|replac(?:e|ed|ing))\b",
    re.I)  # (not "cancelled" or "released": nothing takes their place)
_DENIAL = re.compile(r"\b(?:not|isn't|wasn't|no longer|instead of|rather than|replacing|in place of|cancel(?:l?ed)?|"
                     r"release[ds]?)\s+(?:(?:the|on|at|for|from|your|my|our|a|an)\s+){0,2}", re.I)  # then the old value
_FROM = re.compile(r"\bfrom\s+(?:the\s+)?$", re.I)
_TO = re.compile(r"^\s+(?:to|until|till)\s+(?:the\s+)?$", re.I)
_VERB_BEFORE = re.compile(r"\b(?:move[ds]?|change[ds]?|update[ds]?|correct(?:ed)?|rais(?:e|ed)|reduc(?:e|ed)|"
                          r"increas(?:e|ed)|lower(?:ed)?|extend(?:ed)?|switch(?:ed)?|amended|brought|push(?:ed)?)\b", re.I)
_REPLACING = re.compile(r"\breplac(?:e|es|ed|ing)\s+(?:the\s+|your\s+)?$", re.I)  # "replacing the £83 with £340"
_WITH = re.compile(r"^\s+(?:with|by)\s+(?:the\s+|a\s+)?$", re.I)
_RANGE = re.compile(r"^\s*(?:to|until|till|and|-|–)\s*(?:the\s+)?$", re.I)
_INSTEAD = re.compile(r"^,?\s+(?:instead of|rather than|replacing|in place of|not)\s+(?:the\s+|your\s+)?$", re.I)
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+(?=\s|$)|\n|$)")  # sentences; "7.2 metres" and "8.30am" stay whole
DAY_NAMED = re.compile(r"\b(?:(?P<weekday>(?:mon|tues?|wed(?:nes)?|thu(?:rs?)?|fri|sat(?:ur)?|sun)(?:day)?)(?:'?s)?"
                        r"|(?P<day>[123]?\d)(?:st|nd|rd|th))\b", re.I)
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")  # told by 3 letters
CALENDAR = frozenset(_WEEKDAYS) | frozenset("""january february march april may june july august september october
november december""".split())
_NOT_CONTEXT = CALENDAR | frozenset("""now instead change changed update updated move moved booked done""".split())
SLOTS = ("date",)  # kinds (and measures) whose slot is found by context: times and amounts are said of too many
# things in one dialogue (fees, totals, deposits) for shared words to tell which one changed; a denial still does
DENIED_HERE = 2  # what a denial of the old value, or its day named, weighs against one shared word
SAME_SLOT = 2  # the least score that says two values are of one slot: two shared words, or a denial
LEDGER_SIZE = 2048  # values kept (a 50-turn dialogue says 300-500): a long chat's ledger stays bounded


@functools.lru_cache(maxsize=LEDGER_SIZE)
def plain(text: str) -> str:
    """Its letters and digits, lowercase: "RW-5X82-QT" -> "rw5x82qt" (cached: the ledger asks it of every
    value it holds at each change)."""
    return "".join(_CONTENT.findall(text.lower()))


def names_day(value: str, mention: re.Match) -> bool:
    """Whether a date value names the weekday or the day of the month a `DAY_NAMED` match names."""
    if mention.group("weekday"):
        day = next(d for d in _WEEKDAYS if d.startswith(mention.group("weekday")[:3].lower()))
        return day in value.lower()
    return re.search(rf"(?<!\d){int(mention.group('day'))}(?!\d)", value) is not None


@dataclass(frozen=True)
class Value:
    kind: str  # date, time, amount, or "measure:<unit>"
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Said:
    """A value as a turn said it, with the content words of its sentence and the values of its kind said
    in that sentence too."""

    turn: int
    kind: str
    text: str
    context: tuple[str, ...]
    beside: tuple[str, ...]


def values(text: str, spans: list[Span]) -> list[Value]:
    """The dates, times and amounts among a turn's spans, and its measures ("8.1 metres", "36kg")."""
    found = [Value(KINDS[(s.type, s.attribute)], s.text, s.start, s.end) for s in spans if (s.type, s.attribute) in KINDS]
    for match in _MEASURE.finditer(text):
        if not any(v.start < match.end() and match.start() < v.end for v in found):
            found.append(Value(f"measure:{_UNITS[match.group(2).lower()]}", match.group(0), match.start(), match.end()))
    return sorted(found, key=lambda v: v.start)


class ValueLedger:
    """Every date, time, amount and measure said so far."""

    def __init__(self) -> None:
        self.said: list[Said] = []

    def record(self, turn: int, text: str, found: list[Value]) -> None:
        for value in found:
            beside = [plain(v.text) for v in found if v.kind == value.kind and v is not value
                      and _sentence(text, v.start) == _sentence(text, value.start)]
            self.said.append(Said(turn, value.kind, value.text, tuple(sorted(_context(text, value, found))),
                                  tuple(beside)))
        del self.said[:-LEDGER_SIZE]

    def replaced(self, turn: int, text: str, found: list[Value], gone: set[str]) -> list[tuple[str, str, str]]:
        """(old value as first written, new value, kind) for each value this turn replaces: explicit pairs,
        then the best-scored (old, new) pairs, each value in one pair at most. `gone`: the plain values
        already replaced (the graph's superseded facts), which nothing replaces again."""
        if not CHANGE.search(text):
            return []
        denied = [m.end() for m in _DENIAL.finditer(text)]  # where a denied value starts
        explicit, pairs, olds = _explicit(text, found), [], set()
        for old, new in explicit:
            earlier = [s for s in self.said if s.turn < turn and s.kind == old.kind and _words(old.text) <= _words(s.text)]
            olds |= {plain(old.text), *(plain(s.text) for s in earlier)}
            if earlier and plain(earlier[0].text) not in gone:
                pairs.append((earlier[0].text, new.text, new.kind))
        taken = {plain(v.text) for pair in explicit + _ranges(text, found) for v in pair}
        again = [v for v in found if v.start not in denied]  # said again, not denied: still valid
        scored = [candidate for new in found if new.start not in denied and plain(new.text) not in taken
                  and self._new(turn, new) for candidate in self._candidates(turn, text, new, found, denied, again, gone)]
        for *_, new, said in sorted(scored, key=lambda c: c[:3], reverse=True):
            if plain(new.text) not in taken and plain(said.text) not in olds:
                taken.add(plain(new.text))
                olds.add(plain(said.text))
                pairs.append((said.text, new.text, new.kind))
        return pairs

    def _new(self, turn: int, value: Value) -> bool:
        """Whether a value is new to the dialogue, or was last said one turn back (offered, then taken)."""
        return all(s.turn >= turn - 1 for s in self.said if s.turn < turn and s.kind == value.kind
                   and plain(s.text) == plain(value.text))

    def _candidates(self, turn: int, text: str, new: Value, found: list[Value], denied: list[int],
                    again: list[Value], gone: set[str]) -> list[tuple[int, int, int, Value, Said]]:
        """(score, -calendar distance, turn, new, earlier) for each earlier value of the new one's kind that
        this turn may replace: one it denies or names the day of, or, when the new value's own sentence
        says it changes, one whose sentence shares words with it. Of equal scores, the nearest date wins
        (a move is most often a short one), then the latest said."""
        key, (start, end) = plain(new.text), _sentence(text, new.start)
        context = _context(text, new, found) if CHANGE.search(text[start:end]) and (
            new.kind in SLOTS or new.kind.startswith("measure:")) else set()
        days = [m for m in DAY_NAMED.finditer(text) if new.kind == "date" and m.start() in denied
                and not names_day(new.text, m)]  # "cancelled the Wednesday slot"
        beside = {old for s in self.said if s.kind == new.kind and plain(s.text) == key for old in s.beside}
        skip, best = gone | beside, {}  # best: old -> candidate
        for said in self.said:
            old = plain(said.text)
            if said.turn >= turn or said.kind != new.kind or old in skip or any(_same(said, v) for v in again):
                continue
            score = len(context.intersection(said.context)) + DENIED_HERE * (
                _denied_here(said, text, denied) or any(names_day(said.text, m) for m in days))
            candidate = (score, -_distance(said.text, new.text), said.turn, new, said)
            if score >= SAME_SLOT and (old not in best or candidate[:3] > best[old][:3]):
                best[old] = candidate
        return list(best.values())

    def state(self) -> dict:
        return {"said": [asdict(s) for s in self.said]}

    @classmethod
    def from_state(cls, state: dict | None) -> "ValueLedger":
        ledger = cls()
        for fields in (state or {}).get("said", []):
            ledger.said.append(Said(**{**fields, "context": tuple(fields["context"]), "beside": tuple(fields["beside"])}))
        return ledger


def _explicit(text: str, found: list[Value]) -> list[tuple[Value, Value]]:
    """(old, new) written as a pair: "changed ... from A to B", "replacing the A with B", "B instead of A",
    "B, replacing the A"."""
    pairs = []
    for a, b in zip(found, found[1:]):
        if a.kind != b.kind:
            continue
        between = text[a.end:b.start]
        if _TO.match(between) and _FROM.search(text[:a.start]) and _VERB_BEFORE.search(text[max(0, a.start - 80):a.start]) \
                or _WITH.match(between) and _REPLACING.search(text[:a.start]):
            pairs.append((a, b))
        elif _INSTEAD.match(between):
            pairs.append((b, a))
    return pairs


def _ranges(text: str, found: list[Value]) -> list[tuple[Value, Value]]:
    """Values that are two ends of one span ("8 to 15 August", "from 6 April 2024 to 5 April 2025")."""
    return [(a, b) for a, b in zip(found, found[1:]) if a.kind == b.kind and _RANGE.match(text[a.end:b.start])]


def _same(said: Said, new: Value) -> bool:
    """The same value written another way: "Wednesday 22 October" and "22 October", "8 metre" and "8 metres"."""
    if said.kind != new.kind:
        return False
    if said.kind.startswith("measure:"):
        return _number(said.text) == _number(new.text)
    return _words(said.text) <= _words(new.text) or _words(new.text) <= _words(said.text)


@functools.lru_cache(maxsize=LEDGER_SIZE)
def _words(value: str) -> frozenset[str]:
    return frozenset(_CONTENT.findall(value.lower()))


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAY_MONTH = re.compile(rf"\b([123]?\d)(?:st|nd|rd|th)?(?:\s+of)?\s+({'|'.join(_MONTHS)})[a-z]*\b", re.I)


def _distance(old: str, new: str) -> int:
    """Days between two dates written with a day and a month (a year apart counts nothing); 400 unknown."""
    days = [(_MONTHS.index(m.group(2).lower()[:3]) * 31 + int(m.group(1))) if m else None
            for m in (_DAY_MONTH.search(old), _DAY_MONTH.search(new))]
    return abs(days[0] - days[1]) if None not in days else 400


def _denied_here(said: Said, text: str, denied: list[int]) -> bool:
    """Whether this turn denies the earlier value: writes it right after "not", or a measure's bare number
    ("36kg ..., not 34")."""
    number = _number(said.text) if said.kind.startswith("measure:") else None
    return any(text[at:].lower().startswith(said.text.lower()) or (
        number and re.match(rf"{re.escape(number)}(?!\d|\.\d|\s?[a-z])", text[at:], re.I)) for at in denied)


def _sentence(text: str, at: int) -> tuple[int, int]:
    """Where the sentence holding a position starts and ends."""
    return next(((m.start(), m.end()) for m in _SENTENCE.finditer(text) if m.start() <= at < m.end()), (at, at))


def _context(text: str, value: Value, found: list[Value]) -> set[str]:
    """The content words of the value's sentence, its kind's values taken out."""
    start, end = _sentence(text, value.start)
    words = text[start:end]
    for other in sorted((v for v in found if v.kind == value.kind and start <= v.start < end), key=lambda v: -v.start):
        words = words[:other.start - start] + " " + words[other.end - start:]
    stems = {_stem(w) for w in re.findall(r"(?<!')\b[a-z0-9][a-z0-9.-]*[a-z0-9]\b(?!')", words.lower()) if w not in STOPWORDS}
    return {w for w in stems if w not in _NOT_CONTEXT and len(w) > 2}


def _number(measure: str) -> str:
    return re.match(r"[\d.]+", measure).group(0)


def _stem(word: str) -> str:
    return word[:-1] if word.endswith("s") and len(word) > 3 else word
