"""Segmentation metrics for topic labels: Pk and WindowDiff (through nltk), boundary F1, return accuracy.

A dialogue's topics are a list of labels, one per user turn. A *boundary* is a turn whose label differs
from the previous turn's (docs/dialogue-format.md, "Topics"); a *return* is a boundary whose label was
seen before. The classifier's output is a list of decisions (`new`, `continue`, `return:<k>`), whose
boundaries are the turns that are not `continue`.

Pk and WindowDiff are computed by `nltk.metrics.segmentation` on boundary strings: character i is "1"
when turn i starts a new segment (turn 0 never does). The window k is nltk's default for Pk (half the
mean reference segment length, rounded) but at least 1, and WindowDiff uses the same k.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

CONTINUE, NEW, RETURN = "continue", "new", "return"


def boundaries_of_labels(labels: list[str]) -> str:
    """The boundary string of a reference labelling."""
    return "".join("1" if i and labels[i] != labels[i - 1] else "0" for i in range(len(labels)))


def boundaries_of_decisions(decisions: list[str]) -> str:
    """The boundary string of predicted decisions: every turn but the first that is not `continue`."""
    return "".join("1" if i and d != CONTINUE else "0" for i, d in enumerate(decisions))


def window(reference: str) -> int:
    """nltk's default Pk window (half the mean reference segment length), at least 1."""
    return max(1, int(round(len(reference) / (max(reference.count("1"), 1) * 2.0))))


def pk(reference: str, hypothesis: str, k: int | None = None) -> float:
    from nltk.metrics.segmentation import pk as nltk_pk  # nltk takes seconds to import: only when scoring

    return nltk_pk(reference, hypothesis, k=k or window(reference), boundary="1")


def windowdiff(reference: str, hypothesis: str, k: int | None = None) -> float:
    from nltk.metrics.segmentation import windowdiff as nltk_windowdiff

    return nltk_windowdiff(reference, hypothesis, k or window(reference), boundary="1")


def return_target(decision: str) -> int | None:
    """k of `return:<k>`, else None."""
    return int(decision.split(":", 1)[1]) if decision.startswith(RETURN + ":") else None


@dataclass
class Scores:
    pk: float
    windowdiff: float
    boundary_f1: float
    return_accuracy: float
    turns: int
    boundaries: int  # reference boundaries
    predicted_boundaries: int
    boundary_hits: int
    returns: int  # reference returns
    returns_named: int  # reference returns predicted as return:<k> with k a turn of that topic
    returns_predicted: int = 0  # turns predicted as return:<k>
    returns_predicted_right: int = 0  # of those, at a reference boundary with k a turn of the turn's topic

    @property
    def return_precision(self) -> float:
        return self.returns_predicted_right / self.returns_predicted if self.returns_predicted else float("nan")

    def to_json(self) -> dict:
        return {**asdict(self), "return_precision": self.return_precision}


def f1(hits: int, predicted: int, reference: int) -> float:
    if not predicted and not reference:
        return 1.0
    return 2 * hits / (predicted + reference) if predicted + reference else 0.0


def score_dialogue(labels: list[str], decisions: list[str]) -> Scores:
    """All figures for one dialogue."""
    if len(labels) != len(decisions):
        raise ValueError(f"{len(labels)} labels but {len(decisions)} decisions")
    ref, hyp = boundaries_of_labels(labels), boundaries_of_decisions(decisions)
    k = window(ref)
    hits = sum(r == h == "1" for r, h in zip(ref, hyp))
    returns = named = predicted = right = 0
    for t in range(1, len(labels)):
        target = return_target(decisions[t])
        hit = target is not None and 0 <= target < t and labels[target] == labels[t] and labels[t] != labels[t - 1]
        if labels[t] != labels[t - 1] and labels[t] in labels[:t]:
            returns += 1
            named += hit
        predicted += target is not None
        right += hit
    return Scores(pk=pk(ref, hyp, k), windowdiff=windowdiff(ref, hyp, k),
                  boundary_f1=f1(hits, hyp.count("1"), ref.count("1")),
                  return_accuracy=named / returns if returns else float("nan"),
                  turns=len(labels), boundaries=ref.count("1"), predicted_boundaries=hyp.count("1"),
                  boundary_hits=hits, returns=returns, returns_named=named, returns_predicted=predicted,
                  returns_predicted_right=right)


def score_all(per_dialogue: list[Scores]) -> Scores:
    """Over many dialogues: Pk and WindowDiff are the mean of the dialogues' values; boundary F1 and
    return accuracy pool every turn (micro average)."""
    if not per_dialogue:
        raise ValueError("no dialogues to score")
    n = len(per_dialogue)
    total = {key: sum(getattr(s, key) for s in per_dialogue)
             for key in ("turns", "boundaries", "predicted_boundaries", "boundary_hits", "returns", "returns_named",
                         "returns_predicted", "returns_predicted_right")}
    return Scores(pk=sum(s.pk for s in per_dialogue) / n, windowdiff=sum(s.windowdiff for s in per_dialogue) / n,
                  boundary_f1=f1(total["boundary_hits"], total["predicted_boundaries"], total["boundaries"]),
                  return_accuracy=total["returns_named"] / total["returns"] if total["returns"] else float("nan"),
                  **total)
