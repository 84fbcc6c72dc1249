"""Dialogue acts the memory acts on, told by cue phrases (no parser model is available offline):

- a user's request to recap the conversation ("one line on what we sorted today", "sum it all up"): what it
  needs is spread over the whole dialogue, and the names in it are whom the recap is for ("so I can tell
  Tom"), not what it is about;
- a reply that records an outcome ("I've booked ...", "Moved: ...", "Your refund is confirmed"): the turns
  a recap is made of;
- a user's question for one of their identifiers by its noun ("what's my membership number?"): it names no
  value to find, only the kind of value, and the number may have been given by the assistant;
- whom a request is for or from ("Geoffrey wants to know which day ...", "... - Priya", "Helen: ..."): a name
  there says who asks, not what about, and recalling every turn that names the asker (in a household's chat,
  each signed message does) fills the room the answer needed."""

from __future__ import annotations

import re

_DONE = (r"done|sorted|booked|arranged|agreed|covered|set up|changed|fixed|organised|organized|ordered|signed up|"
         r"decided|do|book|sort|arrange|agree|change|fix|order|sign up|decide")
RECAP = re.compile(
    r"\b(?:summar(?:y|ise|ize)|sum (?:(?:it|this|that|everything|things) )?(?:all )?up|recap|rundown|run[- ]through of"
    r"|quick run[- ]through|round[- ]?up\b|one[- ]liner|one[- ]line(?:[,.:!?]| (?:on|of|for|about|summary|version|please|pls))"
    r"|in (?:one|a single|a) (?:line|sentence)|one sentence|short version|the gist"
    r"|list (?:the main things|(?:of )?what|everything|it all)"
    rf"|what (?:have|did|has|'ve) (?:we|you|i)(?: actually| just)? (?:{_DONE})\b"
    r"|what(?:'s| is| has been| have we| we've)(?: got)? (?:booked|sorted|arranged|agreed|on for me|been done|been agreed)"
    r"|everything (?:we|you)(?:'ve| have|'re| are)? (?:done|doing|sorted|booked|covered|arranged|agreed))", re.I)

_ACTED = (r"booked|arranged|moved|cancell?ed|opened|refunded|added|ordered|set up|sent|logged|raised|reserved|confirmed|"
          r"changed|updated|scheduled|applied|blocked|issued|waived|noted|put|switched|swapped|replaced|upgraded|"
          r"registered|requested|submitted|released|fixed|restored|reissued|credited|cleared|passed|made|taken|lowered|"
          r"disputed|enrolled|paid|pencilled")
OUTCOME = re.compile(
    rf"\b(?:I've|I have|we've|we have|I'll|I will)\s+(?:now\s+|also\s+|just\s+)?(?:{_ACTED})\b"
    r"|^\s*(?:Booked|Done|Confirmed|Moved|Added|Updated|Arranged|Sorted|Reserved|Cancell?ed|Refunded|Ordered|Changed"
    r"|Noted|All set)\b[^.]*?:"
    r"|\b(?:is|are|has been|have been|is now|are now)\s+(?:booked|confirmed|arranged|reserved|cancell?ed|refunded|moved"
    r"|ordered|added|scheduled|set up|sorted)\b", re.I | re.M)


_ASKED = re.compile(  # "what's my membership number", "which account number have you got", "the booking ref again?"
    r"\b(?:my|our|the|your|his|her)\s+((?:[a-z-]+\s+){1,2}?)(?:number|no\.?|reference|ref|code|id)\b", re.I)
_QUESTION = re.compile(r"\?|\b(?:what|which|remind|again|tell me|read (?:it|me)|need)\b", re.I)
_NOT_KINDS = frozenset("the a an new old same other right wrong full last first this that phone mobile contact".split())
CODE = re.compile(r"(?<![\w£$.,])(?=[\w/-]*\d)[A-Za-z0-9][\w/-]{3,}(?![\w])")  # HPI-338207, 23081547, FYC-20417


_FOR_WHOM = re.compile(
    r"(?:^|\s)[-\u2013\u2014]\s*([A-Z][a-z]+)[^\w]*$"  # a sign-off: "... what was it? - Bev"
    r"|^\s*[-\u2013\u2014]?\s*([A-Z][a-z]+)(?::|\s+asking\b)"  # a label: "Helen: ...", "- Priya asking if ..."
    r"|\b([A-Z][a-z]+)(?:'s)?\s+(?:(?:is|was|has|keeps|will|would|just|also)\s+){0,2}"  # "Tom's asking", "Mr Reid has asked"
    r"(?:wants?|wanted|needs?|needed|ask(?:s|ed|ing)|tells? me|told me|says|said|would like)\b", re.M)


def asked_kinds(text: str) -> list[str]:
    """The nouns of the identifiers a user's turn asks for ("membership" of "what's my membership number?")."""
    if not _QUESTION.search(text):
        return []
    words = [w.lower() for m in _ASKED.finditer(text) for w in m.group(1).split()]
    return [w for w in dict.fromkeys(words) if w not in _NOT_KINDS and len(w) > 2]


def requesters(text: str) -> set[str]:
    """The names, lower-cased, of whom a user's turn says is asking or will be told ("Geoffrey wants to
    know ...", "... - Priya", "Helen: ...")."""
    return {name.lower() for m in _FOR_WHOM.finditer(text) for name in m.groups() if name}


def asks_recap(text: str) -> bool:
    """Whether a user's turn asks for a recap of the conversation."""
    return bool(RECAP.search(text))


def records_outcome(reply: str) -> bool:
    """Whether a reply records something done or settled."""
    return bool(OUTCOME.search(reply))
