"""Which spans of a user turn carry facts that must survive the whole dialogue (identity, contact details,
addresses, amounts, dates, preferences and taboos), by rules plus a small learned clause classifier.

- Values (identity codes, names, phones, emails, addresses, amounts, dates) are found by patterns: their
  shapes are regular, and a pattern marks the tight value ("KL-20931", "14 Orchard Row, Leeds LS6 2AB").
- Preferences and taboos have no shape. Rules propose every clause with a cue ("prefer", "call me",
  "never", "please don't"); a logistic regression over the clause's words (`PreferenceModel`, trained by
  `palace train persistence` on annotated dialogues that are not the held-out set) keeps the clauses that
  state one, and whether it is a preference or a taboo. Without a trained model the cue rules decide.

Spans are character offsets into the text, so the cache can pin the tokens that carry them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

TYPES = ("identity", "contact", "address", "amount", "date", "preference", "taboo")
FORMAT_VERSION = 1
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "persistence.json"  # models/ links to data/models


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    text: str
    type: str
    attribute: str  # what the value is of: "name", "phone", "email", "postcode", "order number", "channel", ...

    def overlaps(self, other: "Span") -> bool:
        return self.start < other.end and other.start < self.end


# --- value patterns ---------------------------------------------------------------------------------
_MONTHS = "jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?"
_DAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_ORDINAL = r"\d{1,2}(?:st|nd|rd|th)"
_STREET = ("street|st|road|rd|lane|ln|close|avenue|ave|row|way|drive|dr|court|ct|place|crescent|gardens|terrace|grove|"
           "hill|park|square|walk|mews|rise|view|parade|green|yard|wharf|boulevard|end")
_POSTCODE = r"\b[A-Z]{1,2}\d[A-Z\d]?\s?\d[A-Z]{2}\b"  # UK shape; other countries' codes read as references
_POSTCODE_LOWER = r"\b[a-z]{1,2}\d[a-z\d]?\s\d[a-z]{2}\b"  # "nn13 6hd": with its space, so a word is not one
_ORDINAL_WORDS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
                  "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|(?:twenty|thirty)-?\\w+")
_NUMBER_WORDS = "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|quarter|half"

VALUE_PATTERNS: list[tuple[str, str, re.Pattern]] = [  # (type, attribute, pattern); earlier wins on overlap
    ("contact", "email", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")),
    ("address", "address", re.compile(
        rf"\b(?:(?i:flat|apartment|unit)\s+\d+\w?,?\s+)?\d+[a-z]?,?\s+(?:[A-Z][\w'-]*\s+){{1,3}}(?i:{_STREET})\b"
        rf"(?:,\s*(?!(?i:{_DAYS}|now|please|and)\b)[A-Z][a-z]+(?:[ -][A-Z][a-z]+)?)?(?:,?\s+(?:{_POSTCODE}))?")),
    ("address", "address", re.compile(  # typed in lower case in a hurry: the plainest street words only, so that
        rf"\b(?:(?:flat|apartment|unit)\s+\d+\w?,?\s+)?\d+[a-z]?,?\s+"  # "5174 is too close" is not one
        rf"(?:(?!(?:is|are|was|too|so|very|the|a|an|and|of|in|at|on|my|our)\b)[a-z][\w'-]*\s+){{1,2}}"
        rf"(?:street|st|road|rd|lane|close|avenue|ave|drive|crescent|gardens|terrace|grove|mews)\b"
        rf"(?:,\s*[a-z]+(?:\s(?!{_POSTCODE_LOWER})[a-z]+)?)?(?:,?\s+(?:{_POSTCODE}|{_POSTCODE_LOWER}))?")),
    ("address", "postcode", re.compile(rf"{_POSTCODE}|{_POSTCODE_LOWER}")),
    ("address", "flat", re.compile(r"\b(?i:flat|apartment|unit)\s+\d+[A-Za-z]?\b")),  # "it's Flat 14, not Flat 4"
    ("contact", "phone", re.compile(r"(?<![\w-])(?:\+\d{1,3}[\s-]?)?(?:\(?0\d{2,4}\)?[\s-]?)\d{3,4}[\s-]?\d{3,4}(?![\w-])"
                                    r"|(?<![\w-])\(?\d{3}\)?[-. ]\d{3}[-. ]\d{4}(?![\w-])")),
    ("amount", "amount", re.compile(
        r"[£$€]\s?\d[\d,]*(?:\.\d+)?(?:\s?(?:k|m|bn))?\b|\b\d[\d,]*(?:\.\d+)?\s?(?:pounds|quid|dollars|euros|gbp|usd|eur|p)\b",
        re.I)),
    ("date", "time", re.compile(
        rf"\b(?:\d{{1,2}}(?::\d{{2}})?\s?(?:am|pm)|\d{{1,2}}:\d{{2}}|(?:half past|quarter past|quarter to)\s+(?:{_NUMBER_WORDS}|\d{{1,2}})"
        rf"|(?:{_NUMBER_WORDS})\s+o'?clock|noon|midday)\b", re.I)),
    ("date", "date", re.compile(
        rf"\b(?:(?:{_DAYS})\s+)?(?:the\s+)?(?:{_ORDINAL}|\d{{1,2}})\s+(?:of\s+)?(?:{_MONTHS})\b(?:\s+\d{{4}})?"
        rf"|\b(?:{_DAYS})\s+(?:the\s+)?{_ORDINAL}\b"
        rf"|\b(?:{_MONTHS})\s+(?:{_ORDINAL}|\d{{1,2}})\b(?:,?\s+\d{{4}})?|\b\d{{1,2}}/\d{{1,2}}(?:/\d{{2,4}})?\b"
        rf"|\b\d{{4}}-\d{{2}}-\d{{2}}\b|\bthe\s+{_ORDINAL}\b|\b(?:{_MONTHS})\s+\d{{4}}\b"
        rf"|\bthe\s+(?:{_ORDINAL_WORDS}|start|beginning|middle|end)\s+of\s+(?:{_MONTHS})\b", re.I)),  # a bare weekday is relative
    ("identity", "reference", re.compile(
        r"(?<![\w@.-])(?=[A-Z0-9-]*\d)(?=[A-Z0-9-]*[A-Z])(?=[A-Z0-9 -]{5})"
        r"[A-Z0-9]{1,6}(?:-[A-Z0-9]{1,8}|\s?[A-Z0-9]{2,8}){1,3}(?![\w@-])"  # "BW-58213-K", "KL 20931"
        r"|(?<![\w@.£$€-])\d{5,}(?![\w-])|(?<![\w-])\d{3,}(?:-\d{3,})+(?![\w-])"
        r"|(?:(?<=ending )|(?<=ends )|(?<=ending in )|(?<=ends in )|(?<=[Cc]ode )|(?<=PIN )|(?<=[Cc]ode is )"
        r"|(?<=PIN is ))\d{3,8}\b")),
]

PROPER_NAME = re.compile(  # a capitalised name mid-sentence: a person, a pet, a product, a firm
    r"(?<=[a-z,;] )(?!(?:I|I'm|I'll|I've|I'd|OK|He's|She's|It's)\b)[A-Z][a-z'-]+(?![A-Za-z])"  # not "EpiPen"
    r"(?:[ \t]+(?:(?!(?:I|I'm|I'll|I've|I'd)\b)[A-Z][a-z'-]+(?![A-Za-z])"
    r"|\d+(?:\.\d+)?(?:\s?(?:mg|ml|g|kg|GB|TB|mm|cm))?))*")
# a capitalised word after these is a place, a date or a make ("in Bristol", "before Christmas", "a Skoda"), not
# someone or something the user owns or deals with
_NOT_NAME_BEFORE = re.compile(r"\b(?:in|to|from|at|near|around|before|after|until|till|on|the|a|an|this|that|every|"
                              r"like|your|thanks|thank you|cheers|hi|hello|dear)\s+$", re.I)
_OWNED = re.compile(  # unless the user owns it: "I bought the Solara keyboard"
    r"\b(?:bought|ordered|rent|rented|have|own|booked|purchased|got)\s+(?:the|a|an)\s+$", re.I)
_DENIED = re.compile(r"\b(?:not|rather than|instead of)\s+(?:the\s+)?$", re.I)  # "2QF, not 2QE": the wrong value
_OPENING_NAME = re.compile(  # a sentence that opens with a name: "Brenda Callaghan, 8 Hawthorn Rise", "Tom and I"
    r"(?:^|(?<=[.!?]\s))(?:[A-Z][a-z'-]+(?:\s+[A-Z][a-z'-]+)+(?=,|\.|\s+here\b)"
    r"|[A-Z][a-z'-]+(?=\s+and\s+I\b|,\s+(?:a|an|my|our)\s))")
_DAYS_SHORT = "mon|tues?|weds?|thu|thurs?|fri|sat|sun"  # "Mon, Tues and Thurs"
_CALENDAR = rf"(?:(?:{_MONTHS}|{_DAYS}|{_DAYS_SHORT}|christmas|easter|valentine|new|year|bank|holiday)(?:'?s)?)"

# a capitalised name after a self-introduction, or the name of a named relation ("my daughter, Ellie")
_NAME = r"[A-Z][a-z'’-]+(?:\s+(?:[A-Z][a-z'’-]+|[A-Z]\.)){0,3}"
NAME_PATTERNS = [
    re.compile(rf"\b(?i:my name is|my name's|name is|this is|it's|it is|i'm|i am|call me|speaking|under|"
               rf"in the name of|named|called)\s+(?:(?i:mr|mrs|ms|miss|dr)\.?\s+)?({_NAME})"),
    re.compile(rf"\b(?i:my|our)\s+(?:\w+\s+)?(?:son|daughter|wife|husband|partner|mother|mum|father|dad|brother|sister|"
               rf"grandson|granddaughter|landlord|landlady|neighbour|neighbor|colleague|boss|friend|dog|cat|"
               rf"puppy|kitten|tenant|child|kid|baby)(?:,)?\s+({_NAME})"),
    re.compile(rf"\b({_NAME}),?\s+(?:my|our)\s+(?:\w+\s+)?(?:son|daughter|wife|husband|partner|mother|mum|father|"
               rf"dad|brother|sister|landlord|landlady|neighbour|neighbor|dog|cat|beagle|terrier|spaniel)\b"),
]
_RELATION_AFTER = re.compile(r",?\s+(?i:my|our|the)\s+(?:\w+\s+)?(?:son|daughter|wife|husband|partner|mother|mum|"
                             r"father|dad|brother|sister|dog|cat|beagle|terrier|spaniel|puppy|kitten|tom|landlord|neighbour)\b")
_NOT_NAMES = frozenset("""i im i'm i've i'd i'll it its the a an and but so just here there sorry yes no not thanks thank please okay ok
flat apartment unit room house number order account booking ticket code he's she's they're we're now then
hello hi hey morning afternoon evening calling ringing writing back still sure very really about afraid glad happy
hes shes cheers however also ooh ha oh well right mum mums dad dads mom moms nan gran granny grandad grandma grandpa
""".split())

# preference and taboo cues: a clause with one is a candidate. A wish is said to the agent (an imperative, "please",
# "X is best", "never call me"); the same words describing the world ("I can't find it", "I always forget",
# "he never checks his email") are not.
_CHANNEL_VERBS = "call|ring|phone|telephone|email|e-mail|text|txt|message|contact|write|post|letter"
_OPENER = r"(?:(?:please|pls|just|honestly|and|so|but|also|then|oh)\s+)*"
_ADDRESS = r"(?:call me|address me as|addressed as|go by|known as)\s+(?:(?:mr|mrs|ms|miss|dr)\.?\s+)?"  # + a name
_DESCRIBED_NEVER = re.compile(  # "I can never remember", "who never checks his email", "he's never sat in a car"
    r"\b(?:i|he|she|they|we|who|it|you)(?:'s|'ve|'d|'m|'ll)?\s+(?:(?:can|could|have|has|had|just|really|almost|also|still)\s+)?"
    r"(?:even\s+)?never\b", re.I)
_NEVER_DID = re.compile(  # "my husband never checks his email", "the charge should never have been made"
    r"never\s+(?:even\s+)?(?:\w+(?<!s)s|\w+ed|have\s+been)\b", re.I)
# "don't" + a verb is a ban ("please don't place me with a family that keeps cats") unless it says what the user
# thinks or needs ("don't worry", "I don't know")
_NOT_A_BAN = (r"(?:know|think|worry|mind|have|need|want|understand|remember|see|get|care|like|feel|bother|panic|mean|"
              r"recall|really|quite|suppose|believe|expect|forget|seem|tend|usually|always|often|just)\b")
TABOO_CUES = re.compile(
    rf"\bnever\b|(?:^{_OPENER}|\bplease\s+)(?:don't|do not|dont)\s+(?:ever\s+)?(?!{_NOT_A_BAN})\w+"
    r"|\bnothing (?:with|containing)\b|^(?:please|absolutely|definitely)\W+(?:no|not)\s+\w+|^no\s.*\bplease\b"
    r"|\b(?:mustn't|must not|please no|avoid|under no circumstances|allerg(?:ic|y) to|"
    r"stop (?:sending|calling|ringing|emailing|texting|phoning))\b"
    r"|\bnot\s+(?:to\s+)?(?:be\s+)?(?:telephoned|phoned|called|rung|contacted|emailed|disturbed|go)\b"
    r"|^not\s+(?:before|after|during|near)\b"
    r"|\bno\s+(?:\w+\s+){0,3}?(?:calls?|texts?|emails?|letters?|post|mail(?:ings)?|marketing|offers|visits|"
    r"nuts|dairy|gluten|meat|pork|alcohol|shellfish|eggs)\b", re.I)
PREFERENCE_CUES = re.compile(
    r"\b(?:prefer(?:ably|red|s)?|rather than|"
    rf"{_ADDRESS}(?-i:[A-Z])\w*|"
    r"(?:is|are|'s|works?|suits?(?: (?:me|us))?)\s+best|best (?:way|time|number|days?|for (?:me|us))|"
    r"(?:would be|is|are|'s) (?:ideal|better for (?:me|us)|much better)|ideally|suits? (?:me|us)|"
    rf"please (?:always\s+)?(?:{_CHANNEL_VERBS}|use|send|keep|knock|bill|deliver)|"
    r"(?:please\s+)?always (?:ask|call|ring|text|email|send|use|check|contact)|"
    rf"only (?:by|on|via)|\b(?:{_CHANNEL_VERBS})s? only|by (?:email|e-mail|text|sms|post|phone|letter)|"
    r"in (?:large print|braille)|only want|"
    r"just (?:whatsapp|email|text|post|telegram|signal)|whatsapp|telegram|signal|viber|imessage|wechat|"
    r"(?:letters?|written|correspondence|documents?|speak|language)\b.*\bin (?-i:[A-Z][a-z]+)|"
    r"window|aisle|sea view|quiet|ground floor|vegetarian|vegan|halal|kosher|gluten-free|"
    r"\w+ only$|^only (?:if|on|by|the)|(?:any|every|all) \w+ except|"  # "Weekday daytimes only", "any day except"
    r"^(?!(?:whatever|what|that|which|who)\b)(?:[\w-]+ ){1,3}it is(?:$| for\b))\b", re.I)  # "Midnight it is"
_IMPERATIVE = re.compile(rf"^{_OPENER}(?:{_CHANNEL_VERBS})\s+(?:me|him|her|us)\b", re.I)  # "text me", "Ring him"
_CHANNEL_CONTRAST = re.compile(  # "Texts, not calls", "use email not text", "a letter first, then a call"
    rf"\b(?:{_CHANNEL_VERBS})(?:s| message)?(?:,?\s+not\s+(?:by\s+)?|\s+first,?\s+then\s+(?:a\s+)?)"
    rf"(?:{_CHANNEL_VERBS})s?\b", re.I)
_POLITE_REQUEST = re.compile(  # a short answer with "please": "Shoe covers, please", "manual please"
    r"(?:^|(?<=[.!?:]\s))(?:(?:if possible|no|ok|okay),?\s+)?(?!(?:yes|yeah|thanks|thank)\b)"
    r"(?!(?:book|hold|confirm|go ahead|proceed|order|add|check|give|tell|and|but|so|or)\b)"  # "Book it, please"
    r"((?:[\w'-]+\s+){0,5}[\w'-]+),?\s+(?:please|pls)(?=\s*[.!,]|\s*$)", re.I)
_PARTY_CONTRAST = re.compile(  # who pays, who is told, whose name: "Bill it to me, not her", "His own PIN, not mine"
    r"(?:^|(?<=[.!?:;]\s))(?!(?:it's|it is|that's|sorry)\b)([\w'][^.!?;:,\n]{2,60},\s+not\s+(?:to\s+)?"
    r"(?:me|her|him|them|us|mine|hers|his|ours|theirs|the landlord|my\s+(?:personal|own|work|home)\s+\w+))\b", re.I)
_RECALL_QUESTION = re.compile(r"\b(?:what|which|where|when|who|how|did i|have i|is there|are there|remind me|"
                              r"i (?:said|told))\b", re.I)
# "if he must call me": not the wish itself (a longer one is a run-on sentence that goes on to the wish)
_CONDITION = re.compile(r"^(?:if|when|whether|what if|in case)\b", re.I)
_CLAUSE = re.compile(r"(?:[^.!?;:,()\n—–]|[.,:](?=\w))+")  # "jo.bell@example.org", "£1,850" stay whole
_LEADING = re.compile(r"^(?:and|but|or|so|also|then)\s+", re.I)
# a reply that asks the user to choose or to say what they want ("Would you like to pay in one go or monthly?",
# "Which suits you?"): a short answer to it is a preference though it has no cue word ("Bank transfer.")
_WISH_QUESTION = re.compile(r"\b(?:prefer|rather|would you like|do you want|how would you like|which|suits?|"
                            r"what time|when would|would (?:\w+\s+){1,3}be (?:easier|better))\b[^.!?\n]*\?", re.I)
_SHORT_ANSWER = re.compile(  # the first sentence, up to six words, that is not a yes, a thanks or a count
    rf"^\s*(?!(?:yes|yeah|yep|yup|ye|no|nope|nah|ok|okay|sure|thanks|thank|great|perfect|lovely|fine|right|sorry|hi|"
    rf"hello|hang|um|erm|hmm|please|pls|either|both|neither|{_NUMBER_WORDS}|\d)\b)"
    r"((?=[^.!?\n]*[a-z])(?:[\w'&/+-]+,?\s+){0,5}?[\w'&/+-]+?)(?:,?\s+(?:please|pls|thanks|thank you))?"
    r"\s*(?:[.!]+(?=\s|$)|$)", re.I)


def _clauses(text: str) -> list[tuple[int, int]]:
    """Clause boundaries: sentence punctuation, commas, dashes; " but "/" and " inside long pieces."""
    pieces = []
    for match in _CLAUSE.finditer(text):
        start, end = match.start(), match.end()
        for sub in re.split(r"\s+(?:but|because|although|though|so|(?<!addressed )(?<!known )as)\s+", text[start:end]):
            offset = text.index(sub, start) if sub else start
            lead = len(sub) - len(sub.lstrip())
            trimmed = sub.strip()
            skip = _LEADING.match(trimmed)
            if skip:
                lead, trimmed = lead + skip.end(), trimmed[skip.end():]
            if len(trimmed.split()) >= 2:
                pieces.append((offset + lead, offset + lead + len(trimmed)))
            start = offset + len(sub)
    return pieces


def value_spans(text: str) -> list[Span]:
    """Values by pattern, non-overlapping (earlier patterns win)."""
    found: list[Span] = []

    def add(start: int, end: int, kind: str, attribute: str) -> None:
        value = text[start:end].rstrip(" .,")
        end = start + len(value)
        span = Span(start, end, value, kind, attribute)
        if end > start and not any(span.overlaps(other) for other in found):
            found.append(span)

    for kind, attribute, pattern in VALUE_PATTERNS:
        for match in pattern.finditer(text):
            add(match.start(), match.end(), kind, refine(text, match.start(), attribute))
    for index, pattern in enumerate(NAME_PATTERNS):  # the first introduces the user; the others, a relation
        for match in pattern.finditer(text):
            name = match.group(1)
            words = name.split()
            while words and words[-1].lower().strip("'’") in _NOT_NAMES:
                words.pop()
            if words and words[0].lower() not in _NOT_NAMES:
                start = match.start(1)
                end = start + len(" ".join(words))
                related = index > 0 or _RELATION_AFTER.match(text[end:])  # "It's Biscuit, my beagle"
                add(start, end, "identity", "related name" if related else "name")
    for match in (*_OPENING_NAME.finditer(text), *PROPER_NAME.finditer(text)):
        words = match.group(0).split()
        while words and (re.fullmatch(rf"(?i:{_CALENDAR})\W*", words[0]) or _plain(words[0]) in _NOT_NAMES):
            words.pop(0)
        before = text[max(0, match.start() - 30):match.start()]
        stripped = len(words) < len(match.group(0).split())  # "Easter Monday Lego": what came before was a date
        if words and (stripped or not _NOT_NAME_BEFORE.search(before) or _OWNED.search(before)):
            start = match.start() + match.group(0).index(words[0])
            add(start, start + len(" ".join(words)), "identity", "proper name")
    return sorted((s for s in found if not _DENIED.search(text[max(0, s.start - 20):s.start])), key=lambda s: s.start)


def _plain(word: str) -> str:
    """A word as _NOT_NAMES lists it: lower case, no apostrophes ("I'm" -> "im")."""
    return re.sub(r"['’]", "", word.lower())


_QUALIFIERS = re.compile(
    r"\b(order|account|booking|reference|ref|policy|case|ticket|invoice|membership|member|card|claim|tracking|"
    r"customer|contract|serial|reservation|confirmation|mobile|landline|work|home|postcode|zip)\b[\w\s#:]{0,12}$", re.I)


def refine(text: str, start: int, attribute: str) -> str:
    """A value's attribute, narrowed by the noun just before it: "order number ABC-123" is an "order"
    reference, "my mobile is 07700..." a "mobile" phone."""
    if attribute not in ("reference", "phone", "postcode"):
        return attribute
    match = _QUALIFIERS.search(text[max(0, start - 40):start])
    qualifier = match.group(1).lower() if match else attribute
    return attribute if qualifier == attribute else f"{qualifier} {attribute}"


def _taken(start: int, end: int, clauses: list[tuple[int, int, str]]) -> bool:
    """Whether [start, end) overlaps one of the clauses already found."""
    return any(start < e and s < end for s, e, _ in clauses)


def cue_clauses(text: str, prompt: str | None = None) -> list[tuple[int, int, str]]:
    """Clauses with a preference or taboo cue, as (start, end, type by the cue rules); none from a question
    about what was said ("when did I say not to call?") or from an if-clause. `prompt`, the agent's reply
    before the turn: where it asks what the user wants, a short first sentence answers it ("Payment link.")."""
    out = []
    answer = _SHORT_ANSWER.match(text) if prompt and _WISH_QUESTION.search(prompt) else None
    if answer:
        out.append((answer.start(1), answer.end(1), "preference"))
    for start, end in _clauses(text):
        clause = text[start:end]
        if (_CONDITION.match(clause) and len(clause.split()) <= 12) or _recall_question(text, start, end):
            continue
        if _taboo_cue(clause):
            out = [c for c in out if not _taken(start, end, [c])]  # "Not a Wednesday": the cue says which
            out.append((start, end, "taboo"))
        elif (PREFERENCE_CUES.search(clause) or _IMPERATIVE.match(clause)) and not _taken(start, end, out):
            out.append((start, end, "preference"))
    for pattern in (_CHANNEL_CONTRAST, _POLITE_REQUEST, _PARTY_CONTRAST):
        for match in pattern.finditer(text):
            start, end = match.span(match.lastindex or 0)
            if not _taken(start, end, out):
                out.append((start, end, "preference"))
    return sorted(out)


def _taboo_cue(clause: str) -> bool:
    """Whether a taboo cue in the clause is a wish: a "never" that describes someone ("who never checks his
    email") is not."""
    return any(m.group(0).lower() != "never" or not (_DESCRIBED_NEVER.search(clause[:m.end()])
                                                     or _NEVER_DID.match(clause, m.start()))
               for m in TABOO_CUES.finditer(clause))


def _recall_question(text: str, start: int, end: int) -> bool:
    """Whether the clause is in a question that asks the agent something ("which email did I give you?")."""
    sentence_start = max(text.rfind(mark, 0, start) for mark in ".!?\n") + 1
    stop = re.search(r"[.!?\n]", text[end:])
    sentence = text[sentence_start:end + (stop.end() if stop else 0)]
    return sentence.rstrip().endswith("?") and bool(_RECALL_QUESTION.search(sentence))


def clause_features(clause: str) -> str:
    """What the clause model reads: the words, plus the cue rules' verdicts as pseudo-words."""
    low = clause.lower()
    flags = " ".join(f"__{name}" for name, cue in (("taboo", TABOO_CUES), ("pref", PREFERENCE_CUES)) if cue.search(low))
    return f"{low} {flags}"


@dataclass
class PreferenceModel:
    """A logistic regression over a clause's words (hashed unigrams and bigrams) that says whether a
    cue clause states a preference, a taboo or neither. Exported as plain JSON (weights, not pickle)."""

    classes: list[str]
    coef: np.ndarray  # classes x features
    intercept: np.ndarray
    features: int = 2 ** 14

    def vector(self, clauses: list[str]):
        from sklearn.feature_extraction.text import HashingVectorizer

        return HashingVectorizer(n_features=self.features, ngram_range=(1, 2), alternate_sign=False,
                                 norm="l2").transform([clause_features(c) for c in clauses])

    def predict(self, clauses: list[str]) -> list[str]:
        if not clauses:
            return []
        logits = self.vector(clauses) @ self.coef.T + self.intercept
        return [self.classes[i] for i in np.asarray(logits).argmax(axis=1)]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format_version": FORMAT_VERSION, "kind": "persistence-clauses",
                                    "classes": self.classes, "features": self.features,
                                    "intercept": self.intercept.tolist(),
                                    "coef": {str(j): self.coef[:, j].round(5).tolist()
                                             for j in np.nonzero(np.abs(self.coef).sum(0) > 1e-6)[0]}}))

    @classmethod
    def load(cls, path: Path) -> "PreferenceModel":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read persistence model {path}: {error}") from None
        if raw.get("format_version") != FORMAT_VERSION or raw.get("kind") != "persistence-clauses":
            raise ValueError(f"{path} is not a persistence model of format {FORMAT_VERSION}")
        coef = np.zeros((len(raw["classes"]), raw["features"]))
        for j, column in raw["coef"].items():
            coef[:, int(j)] = column
        return cls(raw["classes"], coef, np.asarray(raw["intercept"]), raw["features"])

    @classmethod
    def fit(cls, clauses: list[str], labels: list[str], seed: int = 0) -> "PreferenceModel":
        from sklearn.linear_model import LogisticRegression

        empty = cls(sorted(set(labels)), np.zeros(0), np.zeros(0))
        model = LogisticRegression(C=4.0, max_iter=2000, class_weight="balanced", random_state=seed)
        model.fit(empty.vector(clauses), labels)
        coef = model.coef_ if len(model.classes_) > 2 else np.vstack([-model.coef_[0], model.coef_[0]])
        intercept = model.intercept_ if len(model.classes_) > 2 else np.array([-model.intercept_[0], model.intercept_[0]])
        return cls(list(model.classes_), coef, intercept)


@lru_cache(maxsize=1)
def default_model() -> PreferenceModel | None:
    return PreferenceModel.load(DEFAULT_MODEL) if DEFAULT_MODEL.exists() else None


class PersistenceMarker:
    """Marks a user turn's must-survive spans. `model`: the clause classifier (None: cue rules only)."""

    def __init__(self, model: PreferenceModel | None = None):
        self.model = model

    @classmethod
    def default(cls) -> "PersistenceMarker":
        return cls(default_model())

    def mark(self, text: str, prompt: str | None = None) -> list[Span]:
        """The turn's spans; `prompt`, the agent's reply before it (None: unknown), lets a short answer to a
        question about what the user wants count as a preference."""
        spans = value_spans(text)
        candidates = cue_clauses(text, prompt)
        verdicts = self.model.predict([text[s:e] for s, e, _ in candidates]) if self.model else [t for *_, t in candidates]
        wishes = [Span(start, end, text[start:end], verdict, channel(text[start:end]) or verdict)
                  for (start, end, _), verdict in zip(candidates, verdicts) if verdict in ("preference", "taboo")]
        # a time inside a wish is part of it ("never before 10am"), not an appointment; a wish that is only the
        # time ("2pm." to "Which suits you?") is the appointment
        spans = [s for s in spans if s.attribute != "time" or not any(
            s.overlaps(w) and len(w.text.split()) > len(s.text.split()) for w in wishes)]
        wishes = [w for w in wishes if not _gives_value(w, spans)]
        # "please call me Mo": how to be addressed, which the wish keeps whole
        spans = [s for s in spans if not any(w.attribute == "form of address" and s.overlaps(w) for w in wishes)]
        return sorted(spans + wishes, key=lambda s: (s.start, -s.end))

    def mark_dialogue(self, texts: list[str], replies: list[str | None] | None = None) -> list[list[Span]]:
        """Each user turn's spans, a value only where the dialogue first states it: a name, number or date
        mentioned again is not a new fact to keep (the annotated dialogues mark a value once, where it is
        first given). Preferences and taboos are clauses, kept wherever they are said. `replies[i]`: the
        agent's reply before turn i (None for the first turn), the question a short answer answers."""
        seen: set[str] = set()
        said = ""  # the dialogue so far: a value in it was stated before, marked or not ("like Admiral")
        named = ""  # the agent's replies: a name they gave first is theirs ("Can Kieran do it?"); a date, a code or
        out = []    # an amount they offered is the user's once the user takes it ("Take C-112.")
        for index, text in enumerate(texts):
            prompt = replies[index] if replies else None
            named += (prompt or "").lower() + "\n"
            spans = []
            for span in self.mark(text, prompt):
                if span.type in ("preference", "taboo"):
                    spans.append(span)
                    continue
                key = _value_key(span.text)
                before = said + named if span.attribute.endswith("name") else said
                if key not in seen and not re.search(rf"(?<!\w){re.escape(key)}(?!\w)", before):
                    spans.append(span)
                seen.add(key)
                if span.attribute in ("name", "related name", "proper name"):  # "Freya" after "Freya Moreau"
                    seen.update(key.split())
            out.append(spans)
            said += text.lower() + "\n"
        return out


def _gives_value(wish: Span, values: list[Span]) -> bool:
    """Whether a preference clause only hands over a value ("Please use sam@example.org", "Card ending 9026,
    please"): the value's span keeps it."""
    inside = [v for v in values if wish.start <= v.start and v.end <= wish.end]
    rest = len(wish.text.split()) - sum(len(v.text.split()) for v in inside)
    return wish.type == "preference" and wish.attribute != "form of address" and bool(inside) and rest <= 5


def _value_key(value: str) -> str:
    """A value as compared across turns: case, a possessive and surrounding punctuation ignored."""
    return re.sub(r"'s$", "", value.strip(" .,;:!?").lower())


_CHANNELS = re.compile(r"\b(email|e-mail|text|sms|phone|call|ring|post|letter|whatsapp|app|voicemail)", re.I)


_FORM_OF_ADDRESS = re.compile(rf"\b(?i:{_ADDRESS})[A-Z]")


def channel(clause: str) -> str | None:
    """The attribute a preference or taboo is about when it has one a later statement can supersede:
    how to be addressed ("call me Sam"), or the contact channel ("never by phone")."""
    if _FORM_OF_ADDRESS.search(clause):
        return "form of address"
    return "channel" if _CHANNELS.search(clause) else None
