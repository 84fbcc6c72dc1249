"""Training and scoring against the dialogues' `persist` and `refs` annotations (docs/dialogue-format.md):
`palace train --what persistence` and `palace refs`.

- Persistence. A predicted span is right when it overlaps a gold span of the same turn (precision); a gold
  span is found when a predicted span overlaps it (recall). Overlap, not exact match, because the
  annotators' tight value and a pattern's can differ by a word ("by text" vs "a text to 07700...") while
  pinning either keeps the fact; exact-match figures are printed too. By type, a match needs the type.
- Corrections. At each probe, the graph run over the turns before it: for a `superseded`-tagged probe,
  whether it holds a `forbid` value (the corrected one) invalidated and an `expect` value current; for every
  probe with `expect` values, whether the graph wrongly holds the expected value invalidated (and none
  current). Values compare without spaces, case-insensitively, as pieces ("9140" is in "code 9140").
- References. Each annotated reference is resolved by the entity graph run over the dialogue as it goes
  (user turns observed, replies mentioned). It is right when the resolution of that span names the
  annotated entity (their content words overlap, so "the Felimazole tablets" matches "Felimazole 2.5 mg
  tablets"); the antecedent turn's accuracy is printed too, since that turn is what memory re-injects."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable

from classifiers.persistence import TYPES, PersistenceMarker, PreferenceModel, Span, cue_clauses
from classifiers.topics import STOPWORDS


def load_dialogues(paths: Iterable[str]) -> list[dict]:
    """Raw dialogues from .jsonl/.json files or folders of them (annotations are kept as written)."""
    dialogues = []
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no dialogue files in {path}")
        for file in files:
            text = file.read_text()
            try:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()] if file.suffix == ".jsonl" \
                    else [json.loads(text)]
            except ValueError as error:
                raise ValueError(f"{file}: not JSON ({error})") from None
            dialogues += [row for row in rows if isinstance(row, dict) and "turns" in row]
    return dialogues


def locate(text: str, span: str) -> int:
    """Where an annotated span stands in the text: its first occurrence as whole words ("he" is not the
    one inside "the"), else its first occurrence at all; -1 if absent."""
    match = re.search(rf"(?<!\w){re.escape(span)}(?!\w)", text)
    return match.start() if match else text.find(span)


def gold_spans(turn: dict) -> list[Span]:
    text = turn["user"]
    out = []
    for item in turn.get("persist", []):
        start = locate(text, item["span"])
        if start >= 0:
            out.append(Span(start, start + len(item["span"]), item["span"], item["type"], item["type"]))
    return out


def annotated(dialogues: list[dict], key: str) -> list[dict]:
    """The dialogues that carry this annotation at all (unannotated ones would count as all-negative)."""
    return [d for d in dialogues if any(key in t for t in d["turns"])]


# --- persistence ------------------------------------------------------------------------------------
def clause_examples(dialogues: list[dict]) -> tuple[list[str], list[str]]:
    """Every cue clause of every annotated user turn, labelled with the type of the preference or taboo
    span it overlaps ("none" when it overlaps none)."""
    clauses, labels = [], []
    for dialogue in annotated(dialogues, "persist"):
        for turn in dialogue["turns"]:
            gold = [s for s in gold_spans(turn) if s.type in ("preference", "taboo")]
            for start, end, _ in cue_clauses(turn["user"]):
                hit = [s.type for s in gold if s.start < end and start < s.end]
                clauses.append(turn["user"][start:end])
                labels.append(hit[0] if hit else "none")
    return clauses, labels


def score_persistence(marker: PersistenceMarker, dialogues: list[dict]) -> dict:
    """Precision and recall (overlap and exact), overall and by type."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for dialogue in annotated(dialogues, "persist"):
        turns = dialogue["turns"]
        replies = [None] + [(turn.get("assistant") or "").replace("\u2019", "'") for turn in turns[:-1]]
        marked = marker.mark_dialogue([turn["user"].replace("\u2019", "'") for turn in turns], replies)
        for turn, predicted in zip(dialogue["turns"], marked):
            gold = gold_spans(turn)
            for name, same in (("all", lambda a, b: True), ("typed", lambda a, b: a.type == b.type)):
                counts[name]["predicted"] += len(predicted)
                counts[name]["gold"] += len(gold)
                counts[name]["right"] += sum(any(p.overlaps(g) and same(p, g) for g in gold) for p in predicted)
                counts[name]["found"] += sum(any(p.overlaps(g) and same(p, g) for p in predicted) for g in gold)
                counts[name]["exact"] += sum(any(p.text == g.text and same(p, g) for p in predicted) for g in gold)
            for kind in TYPES:
                mine, theirs = [p for p in predicted if p.type == kind], [g for g in gold if g.type == kind]
                counts[kind]["predicted"] += len(mine)
                counts[kind]["gold"] += len(theirs)
                counts[kind]["right"] += sum(any(p.overlaps(g) for g in theirs) for p in mine)
                counts[kind]["found"] += sum(any(p.overlaps(g) for p in mine) for g in theirs)
                counts[kind]["exact"] += sum(any(p.text == g.text for p in mine) for g in theirs)

    def ratio(a: int, b: int) -> float | None:
        return round(a / b, 3) if b else None

    return {name: {"precision": ratio(c["right"], c["predicted"]), "recall": ratio(c["found"], c["gold"]),
                   "exact_recall": ratio(c["exact"], c["gold"]), "gold": c["gold"], "predicted": c["predicted"]}
            for name, c in counts.items()}


def train_persistence(train: list[str], evaluate: list[str], out: str | None, echo: Callable[[str], None]) -> dict:
    """Fit the clause model on `train`'s annotations, print precision and recall on `evaluate`'s next to
    the cue rules alone, and save it to `out` only: the agent loads a model from `DEFAULT_MODEL` when one
    is there, and the rules won the comparison (README), so a measurement must not replace them."""
    from classifiers.persistence import DEFAULT_MODEL

    clauses, labels = clause_examples(load_dialogues(train))
    if len(set(labels)) < 2:
        raise ValueError("the training dialogues carry no preference or taboo annotations to learn from")
    model = PreferenceModel.fit(clauses, labels)
    if out:
        model.save(Path(out))
    echo(f"clause model: {len(clauses)} cue clauses ({Counter(labels)}) -> "
         f"{out or f'not saved (--out PATH saves it; the agent reads {DEFAULT_MODEL.name} from its models folder)'}")
    held = load_dialogues(evaluate)
    report = {"model": score_persistence(PersistenceMarker(model), held),
              "rules": score_persistence(PersistenceMarker(None), held)}
    for name, scores in report.items():
        echo(f"\n{name}: span precision / recall (overlap; exact-match recall) on {len(annotated(held, 'persist'))} "
             f"annotated dialogues")
        for kind, row in scores.items():
            echo(f"  {kind:<11} P {_fmt(row['precision'])}  R {_fmt(row['recall'])}  exact R {_fmt(row['exact_recall'])}"
                 f"  (gold {row['gold']}, predicted {row['predicted']})")
    return report


# --- references -------------------------------------------------------------------------------------
def _words(name: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in STOPWORDS and len(w) > 1}


def same_entity(ours: str, gold: str) -> bool:
    a, b = _words(ours), _words(gold)
    return bool(a & b) if a and b else ours.lower().strip() == gold.lower().strip()


def score_references(dialogues: list[dict], echo: Callable[[str], None] | None = None) -> dict:
    """Resolution accuracy on annotated references, overall and by type, with antecedent-turn accuracy."""
    from memory.graph import EntityGraph

    counts: dict[str, Counter] = defaultdict(Counter)
    records = []
    for dialogue in annotated(dialogues, "refs"):
        graph = EntityGraph()
        for index, turn in enumerate(dialogue["turns"]):
            _, resolutions = graph.observe(index, turn["user"])
            for ref in turn.get("refs", []):
                start = locate(turn["user"], ref["span"])
                mine = [r for r in resolutions if start >= 0 and r.start < start + len(ref["span"]) and start < r.start + len(r.span)]
                right = bool(mine) and same_entity(mine[0].entity, ref["entity"])
                turn_right = bool(mine) and mine[0].antecedent == ref["antecedent"]
                for key in ("all", ref["type"]):
                    counts[key]["n"] += 1
                    counts[key]["right"] += right
                    counts[key]["turn"] += turn_right
                    counts[key]["resolved"] += bool(mine)
                records.append({"dialogue": dialogue.get("id"), "turn": index, "span": ref["span"], "gold": ref["entity"],
                                "ours": mine[0].entity if mine else None, "right": right})
            graph.mention(index, turn.get("assistant") or "")
    table = {key: {"references": c["n"], "accuracy": round(c["right"] / c["n"], 3),
                   "antecedent_turn_accuracy": round(c["turn"] / c["n"], 3), "resolved": round(c["resolved"] / c["n"], 3)}
             for key, c in counts.items()}
    if echo:
        echo(f"{'type':<14}{'refs':>6}{'accuracy':>10}{'antecedent':>12}{'resolved':>10}")
        for key, row in sorted(table.items(), key=lambda kv: (kv[0] != "all", kv[0])):
            echo(f"{key:<14}{row['references']:>6}{row['accuracy']:>10.3f}{row['antecedent_turn_accuracy']:>12.3f}"
                 f"{row['resolved']:>10.3f}")
    return {"by_type": table, "records": records}


def score_corrections(dialogues: list[dict], echo: Callable[[str], None] | None = None) -> dict:
    """How the entity graph's corrections (facts invalidated, not deleted) stand at each probe (module doc)."""
    from memory.graph import EntityGraph

    plain = lambda value: value.lower().replace(" ", "")  # noqa: E731
    holds = lambda facts, values: any(v in plain(f.value) for f in facts for v in values)  # noqa: E731
    tagged = found = current = probes = wrong = 0
    records = []
    for dialogue in dialogues:
        graph, done = EntityGraph(), 0
        for index, turn in enumerate(dialogue["turns"]):
            probe = turn.get("probe")
            if not probe or not probe.get("expect"):
                continue
            for earlier in range(done, index):
                graph.observe(earlier, dialogue["turns"][earlier]["user"])
                graph.mention(earlier, dialogue["turns"][earlier].get("assistant") or "")
            done = index
            expect, forbid = [plain(v) for v in probe["expect"]], [plain(v) for v in probe.get("forbid", [])]
            live, stale = graph.current_facts(), graph.superseded()
            probes += 1
            wrong += holds(stale, expect) and not holds(live, expect)
            if "superseded" in probe.get("tags", []):
                record = {"dialogue": dialogue.get("id"), "turn": index, "forbid": probe.get("forbid", []),
                          "expect": probe["expect"], "invalidated": holds(stale, forbid), "current": holds(live, expect)}
                tagged += 1
                found += record["invalidated"]
                current += record["current"]
                records.append(record)
    table = {"superseded_probes": tagged, "old_value_invalidated": round(found / tagged, 3) if tagged else None,
             "new_value_current": round(current / tagged, 3) if tagged else None, "probes": probes,
             "expected_value_invalidated": round(wrong / probes, 3) if probes else None}
    if echo and tagged:
        echo(f"corrections: {tagged} superseded-tagged probes, the old value invalidated {found / tagged:.3f}, the new "
             f"one current {current / tagged:.3f}; of {probes} probes, an expected value wrongly invalidated {wrong}")
    return {**table, "records": records}


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"
