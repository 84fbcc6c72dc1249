"""The conversation's entities, the facts stated about the user, and what a reference in a new turn
points to: a networkx graph, built by rules (no parser model is available offline).

- Nodes: the user, every entity named so far (people, pets, codes, addresses, dates, amounts, products,
  places, the things a definite noun phrase names: "the boiler") and every turn.
- Edges: turn -mentions-> entity (with role; salience decays with the turns since), and user -fact->
  value entity with `attribute`, `valid_from_turn` and `invalid_from_turn`. Facts are Graphiti-style: a
  correction ("it's 2QF, not 2QE"; "we moved, we're at ... now") closes the old fact's validity and keeps
  it, marked superseded, so what the user said before stays queryable. A date, amount or measure a turn
  changes, the user's or a reply ("Moved: your first lesson is now Thursday 12 June"), replaces the earlier
  one of the same thing (`memory/slots.py`).
- Coreference: a pronoun, "that one", "the other address" or "my daughter" in a new turn resolves to the
  most salient earlier entity compatible with it (a person of that gender for "she", a thing for "it", a
  place for "there", an entity that goes by the phrase's head noun for "the other address", the person
  named with that relation for "my daughter"), and names the turn where that entity was last named
  (not just referred to), which is what the long-term memory brings back. Salience decays fast with
  the turns gone by (most references point one turn back), and slowly for what the dialogue keeps
  coming back to (the parcel of a courier chat)."""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx

from classifiers.persistence import PersistenceMarker, Span, value_spans
from classifiers.topics import STOPWORDS
from memory.slots import CALENDAR, DAY_NAMED, Value, ValueLedger, names_day, plain as _plain, values

USER = "user"
DECAY = 0.2  # salience kept per turn gone by
SLOW = 0.95  # the same for a dialogue's standing topics ("the parcel" of a courier chat), which "it" still means later
STANDING = 0.05  # how much the standing topics weigh against the turn's focus
_CLOSED = re.compile(r"\s*(?:[,.;:!?)]|$)")  # what ends a name said in apposition: "my best man, Gareth Lewis, needs"
_APPOSITION = re.compile(r"[\s,]*(?:(?:is|was|will be|called|named|who is|,|:)\s*)?", re.I)  # between a phrase and its name
ROLE_WEIGHT = {"user": 1.0, "assistant": 1.0}
DENIED = 0.2  # what a mention weighs when the text says it is not the one ("..., not 37 Larch Close")
REFERRED = 0.5  # what a mention by reference weighs ("it", "the boiler")
LATE = 0.5  # how much more a mention at the end of a text weighs than one at its start: the latest is likeliest


@dataclass
class Fact:
    """user -attribute-> value, valid from a turn until a correction (None: still valid)."""

    attribute: str
    value: str
    type: str
    valid_from_turn: int
    invalid_from_turn: int | None = None
    superseded_by: str | None = None

    @property
    def current(self) -> bool:
        return self.invalid_from_turn is None


@dataclass(frozen=True)
class Resolution:
    """A reference in a turn (`span` at `start`, of `type` pronoun / demonstrative / definite /
    relational) and the entity it resolves to, last mentioned at turn `antecedent`."""

    span: str
    start: int
    type: str
    entity: str
    antecedent: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Entity:
    key: str
    name: str  # as last written
    kind: str  # person, pet, thing, place, code, address, contact, date, amount, name (unknown: person or thing)
    head: str  # head noun ("address", "parcel") or the name's last word
    relation: str | None = None  # "daughter" for "my daughter Ellie"
    gender: str | None = None  # "female" for "Esme, she's 9": from a relation or the pronoun that follows the name
    aliases: set[str] = field(default_factory=set)  # head nouns it was named with: "boiler" for "the boiler, a Thermara"
    same_as: str | None = None  # a noun phrase's entity said in apposition to a name: that name's key ("the
    # trainee solicitor, Mr Wierzbicki"), what a later "the trainee" or "he" means
    mentions: list[tuple[int, float]] = field(default_factory=list)  # (turn, weight)

    def salience(self, now: int) -> float:
        return sum(weight * (DECAY ** (now - turn) + STANDING * SLOW ** (now - turn)) for turn, weight in self.mentions
                   if turn <= now)

    @property
    def last(self) -> int:
        return self.mentions[-1][0]

    def words(self) -> set[str]:
        """What a definite phrase can name it by: its name's words, the nouns it was named with, its kind's
        nouns, its relation ("the dog" is Biscuit)."""
        stamp = (self.kind, self.relation, len(self.aliases))  # what they come from (the key never changes)
        if getattr(self, "_words", (None,))[0] != stamp:  # cached: asked for every reference of every turn
            kind = ("email" if "@" in self.name else "phone") if self.kind == "contact" else self.kind
            nouns = (*self.key.split(), self.head, *self.aliases, *_KIND_NOUNS.get(kind, ()),
                     *([self.relation] * (self.relation != SELF)))
            self._words = (stamp, {_stem(w) for w in nouns if w})
        return self._words[1]


# --- references --------------------------------------------------------------------------------------
PERSONAL = {"he": "male", "him": "male", "his": "male", "himself": "male", "hes": "male",  # "hes" typed for "he's"
            "she": "female", "her": "female", "hers": "female", "herself": "female", "shes": "female"}
THING = ("it", "its", "itself")
PLURAL = ("they", "them", "their", "theirs", "those", "these")
PLACE = ("there",)
RELATIONS = ("son", "daughter", "wife", "husband", "partner", "mother", "mum", "mom", "father", "dad", "brother",
             "sister", "grandson", "granddaughter", "grandma", "grandad", "landlord", "landlady", "neighbour",
             "neighbor", "colleague", "boss", "friend", "child", "kid", "kids", "children", "baby", "tenant",
             "flatmate", "girlfriend", "boyfriend", "fiance", "fiancee", "fiancé", "fiancée", "nephew", "niece", "aunt",
             "uncle", "grandmother", "grandfather", "nan", "stepson", "stepdaughter", "housemate", "cofounder",
             "co-founder", "accountant", "solicitor", "carer", "childminder")
PEOPLE_NOUNS = RELATIONS + ("engineer", "driver", "technician", "courier", "doctor", "vet", "nurse", "agent",
                            "manager", "plumber", "electrician", "receptionist", "dentist", "pharmacist",
                            "advisor", "adviser", "man", "woman", "lady", "guy", "person", "owner", "tutor")
PETS = ("dog", "cat", "puppy", "kitten", "beagle", "terrier", "spaniel", "labrador", "collie", "rabbit", "pony",
        "horse", "parrot", "hamster", "tom")
FEMALE_RELATIONS = ("daughter", "wife", "mother", "mum", "mom", "sister", "granddaughter", "grandma", "landlady",
                    "girlfriend", "fiancee", "niece", "aunt")
MALE_RELATIONS = ("son", "husband", "father", "dad", "brother", "grandson", "grandad", "landlord", "boyfriend",
                  "fiance", "nephew", "uncle")
PLURAL_PEOPLE = ("kids", "children", "parents", "family", "people", "team", "staff")
SELF = "self"  # the relation of the name a user introduces themselves with
PARENTS = ("mum", "mom", "dad", "mother", "father", "grandma", "grandad", "nan")  # said bare, like a name: "Dad's"
_RELATION = rf"(?:{'|'.join(RELATIONS)})(?:-in-law)?"
DETERMINERS = r"the|my|our|your|his|her|their|this|that|these|those"
_REFERENCE = re.compile(
    rf"\b(?:(?P<one>(?:that|this|the)\s+(?:(?P<one_mod>[\w\"'-]+)\s+)?one)(?![\w-])"
    rf"|(?P<other>the other (?P<other_head>[a-z]+))"
    rf"|(?P<rel>(?:(?:my|our) {_RELATION}|(?:{'|'.join(PARENTS)}))(?:'?s)?)\b"
    rf"|(?P<def>(?:the|that|this|those|these|my|our|your) (?P<def_head>[£$€]?[a-z0-9]+))"
    rf"|(?P<pro>{'|'.join(list(PERSONAL) + list(THING) + list(PLURAL) + list(PLACE))}|that|this))\b"
    rf"|\b(?P<owner>(?-i:[A-Z][\w-]*)'s)(?= [a-z])", re.I)
Found = tuple[str, str, str, str | None, int, int, bool]  # name, kind, head, relation, start, end, proper
Want = tuple[str, tuple[str, ...]]  # how to match ("pronoun", "relation", "phrase", "given", "other", "one"), its words
_NUMBERS = frozenset("one two three four five six seven eight nine ten".split())
_NOUN_PHRASE = re.compile(  # after a determiner, a number or a possessive ("the council's approval letter")
    rf"\b(?:{DETERMINERS}|a|an|some|any|another|both|each|every|{'|'.join(_NUMBERS)}"
    rf"|(?!(?:it|that|there|here|what|who|he|she|let|where)'s)[a-z]+'s)"
    rf"(?:\s+(?:pair|set|couple|box|bag|pack|packet|bottle|bunch)\s+of)?"  # "a pair of varifocals": the varifocals
    rf"\s+((?:[a-z][a-z-]+\s+){{0,2}}[a-z][a-z-]+)", re.I)
_CAPITALISED = re.compile(r"\b[A-Z][a-zA-Z'’-]+(?:\s+(?:[A-Z][a-zA-Z'’-]+|\d[\w.]*(?:\s?(?:mg|ml|g|kg|cm|mm|GB|TB))?))*")
_NOT_THINGS = frozenset("""one other same way time thing things lot bit moment minute minutes hour hours end week
weeks day month months year years morning afternoon evening night today tomorrow yesterday problem issue question
answer help thanks chance point case while rest meantime fact idea sort kind number details detail info information
system number world place phone call line chat new old different bad big small little important damaged broken front
back first second third last next best cheapest earliest latest""".split())
_CONTENT = re.compile(r"[a-z0-9]+")

# corrections: a turn with one of these supersedes earlier facts of the same attribute
CORRECTION = re.compile(  # the turn corrects something: a denied value ("not X") may replace a fact
    r"\b(?:not|no longer|instead|actually|sorry|correction|mistake|wrong|typo|meant|changed?|moved|new (?:address|number|"
    r"email|phone|mobile)|update[ds]?|scratch that|i misspoke|misread)\b", re.I)
SWITCH = re.compile(  # the user's own value changed: a new one replaces the old even without naming it
    r"\b(?:no longer|moved|new (?:address|number|email|phone|mobile)|changed|now at|update[ds]?|correction|wrong|typo|"
    r"i meant|should (?:be|have said))\b", re.I)
_NOT_VALUE = re.compile(r"\bnot\s+([^,.;!?]+)", re.I)
_PIECE = r"[\w£$.-]*\d[\w£$.-]*"  # a piece of a value has a digit: "2QF", "14", "£40"
_PIECE_FOR_PIECE = re.compile(  # "2QF, not 2QE"; "Flat 14, not Flat 4", "BR4 7TW, not BR4 7TN" (the shared word kept)
    rf"(?:\b(?P<word>[A-Za-z][A-Za-z0-9]*)\s+)?(?P<new>\b(?:{_PIECE}))\b,?\s+(?i:not)\s+(?:(?i:(?P=word))\s+)?(?P<old>{_PIECE})\b"
    r"(?=\s*(?:[,.;!?)]|$|(?i:and|but|so|please)\b))")  # the denied part is just the piece, not "37 Larch Close"


class EntityGraph:
    """One conversation's graph. `observe` each user turn (facts, mentions, references resolved against
    what came before) and `mention` each reply."""

    def __init__(self, marker: PersistenceMarker | None = None):
        self.marker = marker or PersistenceMarker.default()
        self.graph = nx.MultiDiGraph()
        self.graph.add_node(USER, kind="user")
        self.entities: dict[str, Entity] = {}
        self.facts: list[Fact] = []
        self.resolutions: dict[int, list[Resolution]] = {}
        self.last_reply: str | None = None  # what a short answer in the next user turn answers ("Bank transfer.")
        self.ledger = ValueLedger()  # every date, time, amount and measure said, for a change to find what it replaces
        self.user_named: set[str] = set()  # nodes of the entities a user turn named ("the code I gave you")

    # --- building ------------------------------------------------------------------------------
    def observe(self, turn: int, text: str) -> tuple[list[Span], list[Resolution]]:
        """A user turn: resolve its references against earlier turns first, then record its mentions
        and facts. Returns the persistent spans marked and the resolutions."""
        text = text.replace("\u2019", "'")
        resolved = self.resolve(turn, text)
        spans = self.marker.mark(text, self.last_reply)
        self._mention(turn, text, "user", spans)
        for resolution, entity in resolved:  # a referent is mentioned again (but not named: not an antecedent)
            entity.mentions.append((turn, REFERRED))
            self.graph.add_edge(f"turn:{turn}", f"entity:{entity.key}", kind="refers", span=resolution.span)
        self._facts(turn, text, spans)
        self._replaced(turn, text, values(text, spans))
        self.resolutions[turn] = [resolution for resolution, _ in resolved]
        return spans, self.resolutions[turn]

    def mention(self, turn: int, text: str, changes: bool = True) -> None:
        """A reply: its named entities gain salience (replies name what "it" will refer to), and, when it
        `changes` values (a reply on record: scripted, or an operator's), a value it moves replaces the
        earlier one (the assistant books the slot, and moves it). A reply the small model decoded may invent
        a move, so its values are only recorded: what the user said stays current."""
        text = text.replace("\u2019", "'")
        self.last_reply = text
        spans = value_spans(text)  # a reply's cue clauses are not the user's wishes
        self._mention(turn, text, "assistant", spans)
        found = values(text, spans)
        if changes:
            self._replaced(turn, text, found)  # "Moved: your first lesson is now Thursday 12 June"
        else:
            self.ledger.record(turn, text, found)

    def _mention(self, turn: int, text: str, role: str, spans: list[Span]) -> None:
        """Record the entities a text names; a mention weighs more the later it comes in the text, and
        little when the text denies it."""
        self.graph.add_node(f"turn:{turn}", kind="turn", turn=turn)
        node = self.graph.nodes[f"turn:{turn}"]
        node["text"] = f"{node.get('text', '')} {_key(text)} "  # its words, to find where an entity was last named
        named: list[tuple[Entity, int, int]] = []
        nouns: list[tuple[Entity, int, int]] = []  # the entities of noun phrases, with where they were
        denied = [(m.start(1), m.end(1)) for m in _NOT_VALUE.finditer(text)]  # "70 Poplar Lane, not 37 Larch Close"
        for name, kind, head, relation, start, end, proper in self._found(text, role, spans, node["text"]):
            entity = self._entity(name, kind, head, relation)
            weight = ROLE_WEIGHT[role] * (1 + LATE * start / len(text)) * (DENIED if _inside(start, end, denied) else 1)
            entity.mentions.append((turn, weight))
            self.graph.add_edge(f"turn:{turn}", f"entity:{entity.key}", kind="mentions", role=role, turn=turn)
            if role == "user":
                self.user_named.add(f"entity:{entity.key}")
            if not proper:
                nouns.append((entity, start, end))
            elif kind not in ("date", "amount", "contact", "address"):
                named.append((entity, start, end))
        self._link(text, named, nouns)

    def _found(self, text: str, role: str, spans: list[Span], said: str) -> list[Found]:
        """(name, kind, head, relation, start, end, proper) of the values, names and noun phrases of a text;
        `said` is the turn's words so far, where a reply's name may have come with its relation ("my brother
        reece" typed, "Reece" in the reply)."""
        found = []
        for span in spans:
            if span.type in ("preference", "taboo"):
                continue
            named = span.attribute in ("name", "related name")
            kind = {"identity": "person" if named else "name" if span.attribute == "proper name" else "code"}.get(
                span.type, span.type)
            if kind in ("person", "name") and _key(span.text).removesuffix("s") in CALENDAR:  # "Mondays, my wife": no one
                kind = "date"
            relation = _relation_of(text, span.start, span.end, said) if kind in ("person", "name") else None
            if relation is None and role == "user" and span.attribute == "name" and not _THEIR_NAME.search(
                    text[:span.start]):
                relation = SELF  # "I'm Maureen Pettigrew": the user, never "he" or "she" in their own words
            kind = "pet" if relation in PETS else "person" if relation or span.text.split()[0].lower() in _TITLES else kind
            head = span.text.split()[0].lower() if kind in ("person", "name") else span.attribute.split()[0]
            found.append((span.text, kind, head, relation, span.start, span.end, True))
        for start, end, kind in self._names(text, role):
            if not _inside(start, end, [f[4:6] for f in found]):
                name = text[start:end]
                relation = _relation_of(text, start, end, said) if kind in ("name", "person") else None
                kind = "pet" if relation in PETS else "person" if relation else kind
                thing = kind == "thing"  # "The Salt Path", "GP": named like a noun ("Her GP is Dr Anand")
                found.append((name, kind, name.split()[-1 if thing else 0].lower(), relation, start, end, not thing))
        for match in _NOUN_PHRASE.finditer(text):
            words, end = _phrase_at(text, match.start(1), 4)
            words = words[-2:]  # "the thin black emergency hose": the emergency hose
            start = end - len(" ".join(words))
            if words and not _inside(start, end, [f[4:6] for f in found]):
                head = words[-1]
                kind = "pet" if head in PETS else "person" if head in PEOPLE_NOUNS else "thing"
                found.append((" ".join(words), kind, head, head if head in RELATIONS else None, start, end, False))
        return found

    def _link(self, text: str, named: list[tuple[Entity, int, int]], nouns: list[tuple[Entity, int, int]]) -> None:
        """What a text says about the names in it: the nouns they are called by ("claim CLM-77120", "the
        engineer, Kieran"), the relation a name is introduced with ("My mother-in-law is coming. Dorothy
        Keane, 71"; "My husband ... His name is Tomasz"), and a gender from the pronoun that follows."""
        _learn_genders(text, named)
        for entity, start, _ in named:
            entity.aliases.update(_lead_nouns(text, start))
            if entity.kind in ("name", "person") and entity.relation is None and _THEIR_NAME.search(text[:start]):
                self._name_relation(entity, _THEIR_NAME.search(text[:start]).group(1).lower())
        for noun, start, end in nouns:
            head = noun.head
            for entity, name_start, name_end in named:
                between = text[end:name_start] if name_start >= end else text[name_end:start]
                compound = name_start < end and not between.strip()  # "a Brightwater warranty" is no Brightwater
                if len(between) < 20 and _APPOSITION.fullmatch(between) and not compound:
                    entity.aliases.add(head)
                    self.graph.add_edge(f"entity:{entity.key}", f"entity:{noun.key}", kind="alias")
                    if entity.kind != "code" and noun is not entity and _CLOSED.match(text, name_end) \
                            and not text[name_start:name_end].endswith("'s"):
                        noun.same_as = entity.key  # a code keeps its noun ("the complaint"); "in a gravel scheme,
                        # Tomasz uses" and "the chair is Dev's" say nothing of who the noun is
            following = min(((s, e) for e, s, _ in named if s >= end and e.kind in ("name", "person")), default=None,
                            key=lambda se: se[0])
            if re.fullmatch(_RELATION, head) and following and _NEXT_SENTENCE.fullmatch(text[end:following[0]]):
                self._name_relation(following[1], head)

    def _name_relation(self, entity: Entity, relation: str) -> None:
        """The name is the user's `relation` ("his" / "her": the latest relation of that gender said bare and
        not yet named)."""
        if relation in ("his", "her"):
            gender = "male" if relation == "his" else "female"
            held = {e.relation for e in self.entities.values() if e.key != e.relation}
            bare = [e for e in self.entities.values() if e.key == e.relation and e.relation not in held
                    and _gender(e) == gender]
            if not bare:
                return
            relation = max(bare, key=lambda e: e.last).relation
        if entity.relation is None:
            entity.relation, entity.kind = relation, "person"
            self.graph.add_edge(USER, f"entity:{entity.key}", kind="relation", relation=relation)

    def _entity(self, name: str, kind: str, head: str, relation: str | None) -> Entity:
        name = name.removesuffix("'s") if kind in ("name", "person") else name  # "Dev's" is Dev
        key = _key(name)
        entity = self.entities.get(key) or self._same_person(key, kind)
        if entity is None:
            entity = self.entities[key] = Entity(key, name, kind, head, relation)
            self.graph.add_node(f"entity:{key}", kind=kind, name=name)
        else:
            entity.name = name
            if entity.kind == "name" and kind != "name":
                entity.kind = kind
            entity.relation = entity.relation or relation
        if relation:  # "my daughter Ellie": the relation noun now means Ellie
            self.graph.add_edge(USER, f"entity:{entity.key}", kind="relation", relation=relation)
        return entity

    def _same_person(self, key: str, kind: str) -> Entity | None:
        """The entity a name is part of, or that is part of it: "Kieran" after "Kieran Doyle", "Mr Osei"
        after "Osei", "Maureen" after "I'm Maureen Pettigrew"; a short form of a first name is part of it
        too ("Ray" after "Raymond Alcott")."""
        words = set(key.split()) - _TITLES
        if kind not in ("name", "person") or not words:
            return None
        return next((e for e in reversed(self.entities.values()) if e.kind in ("name", "person")
                     and (words < (known := set(e.key.split())) or 0 < len(known) < len(words) and known < words
                          or _short_form(key, _first_name(e)))), None)

    def _names(self, text: str, role: str) -> list[tuple[int, int, str]]:
        """Capitalised names (start, end, kind), without the words that are capitalised only because a
        sentence starts with them ("Thanks", "It's"), a reply's labels ("Updated:") or possessive "'s";
        "Mr Osei" is a person, "The Salt Path" a thing, "Thursday" a date."""
        out = []
        for match in _CAPITALISED.finditer(text):
            start, words = match.start(), [_CLITIC.sub("", w) for w in match.group(0).split()]
            while words and (words[0].lower() in STOPWORDS or words[0].lower() in _COMMON_STARTS) and words[0] != "The":
                start = text.index(words[1], start + len(words[0])) if len(words) > 1 else start
                words = words[1:]
            if not words or not words[0][0].isupper() or words[0] == "The" and len(words) == 1:
                continue
            end = start + len(" ".join(words)) if len(words) > 1 else start + len(words[0])
            first, last, label = words[0].lower(), words[-1].lower(), text[end:end + 1] == ":"
            speaker = label and role == "user" and not text[:start].strip(" *-") and first in given_names()
            # a speaker's label: "Helen: can I ...", not "Correction: it's ..."
            if len(words) == 1 and (label and not speaker or _at_sentence_start(text, start) and not label
                                    and first not in self.entities and not self._same_person(first, "name")
                                    and first not in given_names()):
                continue  # "Updated:", "Company:"; "Perfect." (a known name, a given name, a speaker's "Helen:" stay)
            kind = ("date" if first.removesuffix("s") in CALENDAR else "person" if first in _TITLES or speaker else
                    "thing" if first == "the" or words[0].isupper() and len(words[0]) > 1 or last in _ORGANISATIONS
                    or any(c.isdigit() for c in match.group(0)) else  # "The Salt Path", "MOT", "Care 5", "Labs Ltd"
                    "place" if last in _STREETS or _LOCATIVE.search(text[max(0, start - 8):start]) else "name")
            out.append((start, end, kind))
        return out

    def _facts(self, turn: int, text: str, spans: list[Span]) -> None:
        """Record the turn's facts. In a correcting turn, a piece replaces the piece it denies ("2QF, not
        2QE" and "HF4 7DR, not 7RD" patch the address holding 2QE or 7RD), a value replaces the current
        facts it denies ("70 Poplar Lane, not 37 Larch Close"), and with a switch cue ("we moved", "new
        email") a value replaces the current one of an attribute the user has one of at a time."""
        correcting, switching = bool(CORRECTION.search(text)), bool(SWITCH.search(text))
        negated = [(m.start(1), m.end(1)) for m in _NOT_VALUE.finditer(text)]
        denied = [text[a:b].strip().lower() for a, b in negated]
        patched: set[str] = set()  # values patched this turn: a span inside one is not a fact of its own
        if correcting:
            for match in _PIECE_FOR_PIECE.finditer(text):
                word = f"{match.group('word')} " if match.group("word") and text[match.end("new"):].lower().find(
                    f"not {match.group('word').lower()} ") >= 0 else ""
                wrong, right = (word + match.group("old")).lower(), word + match.group("new")
                for old in self.current_facts():
                    if _contains_piece(old.value, wrong) and len(wrong) < len(old.value):
                        patched.add(self._patch(old, wrong, right, turn))
        for span in spans:
            if _inside(span.start, span.end, negated) or any(span.text in value for value in patched):
                continue  # the value the user says is wrong ("not 37 Larch Close"), or a piece already patched in
            attribute = span.attribute if span.type not in ("preference", "taboo") else f"{span.type}:{span.attribute}"
            for old in (f for f in self.current_facts() if correcting and f.value != span.text and f.type == span.type):
                if any(d and (d in old.value.lower() or old.value.lower() in d) for d in denied):
                    self._supersede(old, span.text, turn)  # "70 Poplar Lane, not 37 Larch Close"
                elif switching and old.attribute == attribute and _single_valued(attribute):
                    self._supersede(old, span.text, turn)  # "we moved, we're at ... now"
            self._add(Fact(attribute, span.text, span.type, turn))
        if correcting:
            self._denied_pairs(turn, text, spans)
            self._transposed(turn, text, spans)
        self._switched_codes(turn, text)
        self._moved_dates(turn, text, spans)

    def _denied_pairs(self, turn: int, text: str, spans: list[Span]) -> None:
        """"124, not 110", "18 m, not 14.5", "it's 2985, not 2958": a value denied beside its replacement that
        no fact holds as a piece (a piece of a fact is patched above). The fact whose whole value it is is
        superseded; a value never recorded (a count, a measure, a code no cue marked) is recorded as superseded,
        so the notes and `stale()` say which one is wrong."""
        for match in _NEW_NOT_OLD.finditer(text):
            new, wrong = match.group("new").strip().rstrip(",.:"), match.group("old").rstrip(",.:")
            if _plain(new) == _plain(wrong) or len(_plain(wrong)) < 2:
                continue  # "7 and 2, not 2 and 7": no value of its own
            if any(f.value == new and f.valid_from_turn == turn for f in self.facts if not f.current):
                continue  # the piece patch above wrote it
            holder = next((s for s in spans if s.start <= match.start("new") < s.end), None)
            value = holder.text if holder else new
            earlier = [f for f in self.current_facts() if f.valid_from_turn < turn]
            old = [f for f in earlier if _plain(f.value) == _plain(wrong)]
            if not old and any(_contains_piece(f.value, wrong) for f in earlier):
                continue
            if _is_day_of_month(wrong) and not old:
                continue  # "not the 14th": a date, left to _moved_dates
            attribute, kind = (old[0].attribute, old[0].type) if old else (holder.attribute, holder.type) if holder \
                else ("amount", "amount") if re.search(r"[£$€]", value + wrong) else ("number", "amount")
            if not old:
                old = [Fact(attribute, wrong, kind, turn)]
                self.facts.append(old[0])
            for fact in old:
                self._supersede(fact, value, turn)
            self._add(Fact(attribute, value, kind, turn))

    def _transposed(self, turn: int, text: str, spans: list[Span]) -> None:
        """In a correcting turn, a number or code one slip away from a current fact's (two neighbouring
        characters swapped, or one changed: "It's 4781" after 4718, "87,400" after 97,400) replaces it."""
        values = [s.text for s in spans if s.type not in ("date", "preference", "taboo")]
        values += [m.group(0) for m in _CODE.finditer(text) if not any(m.group(0) in v for v in values)]
        for value in values:
            plain = _plain(value)
            if sum(c.isdigit() for c in plain) < 3:
                continue
            for old in self.current_facts():
                if old.valid_from_turn < turn and old.type != "date" and _one_slip(_plain(old.value), plain):
                    self._supersede(old, value, turn)
                    self._add(Fact(old.attribute, value, old.type, turn))

    def _switched_codes(self, turn: int, text: str) -> None:
        """"New code 9140", "Gate PIN ... change to 8830", "Reset the code. It's 7316 now": a code switched to
        replaces the latest current value of the same shape (as many characters, digits where it has digits)
        stated in a turn that used the same word for it (code, PIN, password): an order number of four digits
        is not the key safe's code."""
        word = _CODE_WORD.search(text)
        if word is None:
            return
        said = lambda fact: f" {word.group(0).lower()} " in self.graph.nodes.get(  # noqa: E731
            f"turn:{fact.valid_from_turn}", {}).get("text", "")
        for match in _SWITCH_TO.finditer(text):
            value = match.group("value") or match.group("now")
            same = [f for f in self.current_facts() if f.valid_from_turn < turn and f.type not in ("date", "amount")
                    and _shape(f.value) == _shape(value) and f.value != value and said(f)]
            if same:
                old = max(same, key=lambda f: f.valid_from_turn)
                self._supersede(old, value, turn)
                self._add(Fact(old.attribute, value, old.type, turn))

    def _moved_dates(self, turn: int, text: str, spans: list[Span]) -> None:
        """"Thursday's no good ... could we have Saturday 19 April instead?", "the 10th won't work, can we make
        it Thursday the 12th?", "Tuesday 7 April, not the 14th": a date of an earlier turn whose weekday or day
        of the month this turn names, outside its new date, in a turn that asks to move (or right after "not"),
        is replaced by the new date: the first after the cue to move, else the last before the denial."""
        dates = [s for s in spans if s.type == "date" and s.attribute == "date"]
        if not dates:
            return
        cue, named = _MOVE.search(text), list(DAY_NAMED.finditer(text))
        if cue is not None:
            new = next((d for d in dates if d.start >= cue.start()), dates[-1])
            named = [m for m in named if not new.start <= m.start() < new.end]
        else:
            named = [m for m in named if _DENIED_BEFORE.search(text[:m.start()])]
            new = next((d for d in reversed(dates) if named and d.end <= named[0].start()), None)
        if new is None or not named:
            return
        for old in self.current_facts():
            if old.type == "date" and old.attribute == "date" and old.valid_from_turn < turn and old.value != new.text \
                    and any(names_day(old.value, m) for m in named):
                self._supersede(old, new.text, turn)

    def _replaced(self, turn: int, text: str, found: list[Value]) -> None:
        """A turn's values that replace earlier ones (memory/slots.py): the earlier one's current facts are
        superseded (one said in a reply only is recorded as superseded), and the new value is a current fact.
        A value a rule above already moved this turn is left as it is."""
        moved = {_plain(f.superseded_by or "") for f in self.facts if f.invalid_from_turn == turn}
        gone = {_plain(f.value) for f in self.superseded()}
        for old, new, kind in self.ledger.replaced(turn, text, found, gone):
            if _plain(new) in moved:
                continue
            held = [f for f in self.current_facts() if _plain(f.value) == _plain(old) and f.valid_from_turn < turn]
            if not held:
                said = next(s.turn for s in self.ledger.said if _plain(s.text) == _plain(old))
                attribute = "measure" if kind.startswith("measure:") else kind
                held = [Fact(attribute, old, "date" if kind in ("date", "time") else "amount", said)]
                self.facts.append(held[0])
            for fact in held:
                self._supersede(fact, new, turn)
            self._add(Fact(held[0].attribute, new, held[0].type, turn))
        self.ledger.record(turn, text, found)

    def _patch(self, old: Fact, piece: str, new: str, turn: int) -> str:
        """Replace the denied piece of an old value (or the whole, when the new piece is written whole
        around it); the patched whole is the new fact (returned)."""
        index = _piece_at(old.value, piece)
        head, tail = old.value[:index], old.value[index + len(piece):]
        whole = new.lower().startswith(head.lower()) and new.lower().endswith(tail.lower())  # "RW-5X28-QT, not 5X82"
        patched = new if whole else head + new + tail
        self._supersede(old, patched, turn)
        self._add(Fact(old.attribute, patched, old.type, turn))
        return patched

    def _supersede(self, old: Fact, value: str, turn: int) -> None:
        old.invalid_from_turn, old.superseded_by = turn, value
        self._edge(old)

    def _add(self, fact: Fact) -> None:
        if not any(old.current and old.attribute == fact.attribute and old.value == fact.value for old in self.facts):
            self.facts.append(fact)
            self._edge(fact)

    def _edge(self, fact: Fact) -> None:
        key = _key(fact.value)
        if f"entity:{key}" not in self.graph:
            self.graph.add_node(f"entity:{key}", kind=fact.type, name=fact.value)
        self.graph.add_edge(USER, f"entity:{key}", key=f"{fact.attribute}@{fact.valid_from_turn}", kind="fact",
                            attribute=fact.attribute, valid_from_turn=fact.valid_from_turn,
                            invalid_from_turn=fact.invalid_from_turn)

    # --- reading -------------------------------------------------------------------------------
    def resolve(self, turn: int, text: str) -> list[tuple[Resolution, Entity]]:
        """The references of a turn, each with the most salient compatible entity of earlier turns."""
        out = []
        earlier = [(e, e.words()) for e in self.entities.values() if e.mentions[0][0] < turn]
        names = [(start, text[start:end]) for start, end, kind in self._names(text, "user")
                 if kind in ("name", "person")]
        things = [(e, words) for e, words in earlier if e.kind == "thing"]
        for match in _REFERENCE.finditer(text):
            owned = _owned(match, text)
            found = owned and self._best(turn, owned[1], things)
            if found and found[1] == len(owned[1][1]):  # "Poppy's present": the present named before
                out.append((Resolution(text[match.start():owned[0]], match.start(), "definite", found[0].name,
                                       self._antecedent(found[0], turn)), found[0]))
                continue
            reference = _reference(match, text)
            if reference is None:
                continue
            kind, end, want = reference
            here = self._named_here(text, names, match.start(), want)
            if here is False:
                continue  # "And Poppy, does she ...": she is the Poppy just named, none of the earlier turns' people
            found = (here or self._named_after(text, end, want) or _chained(out, want) or self._best(turn, want, earlier)
                     or self._said_before(turn, want))
            if found:
                entity, used = found
                if used < len(want[1]):  # "the engineer call first": the phrase that matched is "the engineer"
                    end = _words_end(text, match.end() - len(match.group(0).split()[-1]), used)
                out.append((Resolution(text[match.start():end], match.start(), kind, entity.name,
                                       self._antecedent(entity, turn)), entity))
        return out + self._bare(turn, text, earlier, [(r.start, r.start + len(r.span)) for r, _ in out])

    def _bare(self, turn: int, text: str, earlier: list[tuple[Entity, set[str]]],
              taken: list[tuple[int, int]]) -> list[tuple[Resolution, Entity]]:
        """Noun phrases that open a sentence without a determiner, as terse messages write them ("Banners: 2 of
        them", "Certificate came today", "Netting quote?"): a reference when an earlier entity goes by the
        phrase's head noun (all its words matched, nothing said before it in the sentence)."""
        out = []
        for opening in _OPENING.finditer(text):
            start = opening.end()
            words, end = _phrase_at(text, start, 2)
            if not words or words[0] in _COMMON_STARTS or _inside(start, end, taken):  # resolved already
                continue
            found = self._best(turn, ("phrase", tuple(words)), earlier)
            if found and found[1] == len(words):
                out.append((Resolution(text[start:end], start, "definite", found[0].name,
                                       self._antecedent(found[0], turn)), found[0]))
        return out

    def _named_here(self, text: str, names: list[tuple[int, str]], at: int,
                    want: Want) -> tuple[Entity, int] | bool | None:
        """For a subject "he" or "she", the name its own turn gave just before it (in its sentence or the one
        before): that person, or False when the name is new (nothing earlier to resolve to); None when there is
        none or it does not fit."""
        if want[0] != "pronoun" or want[1][0] not in ("he", "she", "hes", "shes"):  # "her", "him" are seldom the name's
            return None
        start, name = max(((s, n) for s, n in names if s < at), default=(-1, ""))
        if start < 0 or not _NEAR.fullmatch(text[start:at]):
            return None
        entity = self.entities.get(_key(name)) or self._same_person(_key(name), "name")
        if entity is None:
            return False
        return (entity, 1) if _compatible(entity, want[1][0]) else None

    def _named_after(self, text: str, end: int, want: Want) -> tuple[Entity, int] | None:
        """A relation named on the spot ("my fiancé is Dev Malhotra", "my brother Reece"): that person, when
        known from earlier turns."""
        name = _NAME_AFTER.match(text[end:]) if want[0] == "relation" else None
        key = name and _key(name.group(1))
        entity = key and (self.entities.get(key) or self._same_person(key, "name"))
        return (entity, 1) if entity else None

    def _said_before(self, turn: int, want: Want) -> tuple[Entity, int] | None:
        """A phrase no entity goes by whose head noun an earlier turn said ("the café" after "opposite the
        café" in a phrase the extractor missed, "the cheque" after "a cheque"): the thing named by the
        phrase's words that turn said, first mentioned there."""
        if want[0] not in ("phrase", "given") or not want[1]:
            return None
        words = [w for w in want[1] if w not in STOPWORDS]
        head = words[-1] if words else ""
        for earlier in range(turn - 1, -1, -1):
            said = self.graph.nodes[f"turn:{earlier}"].get("text", "") if f"turn:{earlier}" in self.graph else ""
            if len(head) > 2 and any(f" {form} " in said for form in _forms(head)):
                name = " ".join(w for w in words if any(f" {form} " in said for form in _forms(w)))
                entity = self._entity(name, "thing", head, None)
                if not entity.mentions:
                    entity.mentions.append((earlier, 1.0))
                    self.graph.add_edge(f"turn:{earlier}", f"entity:{entity.key}", kind="mentions", turn=earlier)
                return entity, len(want[1])
        return None

    def _antecedent(self, entity: Entity, turn: int) -> int:
        """The latest earlier turn whose text names the entity (a pronoun or "the X" does not name it): what
        long-term memory re-injects. A person is named by any one of their names ("Kieran" for Kieran Doyle)."""
        names = _name_words(entity) if entity.kind in ("person", "name") else [entity.key]
        for earlier in range(turn - 1, -1, -1):
            text = self.graph.nodes[f"turn:{earlier}"].get("text", "") if f"turn:{earlier}" in self.graph else ""
            if any(f" {name} " in text for name in names):
                return earlier
        return max(t for t, _ in entity.mentions if t < turn)

    def _best(self, turn: int, want: Want, earlier: list[tuple[Entity, set[str]]]) -> tuple[Entity, int] | None:
        """The best of the earlier entities (with the words they go by) for what a reference wants: how well
        it matches first, then salience; with how many of a phrase's words it matched ("the claim" of
        "the claim cover")."""
        how, value = want
        used = len(value)
        candidates = [e for e, _ in earlier]
        if how == "pronoun":  # a noun said in apposition to a name stands for it before "she" asks
            named = [e for _, e in self._named_for([(1, e) for e in candidates])]
            scored = [(1, e) for e in _named_instead(named) if _compatible(e, value[0])]
        elif how == "relation":
            scored = _related(candidates, value[0])
        else:  # a phrase ("the eye test"), "the other address", "the broken one"; "the claim cover" may end in a verb
            if how == "given":  # "the code I gave you": one the user named
                earlier = [(e, words) for e, words in earlier if f"entity:{e.key}" in self.user_named]
            stems = [_stem(w) for w in value]
            wanted = set(stems)  # an entity that goes by none of the phrase's words matches no prefix of it
            earlier = [(e, words) for e, words in earlier if not wanted.isdisjoint(words)]
            used, scored = next(((n, found) for n in range(len(stems), 0, -1) if (found := [
                (m, e) for e, words in earlier if (m := _matches(e, words, stems[:n], how != "one"))])), (used, []))
            if not scored and (how == "one" or not value):  # "that one", "the other one": a thing
                scored = [(1, e) for e in candidates if _compatible(e, "it")]
        scored = self._named_for(scored)  # a phrase or relation matched the noun's own words first
        if not scored:
            return None
        word = value[0] if how == "pronoun" else None
        ranked = sorted(scored, key=lambda me: (me[0], me[1].salience(turn - 1) * _prior(me[1], word), me[1].last),
                        reverse=True)
        if how == "other" and len(ranked) > 1:  # "the other address": the best one is the address already in mind
            return ranked[1][1], used
        return ranked[0][1], used

    def _named_for(self, scored: list[tuple[float, Entity]]) -> list[tuple[float, Entity]]:
        """The candidates with a noun phrase said in apposition to a name replaced by the named entity,
        each entity once at its best match: "the trainee" means Mr Wierzbicki, not "trainee solicitor"."""
        best: dict[str, tuple[float, Entity]] = {}
        for match, entity in scored:
            named = self.entities.get(entity.same_as) if entity.same_as else None
            entity = named or entity
            if entity.key not in best or match > best[entity.key][0]:
                best[entity.key] = (match, entity)
        return list(best.values())

    # --- saving ----------------------------------------------------------------------------------
    def state(self) -> dict:
        """Entities, facts (superseded ones included), resolutions and the networkx graph, as plain data."""
        return {"graph": nx.node_link_data(self.graph, edges="edges"),
                "entities": [{**asdict(e), "aliases": sorted(e.aliases)} for e in self.entities.values()],
                "facts": [asdict(fact) for fact in self.facts],
                "resolutions": {turn: [r.as_dict() for r in found] for turn, found in self.resolutions.items()},
                "last_reply": self.last_reply, "ledger": self.ledger.state()}

    @classmethod
    def from_state(cls, state: dict, marker: PersistenceMarker | None = None) -> "EntityGraph":
        graph = cls(marker)
        graph.graph = nx.node_link_graph(state["graph"], edges="edges")
        for fields in state["entities"]:
            entity = Entity(**{**fields, "aliases": set(fields["aliases"]),
                               "mentions": [tuple(mention) for mention in fields["mentions"]]})
            graph.entities[entity.key] = entity
        graph.facts = [Fact(**fields) for fields in state["facts"]]
        graph.resolutions = {int(turn): [Resolution(**r) for r in found] for turn, found in state["resolutions"].items()}
        graph.last_reply = state.get("last_reply")  # absent in sessions saved before it was kept
        graph.ledger = ValueLedger.from_state(state.get("ledger"))  # likewise
        graph.user_named = {v for _, v, d in graph.graph.edges(data=True) if d.get("role") == "user"}
        return graph

    def current_facts(self) -> list[Fact]:
        return [fact for fact in self.facts if fact.current]

    def superseded(self) -> list[Fact]:
        return [fact for fact in self.facts if not fact.current]

    def stale(self) -> list[str]:
        """The pieces of superseded values that their corrections changed ("37 Larch Close" of an address
        now "70 Poplar Lane"; "2QE" of "... HF4 2QE" now "... HF4 2QF"), none of them part of a current
        value and each with three letters or digits at least (a lone "4" is in too many other places):
        what the cache should no longer hold, so that the model reads the current value only."""
        current = " ".join(f.value.lower() for f in self.current_facts())
        pieces = []
        for fact in self.superseded():
            if fact.type not in _STALE_TYPES or fact.attribute in ("related name", "proper name"):
                continue  # a wish's words, or someone else's name: too unsure to drop from the cache
            for piece in _changed_pieces(fact.value, fact.superseded_by or ""):
                if len(_plain(piece)) >= 3 and piece.lower() not in current and piece not in pieces:
                    pieces.append(piece)
        return pieces

    def stats(self, turn: int) -> dict:
        return {"entities": len(self.entities), "facts": len(self.current_facts()),
                "superseded": [f"{f.attribute}: {f.value} -> {f.superseded_by} (turn {f.invalid_from_turn})"
                               for f in self.superseded()],
                "resolutions": [r.as_dict() for r in self.resolutions.get(turn, [])]}


_KIND_NOUNS = {"address": ("address", "postcode", "flat", "house", "place"),
               "phone": ("number", "phone", "mobile", "landline", "contact"), "email": ("email", "address", "contact"),
               "code": ("number", "reference", "ref", "code", "order", "booking", "account", "registration", "serial",
                        "policy"),
               "date": ("date", "day", "appointment", "time", "slot", "week"),
               "amount": ("amount", "charge", "fee", "price", "cost", "total", "limit")}
_KIND_WORDS = frozenset(noun for nouns in _KIND_NOUNS.values() for noun in nouns)


def _learn_genders(text: str, named: list[tuple[Entity, int, int]]) -> None:
    """A he or she after a name, with no other name between, in its sentence or opening the next, tells the
    name's gender and that it is someone ("Kieran Doyle is booked, he'll ring"; "Biscuit is barking again.
    He's our spaniel"), when the name opens its sentence or is a given name: "we're away over Christmas,
    he stays here" says nothing of Christmas."""
    for match in _PERSONAL_WORD.finditer(text):
        before = [(start, entity) for entity, start, end in named if end <= match.start() and
                  entity.kind in ("name", "person", "pet") and entity.relation != SELF]
        start, entity = max(before, key=lambda se: se[0], default=(-1, None))
        between = text[start:match.start()]
        if entity is not None and entity.gender is None and (_at_sentence_start(text, start) or _someone(entity)) and (
                _SENTENCE.fullmatch(between) or _NEXT_SENTENCE.fullmatch(between)):
            entity.gender = PERSONAL[match.group(0).lower()]
            entity.kind = "person" if entity.kind == "name" else entity.kind


_OPENING = re.compile(r"(?:^|[.!?:;\n]\s*|\s-\s|^[-*•]\s*)(?=[A-Za-z])", re.M)  # where a sentence or a list item opens
_THEIR_NAME = re.compile(r"\b(his|her)\s+name(?:'s|\s+is)\s*$", re.I)
_NEXT_SENTENCE = re.compile(r"[^.!?]{0,100}[.!?]\s+")  # the rest of a sentence: what comes next starts the next one
_NAME_AFTER = re.compile(r",?\s+(?:(?:is|was|called|named)\s+)?([A-Z][a-z]+(?:\s+[A-Z][a-z]+)?)")
_SENTENCE = re.compile(r"[^.!?]{0,80}")  # within the name's sentence
_NEAR = re.compile(r"[^.!?]{0,150}(?:[.!?]+\s+[^.!?]{0,150})?")  # the same sentence or the next
_PERSONAL_WORD = re.compile(r"\b(?:he|she)\b", re.I)  # a subject: "her", "his" often mean someone else


def _gender(entity: Entity) -> str | None:
    relation = entity.relation or ""
    if entity.gender or relation in FEMALE_RELATIONS or relation in MALE_RELATIONS:
        return entity.gender or ("female" if relation in FEMALE_RELATIONS else "male")
    return given_names().get(_first_name(entity)) or None if entity.kind in ("name", "person") else None


GIVEN_NAMES = Path(__file__).resolve().parent / "lexicon" / "given-names.tsv"  # lexicon/ links to data/lexicon


@functools.cache
def given_names() -> dict[str, str]:
    """Common given names, lowercase, each with "male", "female" or "" (either): a hand-written list
    (data/lexicon/given-names.tsv), so that "Desmond" is someone before a pronoun says so, and a
    capitalised "Correction" or "Leeds" is not someone "he" can mean."""
    genders = {"m": "male", "f": "female", "u": ""}
    rows = (line.split("\t") for line in GIVEN_NAMES.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#"))
    return {name.strip().lower(): genders[gender.strip()] for name, gender in rows}


def _short_form(name: str, first: str) -> bool:
    """"Ray" of Raymond, "Dom" of Dominic: a single given name that begins a longer first name."""
    return " " not in name and 3 <= len(name) < len(first) and first.startswith(name) and name in given_names()


def _name_words(entity: Entity) -> list[str]:
    """A person's names without their title: "Mr Osei" goes by "osei"."""
    return [w for w in entity.key.split() if w not in _TITLES]


def _first_name(entity: Entity) -> str:
    return next(iter(_name_words(entity)), "")


def _someone(entity: Entity) -> bool:
    """A person or pet, or a name that the given-names list knows."""
    return entity.kind in ("person", "pet") or entity.kind == "name" and _first_name(entity) in given_names()


def _named_instead(candidates: list[Entity]) -> list[Entity]:
    """Without the bare nouns ("the engineer", "my landlord") that a named candidate was introduced as:
    "he" is Kieran Doyle, not "engineer"."""
    called = {noun for e in candidates if e.kind != "thing" for noun in (*e.aliases, e.relation) if noun and noun != e.key}
    return [e for e in candidates if not (e.key == e.head and e.head in called and not e.aliases)]


def _compatible(entity: Entity, word: str) -> bool:
    animate = entity.kind in ("person", "pet", "name")
    if word in PERSONAL:
        gender = _gender(entity)
        return (animate and entity.relation != SELF and gender in (None, PERSONAL[word])
                and entity.head not in PLURAL_PEOPLE)
    if word in PLACE:
        return entity.kind in ("address", "place", "name") or entity.head in ("shop", "branch", "office", "surgery", "station")
    if word in PLURAL:  # things, organisations, people in the plural: not one person
        return not _someone(entity) or entity.head in PLURAL_PEOPLE
    return entity.kind not in ("person", "pet")  # it, that, this, that one


PRIOR_IT = {"thing": 1.0, "name": 0.9, "code": 0.6, "address": 0.2, "date": 0.4, "amount": 0.4, "contact": 0.3}
PRIOR_THERE = {"address": 1.0, "place": 1.0, "name": 0.6, "thing": 0.5}


def _prior(entity: Entity, word: str | None) -> float:
    """How likely a kind of entity is the referent of a pronoun: "it" is seldom an order number."""
    if word in PLACE:
        return PRIOR_THERE.get(entity.kind, 0.3)
    if word in PERSONAL:
        named = entity.name[:1].isupper()  # Kieran, not "the engineer" (or a name not yet known to be someone's)
        known = 2.0 if _gender(entity) == PERSONAL[word] else 1.0
        return known * (1.0 if named else 0.5) if _someone(entity) else 0.3
    if word in PLURAL:  # "they": things in the plural, then what looks like an organisation ("the council", "NGED")
        if entity.kind in ("thing", "person") and entity.head.endswith("s") and not entity.head.endswith("ss"):
            return 1.0
        if entity.kind not in ("thing", "name", "person"):  # codes, dates, amounts are one thing each
            return 0.1
        return 0.8 if entity.kind == "name" or entity.name[:1].isupper() else 0.5
    return PRIOR_IT.get(entity.kind, 0.5)


_STALE_TYPES = ("identity", "contact", "address", "amount", "date")  # the values a correction makes stale
_VALUE_WORD = re.compile(r"[^\s,;]+")


def _changed_pieces(old: str, new: str) -> list[str]:
    """The runs of an old value's words that the new value replaces, as written in the old value, words
    aligned in order ("12 Mill Lane, Ashbourne, DE6 1GB" -> "4 Orchard Close, Ashbourne, DE6 1HT": "12 Mill
    Lane" and "1GB"); words the new value only leaves out are not replaced ("14 Elm Grove, Frome" -> "41 Elm
    Grove": "14" only)."""
    olds, news = list(_VALUE_WORD.finditer(old)), _VALUE_WORD.findall(new)
    matcher = difflib.SequenceMatcher(None, [_plain(w.group(0)) for w in olds], [_plain(w) for w in news], autojunk=False)
    return [old[olds[a].start():olds[b - 1].end()].strip(".")
            for op, a, b, _, _ in matcher.get_opcodes() if op == "replace"]


_MOVE = re.compile(r"\b(?:move[ds]?|moving|make it|instead|push(?:ed)?|swap|brought forward|bring (?:it )?forward|"
                   r"rather than|switch|change (?:it|that) to|won't work|no good|can't do|isn't possible|not possible)\b",
                   re.I)
_NEW_NOT_OLD = re.compile(  # "124, not 110"; "18 m, not 14.5"; "it's 7726 now, not 5093" (not "..., not 37 Larch Close")
    r"(?P<new>[£$€]?\d[\d,.:]*(?:\s?(?!now\b|then\b)[A-Za-z]+)?)(?:\s+(?:now|then))?,?\s+(?i:not)\s+(?:the\s+)?"
    r"(?P<old>[£$€]?\d[\d,.:]*\d|\d)(?![\w])(?=\s*(?:[,.;:!?)\-–]|$|(?i:and|but|so|please|then|now)\b))")
_DENIED_BEFORE = re.compile(r"\bnot\s+(?:the\s+|on\s+(?:the\s+)?)?$", re.I)  # "..., not the 14th"
_SWITCH_TO = re.compile(  # "New code 9140", "change it to 8830", "It's 7316 now"
    r"\b(?:new (?:code|pin|password|number)(?: is)?:?|change[ds]? (?:it |that |the \w+ )?to|reset (?:it |the \w+ )?to)"
    r"\s+(?P<value>[A-Z]{0,3}\d[\d-]{2,}[A-Z]{0,2})\b"
    r"|\b(?:it's|it is|is) (?P<now>[A-Z]{0,3}\d[\d-]{2,}[A-Z]{0,2}) now\b", re.I)
_CODE_WORD = re.compile(r"\b(?:code|pin|password|passcode|combination)\b", re.I)
_CODE = re.compile(r"(?<![\w£$€])[A-Z]{0,3}[£$€]?\d[\d,]*\d[A-Z]{0,2}(?![\w])")


def _is_day_of_month(text: str) -> bool:
    """Whether a text is an ordinal day of the month ("14th", "the 3rd")."""
    match = re.fullmatch(r"(?:the\s+)?([123]?\d)(?:st|nd|rd|th)", text.strip(), re.I)
    return bool(match) and 1 <= int(match.group(1)) <= 31


def _shape(value: str) -> str:
    """A value's shape: each digit a 9, each letter an A ("AB-123" -> "AA-999")."""
    return re.sub(r"[A-Za-z]", "A", re.sub(r"\d", "9", value.strip()))


def _one_slip(old: str, new: str) -> bool:
    """Two codes of one length one slip apart: two neighbouring characters swapped, or one character changed."""
    if len(old) != len(new) or old == new or len(old) < 3:
        return False
    diff = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and old[diff[0]] == new[diff[1]]
                              and old[diff[1]] == new[diff[0]])


def _single_valued(attribute: str) -> bool:
    """Attributes a user has one of at a time: a switch to a new one replaces it even without "not X"
    (preferences accumulate: a later one does not cancel an earlier one unless it denies it)."""
    return attribute in ("address", "postcode", "flat", "email", "name", "phone", "mobile phone")


def _piece_at(value: str, piece: str) -> int:
    """Where a piece stands in a value as a whole token ("4" in "Flat 4, 19 ...", not in "14"); -1 if not."""
    match = re.search(rf"(?<![\w]){re.escape(piece)}(?![\w])", value, re.I)
    return match.start() if match else -1


def _contains_piece(value: str, piece: str) -> bool:
    return _piece_at(value, piece) >= 0


def _key(name: str) -> str:
    return " ".join(_CONTENT.findall(name.lower()))


def _relation_near(text: str, start: int, end: int) -> str | None:
    """The relation a name is introduced with: "my daughter Ellie", "my fiancé is Dev" or "Biscuit, my beagle"."""
    found = _RELATION_BEFORE.search(text[max(0, start - 40):start]) or _RELATION_AFTER.match(text[end:])
    return next(word.lower() for word in found.groups() if word) if found else None


_RELATION_BEFORE = re.compile(  # "my daughter Ellie", "our beagle, Biscuit", "Mum's called Patricia"
    rf"\b(?:(?:my|our)\s+(?:\w+\s+)?({_RELATION}|{'|'.join(PETS)})|({'|'.join(PARENTS)}))"
    rf"(?:,|(?:'s|\s+is|\s+was)?\s+(?:called|named)|\s+(?:is|was))?\s*$", re.I)  # "'s" alone owns: "my husband's Yaris"
_RELATION_AFTER = re.compile(rf",?\s+(?:my|our)\s+(?:\w+\s+)?({_RELATION}|{'|'.join(PETS)})\b", re.I)


_VERBS = frozenset("""is are was were be been has have had do does did can could will would should may might must needs
need wants want keep keeps stopped broke works worked arrived came come comes went go goes says said say got get gets paid
sent left took take takes gave give gives made make makes show shows told put run runs thought found ago""".split())
_OBJECTS = frozenset("the a an you me it him her them us my your our their this that up".split())  # after a verb


def _inside(start: int, end: int, taken: list[tuple[int, int]]) -> bool:
    return any(start < e and s < end for s, e in taken)


def _at_sentence_start(text: str, start: int) -> bool:
    before = text[:start].rstrip()
    return not before or before[-1] in ".!?\"(:\n-*•"


_ORGANISATIONS = frozenset("""ltd limited plc inc llc co council office register hospital school college university
centre center clinic surgery services service books press games labs bank group trust society club team studio studios
shop store pay insurance motors garage""".split())
_STREETS = frozenset("street road lane close avenue drive way parade yard mews court place square crescent terrace".split())
_LOCATIVE = re.compile(r"\b(?:at|in|near|into|around|from)\s+$", re.I)
_CLITIC = re.compile(r"'(?:s|ll|ve|d|re|m)$", re.I)
_TITLES = frozenset(("mr", "mrs", "ms", "miss", "dr"))


_COMMON_STARTS = frozenset("""hello hi hey thanks thank yes yeah no ok okay great lovely right sorry please could can would
will just well oh ah also and but so then now sure perfect brilliant cheers good fine actually honestly what when where
why how who which is are do does did have has any anything one while since""".split())


_DEMONSTRATIVE_PRONOUN = re.compile(  # "that" followed by a verb, a preposition or an adverb stands for a thing
    r"\s*(?:$|[.,!?;:)]|(?:is|was|'s|works|sounds|would|will|should|has|needs|does|can|could|might|must|seems|looks|be|"
    r"been|come|comes|go|goes|cost|costs|include|includes|mean|means|cover|covers|work|happen|take|takes|get|gets|on|in|"
    r"at|for|by|to|before|after|now|too|again|off|up|out|with|from|as|instead|then|all|first|later|please|also)\b)", re.I)


def _reference(match: re.Match, text: str) -> tuple[str, int, Want] | None:
    """A reference's type, where its span ends and what it wants; None for what only looks like one
    ("so that we", "the way", "Poppy's")."""
    if match.group("owner"):
        return None
    if match.group("one"):
        modifier = (match.group("one_mod") or "").strip("\"'").lower()
        how = "other" if modifier == "other" else "one"
        return "demonstrative", match.end(), (how, () if modifier in ("", "other", *_ORDINALS) else (modifier,))
    if match.group("rel"):
        return "relational", match.end("rel"), ("relation", (_relation_word(match.group("rel")),))
    head = "other_head" if match.group("other") else "def_head" if match.group("def") else None
    if head:
        words, end = _phrase_at(text, match.start(head), kinds=True)
        if not words:
            return _demonstrative(match, text)  # "that goes back", "pay that now"
        kind = "demonstrative" if match.group(0).lower().startswith(("that", "this", "those", "these")) else "definite"
        if len(words) == 1 and words[0] in GENERIC_PEOPLE:  # "the man coming on Thursday": someone, as "he" would be
            return kind, end, ("pronoun", (GENERIC_PEOPLE[words[-1]],))
        mine = match.group(0).lower().startswith(("my ", "our "))  # "my number": one the user gave
        how = "other" if head == "other_head" else "given" if mine or _GIVEN.match(text[end:]) else "phrase"
        return kind, end, (how, tuple(words))
    word = match.group("pro").lower()
    return _demonstrative(match, text) if word in ("that", "this") else ("pronoun", match.end(), ("pronoun", (word,)))


def _owned(match: re.Match, text: str) -> tuple[int, Want] | None:
    """The noun phrase a name owns ("Poppy's welcome pack") and where it ends: a reference to the thing
    when an earlier one goes by all of its words."""
    if not match.group("owner") or match.group("owner").lower().removesuffix("'s") in STOPWORDS:
        return None  # "It's", "That's"
    words, end = _phrase_at(text, match.end() + 1)
    return (end, ("phrase", tuple(words))) if words and words[-1] not in PEOPLE_NOUNS else None


def _chained(resolved: list[tuple[Resolution, Entity]], want: Want) -> tuple[Entity, int] | None:
    """A "he" or "she" after a resolved relation or phrase of its own turn that it fits means the same
    ("Can my daughter sit by the window? She gets travel sick")."""
    if want[0] != "pronoun" or want[1][0] not in PERSONAL:
        return None
    return next(((e, 1) for r, e in reversed(resolved) if r.type in ("relational", "definite") and _someone(e)
                 and e.kind != "pet" and _compatible(e, want[1][0])), None)


def _words_end(text: str, start: int, count: int) -> int:
    return start + re.match(rf"[\w'£$€-]+(?: [\w'£$€-]+){{{count - 1}}}", text[start:]).end()


def _demonstrative(match: re.Match, text: str) -> tuple[str, int, Want] | None:
    """A "that" or "this" that stands for a thing; None for a conjunction or a determiner ("so that we",
    "that day")."""
    end = match.start() + 4
    word = text[match.start():end].lower()
    if word not in ("that", "this") or not _DEMONSTRATIVE_PRONOUN.match(text[end:]):
        return None
    return "demonstrative", end, ("pronoun", (word,))


GENERIC_PEOPLE = {"man": "he", "guy": "he", "gentleman": "he", "chap": "he", "bloke": "he", "lad": "he",
                  "woman": "she", "lady": "she", "girl": "she"}
_GIVEN = re.compile(r"\s+(?:that\s+|which\s+)?(?:i|we)(?:'ve)?\s+(?:gave|told|sent|mentioned|said|provided|put)\b", re.I)
_ORDINALS = ("first", "second", "third", "last", "latter", "former", "same", "new", "old")


def _lead_nouns(text: str, start: int) -> list[str]:
    """The nouns right before a name or value, up to a function word or a verb ("I've opened claim
    CLM-77120" -> claim; "warranty number WTY-55203" -> warranty; "engineer Kieran Doyle" -> engineer)."""
    words = re.findall(r"[A-Za-z][\w'-]*", _LEAD.search(text[max(0, start - 40):start]).group(1))
    out = []
    for word in reversed([w.lower() for w in words]):
        if "'" in word or word in STOPWORDS or word in _VERBS or word.endswith(("ed", "ing")) or word in _NOT_THINGS:
            break
        out.append(word)
    return out


_LEAD = re.compile(r"((?:[A-Za-z][\w'-]*[ \t]+){0,3}?)(?:(?:is|was|number|no\.?|:)[ \t]*)?$", re.I)


def _relation_word(span: str) -> str:
    """The relation a relational reference names: "my mums" -> "mum", "My mother-in-law" -> "mother-in-law"."""
    word = span.lower().split()[-1].removesuffix("'s")
    return word[:-1] if word not in RELATIONS and word[:-1] in RELATIONS else word


def _relation_of(text: str, start: int, end: int, said: str) -> str | None:
    """The relation a name comes with in its text, or in the turn's words so far (`said`: the user typed
    "my brother reece", the reply names Reece)."""
    key = _key(text[start:end])
    said_with = (m.group(1) for m in _SAID_RELATION.finditer(said) if said.startswith(f"{key} ", m.end()))
    return _relation_near(text, start, end) or next(said_with, None)


_SAID_RELATION = re.compile(rf" (?:my|our) ({'|'.join(RELATIONS)}) ")


def _phrase_at(text: str, start: int, most: int = 3, kinds: bool = False) -> tuple[list[str], int]:
    """The noun phrase starting here and where it ends, without a tagger: up to `most` words, stopping at
    a function word or a verb-looking one ("the boiler stopped", "the coach collects you"), a vague last
    noun dropped ("the complaint thing") unless `kinds` keeps the nouns values go by ("that number"); none
    before "one" ("the new one" names nothing itself)."""
    match = re.match(r"[£$€]?[\w'-]+(?: [\w'-]+){0,3}", text[start:])
    raw = match.group(0).split(" ") if match else []
    if len(raw) > 1 and raw[0].lower() in ("same", "very", "whole"):  # "the same engineer": the engineer
        return _phrase_at(text, start + len(raw[0]) + 1, most, kinds)
    lower = [w.lower() for w in raw] + [""]
    words = []
    for i, word in enumerate(lower[:min(most, len(raw))]):
        if "'" in word.removesuffix("'s") or not _CONTENT.search(word) or word in STOPWORDS or word in _VERBS \
                or word in _NUMBERS or i and (
                word.endswith(("ed", "ing", "ly")) or word in _NOT_THINGS and not (kinds and word in _KIND_WORDS)
                or word.endswith("s") and not word.endswith("ss") and (lower[i + 1] in _OBJECTS
                                                                       or lower[i + 1][:1].isdigit())):
            break  # "don't", "a chair - Dev", "the boiler stopped", "that branch last time", "the coach collects you"
        words.append(word.removesuffix("'s"))
        if word.endswith("'s"):  # "my mum's boiler": the mum
            break
    if lower[len(words)] in ("one", "ones"):
        return [], start
    while words and (words[-1] in _NOT_THINGS and not (kinds and words[-1] in _KIND_WORDS) or words[-1] in STOPWORDS):
        words.pop()
    return words, start + len(" ".join(raw[:len(words)])) - (2 if words and raw[len(words) - 1].endswith("'s") else 0)


def _matches(entity: Entity, known: set[str], stems: list[str], head_needed: bool = True) -> float:
    """How well a phrase (its words stemmed) names an entity that goes by `known` words: its head noun
    does (2, and 1 more when that noun is not the entity's own name but what a name or value was called:
    "the engineer" is Kieran), each other word it shares (1), and being exactly its name (0.5). Nothing
    without the head, unless only modifiers are asked for ("the broken one")."""
    *modifiers, head = stems or [""]
    shared = sum(m in known for m in modifiers)
    if head_needed:
        if head not in known:
            return 0
        called = entity.kind != "thing" and head not in entity.key.split()
        return 2 + called + shared + 0.5 * (entity.key == " ".join(stems))
    return shared + (head in known)


def _related(candidates: list[Entity], noun: str) -> list[tuple[int, Entity]]:
    """The people introduced with a relation: by name first ("my brother" is Reece, "Dad" the one introduced
    as "my father"), else the noun itself."""
    same = _SAME_RELATION.get(noun, {noun})
    related = [e for e in candidates if (e.relation in same or same & e.aliases) and e.kind != "thing"]
    named = [(2, e) for e in related if e.key not in same and not e.key.endswith(noun)]
    return named or [(1, e) for e in related or [e for e in candidates if e.head == noun]]


_SAME_RELATION = {word: group for group in map(set, (("mother", "mum", "mom"), ("father", "dad"),
                                                   ("grandmother", "grandma", "nan"), ("grandfather", "grandad"),
                                                   ("neighbour", "neighbor"))) for word in group}


def _forms(word: str) -> tuple[str, ...]:
    """A noun as a turn's words may hold it: itself, its singular or its plural ("stools", "stool")."""
    return (word, word[:-1]) if word.endswith("s") and len(word) > 3 else (word, f"{word}s")


def _stem(word: str) -> str:
    """A word as names and phrases share it: "labels" -> "label", "£412" -> "412", "10th" -> "10"."""
    word = word[1:] if word[:1] in "£$€" else word
    if word[:1].isdigit() and word.endswith(("st", "nd", "rd", "th")):
        return word[:-2]
    return word[:-1] if word.endswith("s") and len(word) > 3 else word
