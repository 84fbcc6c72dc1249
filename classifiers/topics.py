"""Online topic-boundary classifier: at each user turn, `new`, `continue` or `return:<k>`.

What a topic is: docs/dialogue-format.md, "Topics" (one request of the customer; a side question,
small talk or a stated preference is a topic of its own; coming back to an earlier request is a
return). The tracker is online: at user turn t it has seen turns 0..t and the assistant's replies to
turns 0..t-1, never anything later.

Two scikit-learn models over cheap features (boosted trees, or logistic regressions: train.KIND)
decide:
- the *ranker* scores each earlier topic other than the current one as the one this turn returns to
  (embedding similarity to the topic's centroid, its closest turn, its first and last turn and its
  replies; idf-weighted word overlap with the whole topic, its first turn and its closest turn, and
  with the words no other topic shares; entity and number overlap, also with what its replies
  restated; recency and size; whether it is the topic the current one interrupted, and whether its
  last reply left it open; each candidate's margin to the best of the others);
- the *decider* picks continue / new / return from the turn's similarity to the previous turn and the
  assistant's last reply, cue phrases ("by the way", "going back to", ...), turn lengths, the
  current topic's features and the ranker's best candidate. A return goes to the best candidate.

The turn's embedding (all-MiniLM-L6-v2, unit length) is computed once per turn; a caller that also
needs it (the memory store) computes it and passes it in: `observe(text, embedding=...)`.

    tracker = TopicTracker.load(embedder=load_embedder())
    decision = tracker.observe("Going back to the refund, has it gone through?")
    decision.label, decision.segment, decision.topic_turn    # 'return:3', 12, 3
    tracker.reply("Yes, the refund left our side yesterday.")
    saved = tracker.state(); tracker = TopicTracker.from_state(saved, embedder=...)

The fitted model is a small JSON file (data/models/topics.json) with a format version; a file of
another version, or one that cannot be read, raises TopicModelError with a one-line message naming it.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT_VERSION = 2  # of the model file; 2: the ranker's topic features and margins (TOPIC_FEATURES)
STATE_VERSION = 1  # of TopicTracker.state()
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "topics.json"  # models/ links to data/models
EMBED_DIM = 384
MAX_CANDIDATES = 48  # earlier topics considered for a return (the most recently active ones)
DECISIONS = ("continue", "new", "return")


class TopicModelError(ValueError):
    """A topic model file is missing, unreadable, of another format version, or not a topic model."""


# --- embeddings -------------------------------------------------------------------------------------


def load_embedder(device: str = "cpu"):
    """The agent's embedder (memory/embedder.py: the bundled all-MiniLM-L6-v2, no hub access, in the dtype
    it runs in on this machine), so that training and `palace topics` see the features the agent will:
    bfloat16 instead of float32 moves 24 of 1,000 decisions on data/dev/."""
    from memory.embedder import Embedder, EmbedderConfig

    return Embedder(EmbedderConfig(device=device, batch_size=64, cache_size=0))


def embed(embedder, texts: Sequence[str]) -> np.ndarray:
    """Unit-length float32 embeddings, one row per text (`embedder`: a memory.embedder.Embedder)."""
    return embedder.embed(list(texts))


def unit(vector: Any) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape[0] != EMBED_DIM:
        raise ValueError(f"embedding has {v.shape[0]} dimensions, expected {EMBED_DIM} (all-MiniLM-L6-v2)")
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


# --- text features ----------------------------------------------------------------------------------

STOPWORDS = frozenset("""
a about above after afterwards again against all almost along already also although always am among an and
another any anyhow anyone anything anyway anywhere are around as at be became because become been before being
below beside besides between beyond both but by can cannot cant could couldnt did didnt do does doesnt doing done
dont down during each either else elsewhere enough etc even ever every everyone everything everywhere except few
for from further had has hasnt have havent having he hence her here hers herself him himself his how however i
ie if im in indeed into is isnt it its itself ive just least less let lets like many may maybe me meanwhile might
mine more moreover most mostly much must my myself neither never nevertheless no nobody none noone nor not nothing
now nowhere of off often oh ok okay on once one only onto or other others otherwise our ours ourselves out over own
per perhaps please quite rather really same seem seemed seems several she should shouldnt since so some somehow
someone something sometime sometimes somewhere still such than that thats the their theirs them themselves then
there thereby therefore these they theyre thing things this those though through thus to together too toward
towards under until up upon us very via was wasnt we well were weve what whatever when whenever where whereas
wherever whether which while who whoever whole whom whose why will with within without wont would wouldnt yes yet
yeah you youd youll your youre yours yourself yourselves youve
hi hello hey thanks thank sure got get let want need know think just bit lot actually quick question sorry way
going go great good right help wait also would shall
""".split())

TOKEN = re.compile(r"[\w$@][\w@.'$\-/]*\w|[\w$]")
SENTENCE_START = re.compile(r"(?:^|[.!?]\s+|[\"(]\s*)$")


def _cue(*phrases: str) -> re.Pattern:
    return re.compile(r"(?<![\w'])(?:" + "|".join(phrases) + r")(?![\w'])")


NEW_CUES = _cue(r"another (?:thing|question|issue|matter|problem)", r"one more (?:thing|question)",
                r"(?:a |the )?(?:second|other|separate|different|new|unrelated) (?:thing|question|issue|topic|matter|problem)",
                r"something else", r"by the way", r"btw", r"while i'?m (?:here|at it|on)", r"while i have you",
                r"separately", r"unrelated", r"before i forget", r"quick question", r"random question",
                r"on another note", r"on a different note", r"chang(?:e|ing) (?:of )?(?:the )?subject",
                r"off topic", r"oh,? and", r"one other", r"i also (?:want|need|have|wanted|meant)",
                r"(?:last|final) (?:thing|question)", r"totally different", r"completely different",
                r"also,", r"and also", r"different topic", r"now for")
RETURN_CUES = _cue(r"(?:going|go|coming|come|getting|get|circling|circle|jumping|jump|turning) back to",
                   r"back to", r"returning to", r"return to", r"circl(?:e|ing) back", r"as i (?:said|mentioned)",
                   r"i (?:mentioned|said|told you|gave you)", r"you (?:said|mentioned|told me|gave me)", r"earlier",
                   r"again", r"remind me", r"where were we", r"revisit", r"follow(?:ing)? up on", r"about that",
                   r"the one (?:i|we|you)", r"as for the", r"regarding the", r"still (?:waiting|on|about)",
                   r"that (?:refund|claim|order|case|issue|problem|booking|payment|charge|credit|repair|delivery)",
                   r"anyway", r"what was (?:the|my|that)", r"which (?:one|was)")
CONTINUE_START = re.compile(r"^(?:it|its|it's|that|that's|this|they|they're|them|those|these|there|he|she|so|and|"
                            r"but|then|what about|how about|what if|or|if so|in that case|also|even|how long|"
                            r"how much|when|why|will it|will that|would it|does it|does that|is it|is that|"
                            r"can it|can they|should i)(?![\w'])")
ACK_START = re.compile(r"^(?:ok|okay|thanks|thank you|great|yes|yeah|yep|no|nope|sure|right|perfect|got it|alright|"
                       r"all right|fine|cool|sounds good|lovely|brilliant|understood|i see|ah|oh i see|good)(?![\w'])")
CLOSING = _cue(r"before i go", r"that'?s (?:all|everything)", r"that is all", r"sum (?:it |that |everything )?up",
               r"recap", r"summar\w*", r"wrap (?:it |this )?up", r"bye", r"goodbye", r"have a (?:good|nice|great)",
               r"all for today")
REPLY_INVITES = _cue(r"anything else", r"what else", r"something else", r"any other", r"else i can",
                     r"how can i help", r"what can i do", r"help (?:you )?with (?:today|anything)")
REPLY_SETTLES = re.compile(r"^(?:noted|got it|thanks|thank you|of course|certainly|no problem|sure|done|understood|"
                           r"perfect|great|okay|ok|all set|absolutely)(?![\w'])|\bi(?:'ve| have) (?:saved|noted|updated|"
                           r"set|changed|added|booked|logged|moved|made a note|recorded|passed)")
REPLY_PENDING = _cue(r"i'?ll", r"we'?ll", r"i will", r"we will", r"let me", r"get back to", r"as soon as",
                     r"once (?:it|we|the|you)", r"waiting (?:for|on)", r"pending", r"follow up")
RETURN_TARGET = re.compile(r"(?:back to|returning to|return to|about|regarding|as for|with|on) ((?:[\w'-]+ ?){1,5})")


@lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
    """A light suffix stripper (plurals, -ing, -ed, -ly): enough to match "refunds" with "refund" and
    "charged" with "charge", and cheap (no stemmer library to import at chat start)."""
    w = word
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("sses", "shes", "ches", "xes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
    elif len(w) > 4 and w.endswith("ed"):
        w = w[:-2] if not w.endswith("eed") else w[:-1]
    elif len(w) > 5 and w.endswith("ly"):
        w = w[:-2]
    if len(w) > 3 and w[-1] == w[-2] and w[-1] not in "lsz":  # stopped -> stopp -> stop
        w = w[:-1]
    if len(w) > 3 and w.endswith("e"):  # charge/charg(ed): drop a final e so both forms meet
        w = w[:-1]
    return w


@dataclass(frozen=True)
class TextBits:
    """What the features need of one message."""
    words: frozenset[str]  # content-word stems
    entities: frozenset[str]  # numbers, codes, emails, capitalised names (lower-cased)
    numbers: frozenset[str]
    n_words: int
    cues: tuple[float, ...]  # new, return, continuation start, acknowledgement start, closing, question
    invites: float  # (replies) invites a new request: "anything else?"
    pending: float  # (replies) leaves the matter open: asks something or promises a follow-up
    settles: float  # (replies) acknowledges or records something: "Noted, I've saved ..."
    target: frozenset[str]  # content stems right after a return cue ("back to *the refund*")


@lru_cache(maxsize=4096)
def analyse(text: str) -> TextBits:
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    low = text.lower().strip()
    words, entities, numbers = set(), set(), set()
    n = 0
    for match in TOKEN.finditer(text):
        token = match.group(0)
        n += 1
        lower = token.lower().strip(".'-")
        if any(c.isdigit() for c in token):
            value = lower.lstrip("$").rstrip(".")
            numbers.add(value)
            entities.add(value)
        elif "@" in token:
            entities.add(lower)
        elif token[0].isupper() and token != "I" and not token.startswith("I'") and lower not in STOPWORDS \
                and not SENTENCE_START.search(text[:match.start()]):
            entities.add(lower)
        if lower.isalpha() and len(lower) > 2 and lower not in STOPWORDS:
            words.add(stem(lower))
    cues = (float(bool(NEW_CUES.search(low))), float(bool(RETURN_CUES.search(low))),
            float(bool(CONTINUE_START.match(low))), float(bool(ACK_START.match(low))),
            float(bool(CLOSING.search(low))), float("?" in low))
    target: set[str] = set()
    if cues[1]:
        for m in RETURN_TARGET.finditer(low):
            target.update(stem(w) for w in re.findall(r"[a-z]+", m.group(1)) if len(w) > 2 and w not in STOPWORDS)
    return TextBits(frozenset(words), frozenset(entities), frozenset(numbers), n, cues,
                    float(bool(REPLY_INVITES.search(low))),
                    float("?" in low or bool(REPLY_PENDING.search(low))), float(bool(REPLY_SETTLES.search(low))),
                    frozenset(target))


# --- features ---------------------------------------------------------------------------------------

PAIR_FEATURES = ("sim_centroid", "sim_max", "sim_mean", "sim_first", "sim_last", "sim_replies", "sim_reply_max",
                 "words", "user_words", "cue_target", "entities", "numbers", "recency", "size", "interrupted",
                 "runs")
# the ranker's alone: they tell earlier topics apart; the decider sees them through the best one's score
TOPIC_FEATURES = ("words_own", "words_first", "words_turn_max", "reply_entities", "pending")
RANK_FEATURES = PAIR_FEATURES + TOPIC_FEATURES + ("sim_max_margin", "sim_centroid_margin", "words_margin",
                                                  "recency_rank", "words_own_margin", "sim_reply_max_margin",
                                                  "entities_margin")
TURN_FEATURES = ("sim_prev", "sim_prev_reply", "sim_prev2", "words_prev", "words_prev_reply",
                 "cue_new", "cue_return", "starts_continuation", "starts_ack", "closing", "question",
                 "length", "prev_length", "reply_length", "reply_question", "reply_invites", "reply_settles",
                 "has_entities", "has_numbers", "prev_question", "prev_has_entities", "prev_cue_new",
                 "run_length", "topic_count", "current_is_new_run", "current_single_turn",
                 "current_first_question", "current_first_entities", "current_first_cue_new",
                 "novelty", "sim_all_mean", "sim_all_max")
DECIDE_FEATURES = (TURN_FEATURES + tuple("cur_" + f for f in PAIR_FEATURES)
                   + tuple("best_" + f for f in PAIR_FEATURES)
                   + ("best_score", "second_score", "has_candidate", "best_minus_cur_sim", "best_minus_cur_words",
                      "return_cue_x_best_words", "return_cue_x_best_sim", "new_cue_x_cur_sim",
                      "cur_sim_max_over_mean", "best_sim_max_over_mean", "cur_centroid_over_mean"))
_W, _SIM_MAX, _TARGET = PAIR_FEATURES.index("words"), PAIR_FEATURES.index("sim_max"), PAIR_FEATURES.index("cue_target")
_OWN, _REPLY_MAX, _ENT = (RANK_FEATURES.index(f) for f in ("words_own", "sim_reply_max", "entities"))
_SIM_ALL_MEAN = TURN_FEATURES.index("sim_all_mean")


@dataclass
class Topic:
    first: int
    turns: list[int]
    user_sum: np.ndarray
    reply_sum: np.ndarray
    n_replies: int = 0
    words: Counter = field(default_factory=Counter)  # user and assistant content stems
    user_words: Counter = field(default_factory=Counter)
    entities: Counter = field(default_factory=Counter)
    numbers: Counter = field(default_factory=Counter)
    reply_entities: Counter = field(default_factory=Counter)  # what the assistant restated: amounts, dates, codes
    runs: int = 1
    idx: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def last(self) -> int:
        return self.turns[-1]


@dataclass
class Decision:
    label: str  # "new", "continue" or "return:<k>"
    segment: int  # first turn of the contiguous run of turns this one is in (an eviction unit)
    topic_turn: int  # first turn of the topic this turn belongs to (k of return:k; the turn itself for new)
    probs: dict[str, float] = field(default_factory=dict)  # the decider's continue/new/return probabilities

    @property
    def kind(self) -> str:
        return self.label.split(":", 1)[0]


@dataclass
class Candidates:
    """Everything the model looks at for one turn, before deciding."""
    turn: np.ndarray  # TURN_FEATURES
    current: np.ndarray | None  # PAIR_FEATURES of the current topic
    ids: list[int]  # earlier topics other than the current one (first turns), most recently active first
    pairs: np.ndarray  # RANK_FEATURES, one row per id


def _logistic(params: dict, x: np.ndarray) -> np.ndarray:
    """Class probabilities of a fitted sklearn LogisticRegression, from its stored parameters."""
    z = ((x - params["mean"]) / params["scale"]) @ params["coef"].T + params["intercept"]
    return _probabilities(z)


def _probabilities(z: np.ndarray) -> np.ndarray:
    if z.shape[-1] == 1:
        p = 1.0 / (1.0 + np.exp(-z))
        return np.concatenate([1 - p, p], axis=-1)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _boosted(params: dict, x: np.ndarray) -> np.ndarray:
    """Class probabilities of a fitted sklearn HistGradientBoostingClassifier, from its exported trees:
    all trees and samples walked at once, one level per step, on flattened node arrays."""
    flat = params.get("_flat") or _flatten(params)
    n, width = x.shape
    roots = flat["roots"]
    node = np.tile(roots, n)  # sample-major: n blocks of n_trees
    base = np.repeat(np.arange(n) * width, roots.shape[0])
    xs = np.ascontiguousarray(x, dtype=np.float64).ravel()
    feature, threshold, left, right = flat["feature"], flat["threshold"], flat["left"], flat["right"]
    for _ in range(flat["depth"]):
        node = np.where(xs[base + feature[node]] <= threshold[node], left[node], right[node])
    classes = flat["classes"]
    raw = flat["value"][node].reshape(n, -1, classes).sum(axis=1) + flat["baseline"]
    return _probabilities(raw)


def _flatten(params: dict) -> dict:
    """Node arrays of all trees end to end, with global child indices; a leaf points to itself."""
    trees, width = params["feature"].shape
    offsets = np.arange(trees)[:, None] * width
    own = offsets + np.arange(width)[None, :]
    leaf = params["leaf"]
    flat = {"roots": offsets.ravel().astype(np.int64),
            "feature": np.where(leaf, 0, params["feature"]).ravel().astype(np.int64),
            "threshold": np.where(leaf, np.inf, params["threshold"]).ravel(),
            "left": np.where(leaf, own, offsets + params["left"]).ravel().astype(np.int64),
            "right": np.where(leaf, own, offsets + params["right"]).ravel().astype(np.int64),
            "value": params["value"].ravel(), "depth": int(params["depth"]),
            "classes": int(params["classes"]), "baseline": params["baseline"]}
    params["_flat"] = flat
    return flat


def _predict(params: dict, x: np.ndarray) -> np.ndarray:
    return _boosted(params, x) if "feature" in params else _logistic(params, x)


def export_boosted(clf) -> dict:
    """The trees of a fitted HistGradientBoostingClassifier as arrays (numerical features, no missing values)."""
    predictors = [tree for iteration in clf._predictors for tree in iteration]
    width = max(len(tree.nodes) for tree in predictors)
    arrays = {k: np.zeros((len(predictors), width), dtype) for k, dtype in
              (("feature", np.int64), ("threshold", np.float64), ("left", np.int64), ("right", np.int64),
               ("leaf", bool), ("value", np.float64))}
    arrays["leaf"][:] = True
    for i, tree in enumerate(predictors):
        nodes = tree.nodes
        m = len(nodes)
        arrays["feature"][i, :m] = nodes["feature_idx"]
        arrays["threshold"][i, :m] = nodes["num_threshold"]
        arrays["left"][i, :m] = nodes["left"]
        arrays["right"][i, :m] = nodes["right"]
        arrays["leaf"][i, :m] = nodes["is_leaf"]
        arrays["value"][i, :m] = nodes["value"]
    depth = max(int(tree.nodes["depth"].max()) for tree in predictors)
    return {**arrays, "depth": np.asarray(depth), "classes": np.asarray(len(clf._predictors[0])),
            "baseline": np.asarray(clf._baseline_prediction, dtype=np.float64).ravel()}


def _arrays(params: dict) -> dict:
    types = {"feature": np.int64, "left": np.int64, "right": np.int64, "leaf": bool, "depth": np.int64,
             "classes": np.int64}
    return {k: np.asarray(v, dtype=types.get(k, np.float64)) for k, v in params.items() if not k.startswith("_")}


class TopicModel:
    """The fitted ranker and decider, the idf table, the baseline's thresholds. Stored as JSON."""

    def __init__(self, ranker: dict, decider: dict, idf: dict[str, float], default_idf: float,
                 texttiling: dict | None = None, meta: dict | None = None):
        self.ranker = _arrays(ranker)
        self.decider = _arrays(decider)
        self.idf_table = idf
        self.default_idf = float(default_idf)
        self.texttiling = texttiling or {}
        self.meta = meta or {}

    def idf(self, word: str) -> float:
        return self.idf_table.get(word, self.default_idf)

    def rank(self, pairs: np.ndarray) -> np.ndarray:
        return _predict(self.ranker, pairs)[:, 1]

    def decide(self, features: np.ndarray) -> np.ndarray:
        return _predict(self.decider, features[None, :])[0]

    # --- files ---
    def to_json(self) -> dict:
        return {"format": MODEL_FORMAT, "format_version": FORMAT_VERSION,
                "rank_features": list(RANK_FEATURES), "decide_features": list(DECIDE_FEATURES),
                "ranker": _encode(self.ranker), "decider": _encode(self.decider),
                "idf": self.idf_table, "default_idf": self.default_idf, "texttiling": self.texttiling,
                "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path | None = None) -> "TopicModel":
        """Read a model file; any problem is a TopicModelError with a one-line message naming the file."""
        path = Path(path) if path else DEFAULT_MODEL
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TopicModelError(f"{path}: no such topic model file (train one with `palace train`)") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise TopicModelError(f"{path}: not a readable topic model (corrupt or truncated: {_first_line(exc)})") from None
        if not isinstance(raw, dict) or raw.get("format") != MODEL_FORMAT:
            raise TopicModelError(f"{path}: not a topic model file")
        if raw.get("format_version") != FORMAT_VERSION:
            raise TopicModelError(f"{path}: topic model format version {raw.get('format_version')!r}, this code "
                                  f"reads version {FORMAT_VERSION}; retrain it with `palace train`")
        try:
            if raw["rank_features"] != list(RANK_FEATURES) or raw["decide_features"] != list(DECIDE_FEATURES):
                raise ValueError("its features differ from this code's")
            model = cls(_decode(raw["ranker"]), _decode(raw["decider"]), dict(raw["idf"]), raw["default_idf"],
                        raw.get("texttiling"), raw.get("meta"))
            for part, width, classes in ((model.ranker, len(RANK_FEATURES), 2),
                                         (model.decider, len(DECIDE_FEATURES), len(DECISIONS))):
                _check(part, width, classes)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise TopicModelError(f"{path}: not a valid topic model ({_first_line(exc)})") from None
        return model


    @classmethod
    def shared(cls) -> "TopicModel":
        """The shipped model, read once per process (agents only read it)."""
        return _shipped_model()


@lru_cache(maxsize=None)
def _shipped_model() -> TopicModel:
    return TopicModel.load()


MODEL_FORMAT = "memory-palace topic model"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _encode(params: dict) -> dict:
    """Arrays as {dtype, shape, base64 of the raw little-endian bytes}: exact and compact."""
    out = {}
    for k, v in params.items():
        if k.startswith("_"):  # caches
            continue
        a = np.array(v, order="C")
        dtype = {"b": "bool", "i": "int32", "f": "float64"}[a.dtype.kind]
        out[k] = {"dtype": dtype, "shape": list(a.shape),
                  "data": base64.b64encode(a.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode("ascii")}
    return out


def _decode(params: dict) -> dict:
    out = {}
    for k, v in params.items():
        a = np.frombuffer(base64.b64decode(v["data"], validate=True), dtype=np.dtype(v["dtype"]).newbyteorder("<"))
        out[k] = a.reshape(v["shape"]).astype(np.dtype(v["dtype"]))
    return out


def _check(part: dict, width: int, classes: int) -> None:
    """Shapes and values a model part must have, so that a damaged file fails here and not mid-chat."""
    if not all(np.isfinite(v).all() for k, v in part.items() if not k.startswith("_") and v.dtype.kind == "f"):
        raise ValueError("non-finite parameters")
    outputs = 1 if classes == 2 else classes
    if "feature" in part:  # boosted trees
        feature, left, right = part["feature"], part["left"], part["right"]
        trees, nodes = feature.shape
        if any(part[k].shape != (trees, nodes) for k in ("threshold", "left", "right", "leaf", "value")) \
                or int(part["classes"]) != outputs or trees % outputs or part["baseline"].shape != (outputs,):
            raise ValueError("tree arrays do not fit together")
        inner = ~part["leaf"]
        if (feature[inner] < 0).any() or (feature[inner] >= width).any() or (left[inner] < 0).any() \
                or (left[inner] >= nodes).any() or (right[inner] < 0).any() or (right[inner] >= nodes).any():
            raise ValueError("tree arrays point outside the trees or the features")
    else:  # logistic regression
        if part["coef"].shape != (outputs, width) or part["mean"].shape != (width,) \
                or part["scale"].shape != (width,) or part["intercept"].shape != (outputs,):
            raise ValueError("parameter shapes do not match the features")


# --- the tracker ------------------------------------------------------------------------------------


@dataclass
class _Turn:
    text: str
    embedding: np.ndarray
    topic: int
    run: int
    label: str
    reply: str | None = None
    reply_embedding: np.ndarray | None = None


class TopicTracker:
    """Online topic state of one conversation. `observe` each user turn (in order), `reply` each
    assistant reply. Topics are named by their first turn."""

    def __init__(self, model: TopicModel | None = None, embedder=None):
        self.model = model
        self.embedder = embedder
        self.turns: list[_Turn] = []
        self.topics: dict[int, Topic] = {}
        self._emb = np.zeros((64, EMBED_DIM), np.float32)  # user turns
        self._remb = np.zeros((64, EMBED_DIM), np.float32)  # replies (zero where none)
        self._has_reply = np.zeros(64, bool)
        self._seen: set[str] = set()  # content stems of every message so far

    @classmethod
    def load(cls, path: str | Path | None = None, embedder=None) -> "TopicTracker":
        return cls(TopicModel.load(path), embedder)

    # --- public API ---
    def observe(self, text: str, embedding: Any = None, assistant_reply: str | None = None,
                reply_embedding: Any = None) -> Decision:
        """Classify user turn t = len(turns) and add it to the state. `embedding`: the turn's
        all-MiniLM-L6-v2 embedding if the caller has it (else the tracker's embedder computes it).
        `assistant_reply`: the reply to the previous turn, if `reply` was not called for it."""
        if self.model is None:
            raise TopicModelError("no topic model loaded (TopicTracker.load or TopicTracker(model=...))")
        if assistant_reply is not None and self.turns:
            self.reply(assistant_reply, reply_embedding)
        e = self._embedding(text, embedding)
        decision = self._decide(self.candidates(text, e))
        self.commit(text, e, decision)
        return decision

    def reply(self, text: str, embedding: Any = None) -> None:
        """The assistant's reply to the latest user turn (its words join that turn's topic). Its embedding
        is taken from `embedding`, else computed by the embedder if there is one, else left out."""
        if not self.turns:
            raise ValueError("reply before any user turn")
        e = unit(embedding) if embedding is not None else embed(self.embedder, [text])[0] if self.embedder else None
        self._add_reply(text, e)

    def state(self) -> dict:
        """JSON-serialisable state (turns, embeddings, decisions) for saving a session."""
        return {"format_version": STATE_VERSION,
                "turns": [{"text": t.text, "embedding": t.embedding.tolist(), "label": t.label, "topic": t.topic,
                           "run": t.run, "reply": t.reply,
                           "reply_embedding": None if t.reply_embedding is None else t.reply_embedding.tolist()}
                          for t in self.turns]}

    @classmethod
    def from_state(cls, state: dict, model: TopicModel | None = None, embedder=None) -> "TopicTracker":
        """Rebuild a tracker from `state()`; decisions are replayed as recorded, not re-classified, and
        embeddings taken as saved (unit already: normalising twice would move them by rounding)."""
        if not isinstance(state, dict) or state.get("format_version") != STATE_VERSION:
            raise ValueError(f"topic tracker state of format version "
                             f"{state.get('format_version') if isinstance(state, dict) else None!r}, "
                             f"expected {STATE_VERSION}")
        tracker = cls(model, embedder)
        for t in state["turns"]:
            tracker.commit(t["text"], np.asarray(t["embedding"], dtype=np.float32), Decision(t["label"], t["run"], t["topic"]))
            if t.get("reply") is not None:
                r = t.get("reply_embedding")
                tracker._add_reply(t["reply"], None if r is None else np.asarray(r, dtype=np.float32))
        return tracker

    @property
    def current_topic(self) -> int | None:
        return self.turns[-1].topic if self.turns else None

    def segments(self) -> list[int]:
        """The topic (first turn) of every turn so far."""
        return [t.topic for t in self.turns]

    # --- internals (training uses them too: candidates, then commit the right decision) ---
    def _embedding(self, text: str, embedding: Any) -> np.ndarray:
        if embedding is not None:
            return unit(embedding)
        if self.embedder is None:
            raise ValueError("no embedding given and the tracker has no embedder")
        return embed(self.embedder, [text])[0]

    def _grow(self, t: int) -> None:
        if t >= self._emb.shape[0]:
            self._emb = np.concatenate([self._emb, np.zeros_like(self._emb)])
            self._remb = np.concatenate([self._remb, np.zeros_like(self._remb)])
            self._has_reply = np.concatenate([self._has_reply, np.zeros_like(self._has_reply)])

    def _add_reply(self, text: str, e: np.ndarray | None) -> None:
        t = len(self.turns) - 1
        last = self.turns[t]
        topic = self.topics[last.topic]
        if last.reply is not None:  # replaced: take the old one out of the topic first
            topic.words.subtract(analyse(last.reply).words)
            topic.words = +topic.words
            topic.reply_entities.subtract(analyse(last.reply).entities)
            topic.reply_entities = +topic.reply_entities
            if last.reply_embedding is not None:
                topic.reply_sum -= last.reply_embedding
                topic.n_replies -= 1
        last.reply, last.reply_embedding = text, e
        topic.words.update(analyse(text).words)
        topic.reply_entities.update(analyse(text).entities)
        self._seen.update(analyse(text).words)
        self._has_reply[t] = e is not None
        self._remb[t] = e if e is not None else 0.0
        if e is not None:
            topic.reply_sum += e
            topic.n_replies += 1

    def candidates(self, text: str, e: np.ndarray) -> Candidates:
        """Features of user turn t = len(turns): turn-level, the current topic's, each earlier topic's."""
        t = len(self.turns)
        if t == 0:
            return Candidates(np.zeros(len(TURN_FEATURES)), None, [], np.zeros((0, len(RANK_FEATURES))))
        bits = analyse(text)
        idf = self.model.idf if self.model is not None else (lambda w: 1.0)
        # sorted: float sums in set order would depend on the process's string hashing, and the trees'
        # thresholds on the last bit of a sum, so training would not be repeatable
        weights = {w: idf(w) for w in sorted(bits.words)}
        total = sum(weights.values())
        target = [w for w in sorted(bits.target) if w in weights]
        target_total = sum(weights[w] for w in target)

        def overlap(bag) -> float:
            return sum(v for w, v in weights.items() if w in bag) / total if total else 0.0

        prev = self.turns[-1]
        cur = self.topics[prev.topic]
        others = sorted((tp for tp in self.topics.values() if tp.first != cur.first), key=lambda tp: -tp.last)
        topics = [cur] + others[:MAX_CANDIDATES]
        sims = self._emb[:t] @ e
        rsims = np.where(self._has_reply[:t], self._remb[:t] @ e, -1.0)
        sums = np.stack([tp.user_sum for tp in topics])
        centroid = sums @ e / np.maximum(np.linalg.norm(sums, axis=1), 1e-9)
        rsums = np.stack([tp.reply_sum for tp in topics])
        rcentroid = rsums @ e / np.maximum(np.linalg.norm(rsums, axis=1), 1e-9)
        interrupted = self.turns[prev.run - 1].topic if prev.run > 0 else None
        user_sims, reply_sims = sims.tolist(), rsims.tolist()  # small topics: plain Python beats numpy calls
        centroid, rcentroid = centroid.tolist(), rcentroid.tolist()
        # a word shared by several topics tells them apart less: each word's weight is split between them
        spread = {w: v / max(1, sum(w in tp.words for tp in topics)) for w, v in weights.items()}
        rows = []
        for n, tp in enumerate(topics):
            s = [user_sims[i] for i in tp.turns]
            r = max(reply_sims[i] for i in tp.turns)
            last_reply = self.turns[tp.last].reply
            rows.append([centroid[n], max(s), sum(s) / len(s), user_sims[tp.first], user_sims[tp.last],
                         rcentroid[n] if tp.n_replies else 0.0, max(0.0, r),
                         overlap(tp.words), overlap(tp.user_words),
                         sum(weights[w] for w in target if w in tp.words) / target_total if target_total else 0.0,
                         min(3, sum(1 for x in bits.entities if x in tp.entities)),
                         min(3, sum(1 for x in bits.numbers if x in tp.numbers)),
                         math.log1p(t - tp.last), math.log1p(len(tp.turns)), float(tp.first == interrupted),
                         math.log1p(tp.runs),
                         sum(v for w, v in spread.items() if w in tp.words) / total if total else 0.0,
                         overlap(analyse(self.turns[tp.first].text).words),
                         max(overlap(analyse(self.turns[i].text).words) for i in tp.turns),
                         min(3, sum(1 for x in bits.entities if x in tp.reply_entities)),
                         analyse(last_reply).pending if last_reply is not None else 0.0])
        rows = np.asarray(rows, dtype=np.float64)
        current, rest = rows[0, :len(PAIR_FEATURES)], rows[1:]

        prev_bits = analyse(prev.text)
        reply_bits = analyse(prev.reply) if prev.reply is not None else None
        first_bits = analyse(self.turns[cur.first].text)
        run_length = t - prev.run
        turn = np.asarray([
            sims[t - 1], rsims[t - 1] if self._has_reply[t - 1] else sims[t - 1], sims[t - 2] if t >= 2 else 0.0,
            overlap(prev_bits.words), overlap(reply_bits.words) if reply_bits else 0.0,
            *bits.cues,
            math.log1p(bits.n_words), math.log1p(prev_bits.n_words),
            math.log1p(reply_bits.n_words) if reply_bits else 0.0,
            float("?" in (prev.reply or "")[-3:]), reply_bits.invites if reply_bits else 0.0,
            reply_bits.settles if reply_bits else 0.0,
            float(bool(bits.entities)), float(bool(bits.numbers)),
            prev_bits.cues[5], float(bool(prev_bits.entities)), prev_bits.cues[0],
            math.log1p(run_length), math.log1p(len(self.topics)),
            float(prev.run == t - 1), float(len(cur.turns) == 1),
            first_bits.cues[5], float(bool(first_bits.entities)), first_bits.cues[0],
            sum(v for w, v in weights.items() if w not in self._seen) / total if total else 0.0,
            sum(user_sims) / t, max(user_sims)], dtype=np.float64)
        if not len(rest):
            return Candidates(turn, current, [], np.zeros((0, len(RANK_FEATURES))))
        margins = np.stack([rest[:, _SIM_MAX] - rest[:, _SIM_MAX].max(), rest[:, 0] - rest[:, 0].max(),
                            rest[:, _W] - rest[:, _W].max(), np.log1p(np.arange(len(rest))),
                            rest[:, _OWN] - rest[:, _OWN].max(), rest[:, _REPLY_MAX] - rest[:, _REPLY_MAX].max(),
                            rest[:, _ENT] - rest[:, _ENT].max()], axis=1)
        return Candidates(turn, current, [tp.first for tp in topics[1:]], np.hstack([rest, margins]))

    def decide_features(self, cand: Candidates, scores: np.ndarray) -> tuple[np.ndarray, int | None]:
        """The decider's input for a turn, given the ranker's scores of its candidates; and the best one."""
        n_pair = len(PAIR_FEATURES)
        if cand.ids:
            order = np.argsort(-scores, kind="stable")
            best = int(order[0])
            best_row = cand.pairs[best, :n_pair]
            extra = [float(scores[best]), float(scores[order[1]]) if len(order) > 1 else 0.0, 1.0]
            best_id = cand.ids[best]
        else:
            best_row = np.zeros(n_pair)
            extra = [0.0, 0.0, 0.0]
            best_id = None
        cur, turn = cand.current, cand.turn
        cue_new, cue_return = turn[TURN_FEATURES.index("cue_new")], turn[TURN_FEATURES.index("cue_return")]
        mean = turn[_SIM_ALL_MEAN]
        cross = [best_row[_SIM_MAX] - cur[_SIM_MAX], best_row[_W] - cur[_W], cue_return * best_row[_W],
                 cue_return * best_row[_SIM_MAX], cue_new * cur[_SIM_MAX],
                 cur[_SIM_MAX] - mean, best_row[_SIM_MAX] - mean if cand.ids else 0.0, cur[0] - mean]
        return np.concatenate([turn, cur, best_row, extra, cross]), best_id

    def _decide(self, cand: Candidates) -> Decision:
        t = len(self.turns)
        if t == 0:
            return Decision("new", 0, 0, {"continue": 0.0, "new": 1.0, "return": 0.0})
        scores = self.model.rank(cand.pairs) if cand.ids else np.zeros(0)
        x, best = self.decide_features(cand, scores)
        probs = self.model.decide(x)
        if best is None:
            probs = np.array([probs[0], probs[1] + probs[2], 0.0])
        # a boundary when it is more likely than not (this minimises expected boundary errors, which is what
        # Pk counts at k=1), then a return when that is likelier than a new topic
        choice = "continue" if probs[0] >= probs[1] + probs[2] else "return" if probs[2] > probs[1] else "new"
        named = dict(zip(DECISIONS, map(float, probs)))
        prev = self.turns[-1]
        if choice == "continue":
            return Decision("continue", prev.run, prev.topic, named)
        if choice == "return":
            return Decision(f"return:{best}", t, best, named)
        return Decision("new", t, t, named)

    def commit(self, text: str, e: np.ndarray, decision: Decision) -> None:
        """Add user turn t with its decision to the state (no classification)."""
        t = len(self.turns)
        kind = decision.kind
        if t == 0 or kind == "new":
            topic_id, run = t, t
        elif kind == "continue":
            topic_id, run = self.turns[-1].topic, self.turns[-1].run
        else:
            topic_id, run = decision.topic_turn, t
            if topic_id not in self.topics or topic_id == self.turns[-1].topic:
                raise ValueError(f"return to topic {topic_id}, which is not an earlier topic")
        self._grow(t)
        self._emb[t] = e
        bits = analyse(text)
        if topic_id == t:
            self.topics[t] = Topic(t, [], np.zeros(EMBED_DIM, np.float32), np.zeros(EMBED_DIM, np.float32))
        topic = self.topics[topic_id]
        if topic.turns and run == t:
            topic.runs += 1
        topic.turns.append(t)
        topic.idx = np.asarray(topic.turns)
        topic.user_sum += e
        topic.words.update(bits.words)
        topic.user_words.update(bits.words)
        self._seen.update(bits.words)
        topic.entities.update(bits.entities)
        topic.numbers.update(bits.numbers)
        label = "new" if topic_id == t else "continue" if run != t else f"return:{topic_id}"
        self.turns.append(_Turn(text, e, topic_id, run, label))
