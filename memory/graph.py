"""The conversation's entities, the facts stated about the user, and what a reference in a new turn
points to: a networkx graph, built by rules (no parser model is available offline).

- Nodes: the user, every entity named so far (people, pets, codes, addresses, dates, amounts, products,
  places, the things a definite noun phrase names: "the boiler") and every turn.
- Edges: turn -mentions-> entity (with role; salience decays with the turns since), and user -fact->
  value entity with `attribute`, `valid_from_turn` and `invalid_from_turn`. Facts are Graphiti-style: a
  correction ("it's 2QF, not 2QE"; "we moved, we're at ... now") closes the old fact's validity and keeps
  it, marked superseded, so what the user said before stays queryable.
- Coreference: a pronoun, "that one", "the other address" or "my daughter" in a new turn resolves to the
  most salient earlier entity compatible with it (a person for "she", a place for "there", an entity of
  that head noun for "the other address"), and names the turn where that entity was last mentioned,
  which is what the long-term memory brings back."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import networkx as nx

from classifiers.persistence import PersistenceMarker, Span, value_spans
from classifiers.topics import STOPWORDS

USER = "user"
DECAY = 0.7  # salience kept per turn gone by
_APPOSITION = re.compile(r"[\s,]*(?:(?:is|was|called|named|who is|,)\s*)?", re.I)  # between a phrase and its name
ROLE_WEIGHT = {"user": 1.0, "assistant": 0.6}


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
    aliases: set[str] = field(default_factory=set)  # head nouns it was named with: "boiler" for "the boiler, a Thermara"
    mentions: list[tuple[int, float]] = field(default_factory=list)  # (turn, weight)

    def salience(self, now: int) -> float:
        return sum(weight * DECAY ** (now - turn) for turn, weight in self.mentions if turn <= now)

    @property
    def last(self) -> int:
        return self.mentions[-1][0]


# --- references --------------------------------------------------------------------------------------
PERSONAL = {"he": "male", "him": "male", "his": "male", "himself": "male",
            "she": "female", "her": "female", "hers": "female", "herself": "female"}
THING = ("it", "its", "itself")
PLURAL = ("they", "them", "their", "theirs", "those", "these")
PLACE = ("there",)
RELATIONS = ("son", "daughter", "wife", "husband", "partner", "mother", "mum", "mom", "father", "dad", "brother",
             "sister", "grandson", "granddaughter", "grandma", "grandad", "landlord", "landlady", "neighbour",
             "neighbor", "colleague", "boss", "friend", "child", "kid", "kids", "children", "baby", "tenant",
             "flatmate", "girlfriend", "boyfriend", "fiance", "fiancee", "nephew", "niece", "aunt", "uncle")
PEOPLE_NOUNS = RELATIONS + ("engineer", "driver", "technician", "courier", "doctor", "vet", "nurse", "agent",
                            "manager", "plumber", "electrician", "receptionist", "dentist", "pharmacist",
                            "advisor", "adviser", "man", "woman", "lady", "guy", "person", "owner", "tutor")
PETS = ("dog", "cat", "puppy", "kitten", "beagle", "terrier", "spaniel", "labrador", "collie", "rabbit", "pony",
        "horse", "parrot", "hamster", "tom")
FEMALE_RELATIONS = ("daughter", "wife", "mother", "mum", "mom", "sister", "granddaughter", "grandma", "landlady",
                    "girlfriend", "fiancee", "niece", "aunt")
MALE_RELATIONS = ("son", "husband", "father", "dad", "brother", "grandson", "grandad", "landlord", "boyfriend",
                  "fiance", "nephew", "uncle")
SELF = "self"  # the relation of the name a user introduces themselves with
DETERMINERS = r"the|my|our|your|his|her|their|this|that|these|those"
_REFERENCE = re.compile(
    rf"\b(?:(?P<dem>(?:that|this) one|the other one|the (?:first|second|last|latter|former) one)"
    rf"|(?P<other>the other (?P<other_head>[a-z]+))"
    rf"|(?P<rel>(?:my|our) (?P<rel_head>{'|'.join(RELATIONS)}))"
    rf"|(?P<def>(?:the|that|this) (?P<def_head>[a-z]+))"
    rf"|(?P<pro>{'|'.join(list(PERSONAL) + list(THING) + list(PLURAL) + list(PLACE))}|that|this))\b", re.I)
_NOUN_PHRASE = re.compile(rf"\b(?:{DETERMINERS}|a|an)\s+((?:[a-z][a-z-]+\s+){{0,2}}[a-z][a-z-]+)", re.I)
_CAPITALISED = re.compile(r"\b[A-Z][a-zA-Z'’-]+(?:\s+(?:[A-Z][a-zA-Z'’-]+|\d[\w.]*(?:\s?(?:mg|ml|g|kg|cm|mm|GB|TB))?))*")
_NOT_THINGS = frozenset("""one other same way time thing things lot bit moment end week day month year morning afternoon
evening night today tomorrow yesterday problem issue question answer help thanks chance point case while rest meantime
fact idea sort kind number details detail info information system number world place phone call line chat""".split())
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
_PIECE_FOR_PIECE = re.compile(  # "2QF, not 2QE"; "Flat 14, not Flat 4" (the shared word kept)
    rf"(?:\b(?P<word>[A-Za-z]+)\s+)?(?P<new>\b(?:{_PIECE}))\b,?\s+(?i:not)\s+(?:(?i:(?P=word))\s+)?(?P<old>{_PIECE})\b"
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

    # --- building ------------------------------------------------------------------------------
    def observe(self, turn: int, text: str) -> tuple[list[Span], list[Resolution]]:
        """A user turn: resolve its references against earlier turns first, then record its mentions
        and facts. Returns the persistent spans marked and the resolutions."""
        text = text.replace("\u2019", "'")
        resolutions = self.resolve(turn, text)
        spans = self.marker.mark(text)
        self._mention(turn, text, "user", spans)
        for resolution in resolutions:  # a referent is mentioned again
            self.entities[_key(resolution.entity)].mentions.append((turn, 0.8))
            self.graph.add_edge(f"turn:{turn}", f"entity:{_key(resolution.entity)}", kind="refers", span=resolution.span)
        self._facts(turn, text, spans)
        self.resolutions[turn] = resolutions
        return spans, resolutions

    def mention(self, turn: int, text: str) -> None:
        """A reply: its named entities gain salience (replies name what "it" will refer to)."""
        text = text.replace("\u2019", "'")
        self._mention(turn, text, "assistant", value_spans(text))  # a reply's cue clauses are not the user's wishes

    def _mention(self, turn: int, text: str, role: str, spans: list[Span]) -> None:
        self.graph.add_node(f"turn:{turn}", kind="turn", turn=turn)
        weight = ROLE_WEIGHT[role]
        found: list[tuple[str, str, str, str | None]] = []  # name, kind, head, relation
        taken: list[tuple[int, int]] = []
        nouns: list[tuple[str, int, int]] = []  # head nouns of noun phrases, with where they were
        for span in spans:
            if span.type in ("preference", "taboo"):
                continue
            named = span.attribute in ("name", "related name")
            kind = {"identity": "person" if named else "name" if span.attribute == "proper name" else "code"}.get(
                span.type, span.type)
            relation = _relation_near(text, span.start, span.end) if kind == "person" else None
            if relation is None and role == "user" and span.type == "identity" and span.attribute == "name":
                relation = SELF  # "I'm Maureen Pettigrew": the user, never "he" or "she" in their own words
            if relation in PETS:
                kind = "pet"
            head = span.text.split()[0].lower() if kind in ("person", "name") else span.attribute.split()[0]
            found.append((span.text, kind, head, relation))
            taken.append((span.start, span.end))
        for match in _CAPITALISED.finditer(text):
            if _inside(match.start(), match.end(), taken) or _sentence_start_word(text, match):
                continue
            name = match.group(0)
            found.append((name, "name", name.split()[0].lower(), None))
            taken.append((match.start(), match.end()))
        for match in _NOUN_PHRASE.finditer(text):
            words = _phrase(match.group(1).lower().split())
            end = match.start(1) + len(" ".join(match.group(1).split()[:len(words)]))
            if not words or words[-1] in _NOT_THINGS or _inside(match.start(1), end, taken):
                continue
            head = words[-1]
            kind = "pet" if head in PETS else "person" if head in PEOPLE_NOUNS else "thing"
            found.append((" ".join(words), kind, head, head if head in RELATIONS else None))
            nouns.append((head, match.start(1), end))
        named = []
        for (name, kind, head, relation), (start, end) in zip(found, taken + [(-1, -1)] * len(found)):
            entity = self._entity(name, kind, head, relation)
            entity.mentions.append((turn, weight))
            self.graph.add_edge(f"turn:{turn}", f"entity:{entity.key}", kind="mentions", role=role, turn=turn)
            if start >= 0 and kind not in ("date", "amount", "contact", "address"):
                named.append((entity, start, end))
        for head, start, end in nouns:  # "the engineer, Kieran" / "my landlord Martin": the phrase names him
            for entity, name_start, name_end in named:
                between = text[end:name_start] if name_start >= end else text[name_end:start]
                if len(between) < 20 and _APPOSITION.fullmatch(between):
                    entity.aliases.add(head)
                    self.graph.add_edge(f"entity:{entity.key}", f"entity:{_key(head)}", kind="alias")

    def _entity(self, name: str, kind: str, head: str, relation: str | None) -> Entity:
        key = _key(name)
        entity = self.entities.get(key)
        if entity is None:
            if relation is None and kind in ("name", "person") and any(  # "Maureen" after "I'm Maureen Pettigrew"
                    e.relation == SELF and set(key.split()) < set(e.key.split()) for e in self.entities.values()):
                relation = SELF
            entity = self.entities[key] = Entity(key, name, kind, head, relation)
            self.graph.add_node(f"entity:{key}", kind=kind, name=name)
        else:
            entity.name = name
            if entity.kind == "name" and kind != "name":
                entity.kind = kind
            entity.relation = entity.relation or relation
        if relation:  # "my daughter Ellie": the relation noun now means Ellie
            self.graph.add_edge(USER, f"entity:{key}", kind="relation", relation=relation)
        return entity

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

    def _patch(self, old: Fact, piece: str, new: str, turn: int) -> str:
        """Replace the denied piece of an old value; the patched whole is the new fact (returned)."""
        index = _piece_at(old.value, piece)
        patched = old.value[:index] + new + old.value[index + len(piece):]
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
    def resolve(self, turn: int, text: str) -> list[Resolution]:
        """The references of a turn, each resolved to the most salient compatible entity of earlier turns."""
        out = []
        for match in _REFERENCE.finditer(text):
            if match.group("dem"):
                kind, want = "demonstrative", None
            elif match.group("other"):
                kind, want = "definite", ("other", match.group("other_head").lower())
            elif match.group("rel"):
                kind, want = "relational", ("relation", match.group("rel_head").lower())
            elif match.group("def"):
                head = match.group("def_head").lower()
                if head in STOPWORDS or head in _NOT_THINGS or not self._by_head(head, turn):
                    continue
                kind, want = ("demonstrative" if match.group(0).lower().startswith(("that", "this")) else "definite",
                              ("head", head))
            else:
                word = match.group("pro").lower()
                if word in ("that", "this") and not _DEMONSTRATIVE_PRONOUN.match(text[match.end():]):
                    continue  # a conjunction or a determiner ("so that we", "that day"), not a reference
                kind, want = "pronoun", ("pronoun", word)
            entity = self._best(turn, want)
            if entity is not None:
                out.append(Resolution(match.group(0), match.start(), kind, entity.name, _last_before(entity, turn)))
        return out

    def _best(self, turn: int, want: tuple[str, str] | None) -> Entity | None:
        candidates = [e for e in self.entities.values() if any(t < turn for t, _ in e.mentions)]
        if want is None or want[0] == "pronoun":
            word = want[1] if want else "it"
            candidates = [e for e in candidates if _compatible(e, word)]
        elif want[0] == "relation":
            related = [e for e in candidates if (e.relation == want[1] or want[1] in e.aliases) and e.kind != "thing"]
            named = [e for e in related if e.key != _key(want[1]) and not e.name.lower().endswith(want[1])]
            candidates = named or related or [e for e in candidates if e.head == want[1]]  # Reece, not "brother"
        elif want[0] == "head":
            candidates = self._by_head(want[1], turn)
            named = [e for e in candidates if want[1] in e.aliases or e.head != want[1]]
            candidates = named or candidates  # "the boiler" is the Thermara Combi 30 it was named as
        else:  # "the other X": an X that is not the most salient one
            same = sorted(self._by_head(want[1], turn), key=lambda e: -e.salience(turn - 1))
            candidates = same[1:] if len(same) > 1 else same
        if not candidates:
            return None
        word = want[1] if want and want[0] == "pronoun" else None
        return max(candidates, key=lambda e: (e.salience(turn - 1) * _prior(e, word), e.last))

    def _by_head(self, head: str, turn: int) -> list[Entity]:
        stem = head.rstrip("s")
        return [e for e in self.entities.values() if any(t < turn for t, _ in e.mentions)
                and (e.head.rstrip("s") == stem or stem in {a.rstrip("s") for a in e.aliases} or (e.kind in ("address", "contact", "code", "date", "amount")
                                                     and stem in (e.kind, *_KIND_NOUNS.get(e.kind, ()))))]

    # --- saving ----------------------------------------------------------------------------------
    def state(self) -> dict:
        """Entities, facts (superseded ones included), resolutions and the networkx graph, as plain data."""
        return {"graph": nx.node_link_data(self.graph, edges="edges"),
                "entities": [{**asdict(e), "aliases": sorted(e.aliases)} for e in self.entities.values()],
                "facts": [asdict(fact) for fact in self.facts],
                "resolutions": {turn: [r.as_dict() for r in found] for turn, found in self.resolutions.items()}}

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
        return graph

    def current_facts(self) -> list[Fact]:
        return [fact for fact in self.facts if fact.current]

    def superseded(self) -> list[Fact]:
        return [fact for fact in self.facts if not fact.current]

    def stats(self, turn: int) -> dict:
        return {"entities": len(self.entities), "facts": len(self.current_facts()),
                "superseded": [f"{f.attribute}: {f.value} -> {f.superseded_by} (turn {f.invalid_from_turn})"
                               for f in self.superseded()],
                "resolutions": [r.as_dict() for r in self.resolutions.get(turn, [])]}


_KIND_NOUNS = {"address": ("address", "postcode", "flat", "house", "place"), "contact": ("number", "email", "phone", "mobile"),
               "code": ("number", "reference", "ref", "code", "order", "booking", "account"),
               "date": ("date", "day", "appointment", "time", "slot"), "amount": ("amount", "charge", "fee", "payment", "refund")}


def _compatible(entity: Entity, word: str) -> bool:
    animate = entity.kind in ("person", "pet", "name")
    if word in PERSONAL:
        if entity.relation == SELF:
            return False
        gender = PERSONAL[word]
        if entity.relation in (FEMALE_RELATIONS if gender == "male" else MALE_RELATIONS):
            return False
        return animate
    if word in PLACE:
        return entity.kind in ("address", "place", "name") or entity.head in ("shop", "branch", "office", "surgery", "station")
    if word in PLURAL:
        return True
    return entity.kind not in ("person", "pet")  # it, that, this, that one


PRIOR_IT = {"thing": 1.0, "name": 0.9, "code": 0.6, "address": 0.5, "date": 0.4, "amount": 0.4, "contact": 0.3}
PRIOR_THERE = {"address": 1.0, "place": 1.0, "name": 0.6, "thing": 0.5}


def _prior(entity: Entity, word: str | None) -> float:
    """How likely a kind of entity is the referent of a pronoun: "it" is seldom an order number."""
    if word in PLACE:
        return PRIOR_THERE.get(entity.kind, 0.3)
    if word in PERSONAL:
        return 1.0 if entity.kind in ("person", "pet") else 0.7
    if word in PLURAL:
        return 1.0 if entity.kind == "thing" and entity.head.endswith("s") else 0.6 if entity.kind == "thing" else 0.4
    return PRIOR_IT.get(entity.kind, 0.5)


def _single_valued(attribute: str) -> bool:
    """Attributes a user has one of at a time: a switch to a new one replaces it even without "not X"
    (preferences accumulate: a later one does not cancel an earlier one unless it denies it)."""
    return attribute in ("address", "postcode", "email", "name", "phone", "mobile phone")


def _piece_at(value: str, piece: str) -> int:
    """Where a piece stands in a value as a whole token ("4" in "Flat 4, 19 ...", not in "14"); -1 if not."""
    match = re.search(rf"(?<![\w]){re.escape(piece)}(?![\w])", value, re.I)
    return match.start() if match else -1


def _contains_piece(value: str, piece: str) -> bool:
    return _piece_at(value, piece) >= 0


def _key(name: str) -> str:
    return " ".join(_CONTENT.findall(name.lower()))


def _relation_near(text: str, start: int, end: int) -> str | None:
    """The relation a name is introduced with: "my daughter Ellie" or "Biscuit, my beagle"."""
    nouns = "|".join(RELATIONS + PETS)
    before = re.search(rf"\b(?:my|our)\s+(?:\w+\s+)?({nouns}),?\s*$", text[max(0, start - 40):start], re.I)
    after = before or re.match(rf",?\s+(?:my|our)\s+(?:\w+\s+)?({nouns})\b", text[end:], re.I)
    return after.group(1).lower() if after else None


def _phrase(words: list[str]) -> list[str]:
    """The noun phrase after a determiner, without a tagger: words up to the first function word or
    verb-looking word ("boiler stopped" -> "boiler"), at most two."""
    out = []
    for word in words[:2]:
        if word in STOPWORDS or (out and word.endswith(("ed", "ing", "ly"))) or word in _VERBS:
            break
        out.append(word)
    return out


_VERBS = frozenset("is are was were be been has have had do does did can could will would should may might must "
                   "needs need wants want keeps stopped broke works worked arrived came went says said got".split())


def _inside(start: int, end: int, taken: list[tuple[int, int]]) -> bool:
    return any(start < e and s < end for s, e in taken)


def _sentence_start_word(text: str, match: re.Match) -> bool:
    """A capitalised word that only starts a sentence, not a name ("Thanks", "Could")."""
    before = text[:match.start()].rstrip()
    first = match.group(0).split()[0].lower().strip("'")
    return (not before or before[-1] in ".!?\"(") and (first in STOPWORDS or first in _COMMON_STARTS) or first in ("i", "i'm", "i'll", "i've", "i'd")


_COMMON_STARTS = frozenset("""hello hi hey thanks thank yes yeah no ok okay great lovely right sorry please could can would
will just well oh ah also and but so then now sure perfect brilliant cheers good fine actually honestly what when where
why how who which is are do does did have has any anything one while since""".split())


_DEMONSTRATIVE_PRONOUN = re.compile(
    r"\s*(?:$|[.,!?;:]|(?:is|was|'s|works|sounds|would|will|should|has|needs|does|can|could|might|must|seems|looks)\b)", re.I)


def _last_before(entity: Entity, turn: int) -> int:
    return max(t for t, _ in entity.mentions if t < turn)
