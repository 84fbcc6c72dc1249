"""Lint hand-written dialogues: the rules of `docs/dialogue-format.md` that a loader cannot see.

    python data/lint_dialogues.py data/heldout/*.jsonl

Checks, per dialogue: 50 turns with a reference reply and a topic label each; topic granularity
(12-20 topics, 20-35 boundaries, some returns); 8-10 probes of every kind, at least a third with
their newest evidence 20 or more turns back; each probe's choices parallel (one common prefix and
suffix, the middle is the value); an untagged probe's distractor values nowhere in the dialogue and
its answer value in an evidence turn and in no other turn since the first evidence turn; a
`confusable` probe with a distractor that does occur; a `superseded` probe whose forbidden old value
occurs; the probe turn's reply equal to the answer; `persist` and `refs` spans present in the turn's
text, refs pointing back to a turn that names the entity. Token counts of the choices (SmolLM2
tokenizer) are printed where they differ by more than 2. Exit code 1 when any error is found.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent.eval.dialogue import Dialogue, load_dialogues  # noqa: E402

PERSIST_TYPES = ("identity", "contact", "address", "amount", "date", "preference", "taboo")
REF_TYPES = ("pronoun", "demonstrative", "definite", "relational")


def values(choices: list[str]) -> list[str]:
    """The differing middle of parallel choices: the common word prefix and suffix removed."""
    words = [choice.split() for choice in choices]
    shortest = min(map(len, words))
    head = 0
    while head < shortest and len({w[head] for w in words}) == 1:
        head += 1
    tail = 0
    while tail < shortest - head and len({w[-1 - tail] for w in words}) == 1:
        tail += 1
    return [" ".join(w[head : len(w) - tail]).strip(" .,!?;:") for w in words]


def occurs(value: str, text: str) -> bool:
    return bool(value) and value.lower() in text.lower()


def turn_text(dialogue: Dialogue, i: int) -> str:
    turn = dialogue.turns[i]
    return f"{turn.user}\n{turn.assistant or ''}"


def lint(dialogue: Dialogue, raw: dict, tokenizer) -> tuple[list[str], list[str]]:
    """(errors, notes) for one dialogue."""
    errors, notes = [], []
    turns = dialogue.turns
    n = len(turns)
    if n != 50:
        errors.append(f"{n} turns, not 50")
    labels = [t.topic for t in turns]
    for i, t in enumerate(turns):
        if not t.assistant:
            errors.append(f"turn {i}: no reference assistant reply")
        if not t.topic:
            errors.append(f"turn {i}: no topic label")
    boundaries = sum(labels[i] != labels[i - 1] for i in range(1, n))
    seen, returns = set(), 0
    for i, label in enumerate(labels):
        if i and label != labels[i - 1] and label in seen:
            returns += 1
        seen.add(label)
    if not 12 <= len(seen) <= 20:
        errors.append(f"{len(seen)} topics (want 12-20)")
    if not 20 <= boundaries <= 35:
        errors.append(f"{boundaries} boundaries (want 20-35)")
    if returns < 3:
        errors.append(f"{returns} returns to an earlier topic (want at least 3)")

    everything = "\n".join([dialogue.system or ""] + [turn_text(dialogue, i) for i in range(n)])
    probes = [(i, t.probe) for i, t in enumerate(turns) if t.probe]
    if not 8 <= len(probes) <= 10:
        errors.append(f"{len(probes)} probes (want 8-10)")
    kinds = {p.kind for _, p in probes}
    missing = {"recall", "coreference", "preference", "topic-return", "summary"} - kinds
    if missing:
        errors.append(f"no probe of kind {', '.join(sorted(missing))}")
    far = sum(1 for i, p in probes if p.evidence and i - max(p.evidence) >= 20)
    if far * 3 < len(probes):
        errors.append(f"only {far} of {len(probes)} probes have evidence 20+ turns back (want a third)")
    for i, p in probes:
        where = f"turn {i} ({p.kind})"
        vals = values(p.choices)
        answer = vals[p.answer]
        distractors = [v for k, v in enumerate(vals) if k != p.answer]
        if not all(vals) or len(set(v.lower() for v in vals)) != len(vals):
            errors.append(f"{where}: choices are not parallel with distinct values: {vals}")
            continue
        if turns[i].assistant != p.choices[p.answer]:
            errors.append(f"{where}: the reply is not the answer choice")
        if not p.evidence:
            errors.append(f"{where}: no evidence turns")
            continue
        tags = set(p.tags)
        if p.kind != "summary" and not any(occurs(answer, turn_text(dialogue, e)) for e in p.evidence):
            errors.append(f"{where}: answer value {answer!r} is in no evidence turn")
        if not tags and p.kind != "summary":
            stray = [j for j in range(min(p.evidence), i) if j not in p.evidence and occurs(answer, turn_text(dialogue, j))]
            if stray:
                errors.append(f"{where}: answer value {answer!r} also in non-evidence turns {stray}")
        for value in distractors:
            if not tags and occurs(value, everything):
                errors.append(f"{where}: untagged distractor value {value!r} occurs in the dialogue")
        if "confusable" in tags and not any(occurs(v, everything) for v in distractors):
            errors.append(f"{where}: tagged confusable but no distractor value occurs in the dialogue")
        if "superseded" in tags and not any(occurs(f, everything) for f in p.forbid):
            errors.append(f"{where}: tagged superseded but no forbidden (old) value occurs in the dialogue")
        for tag in tags - {"confusable", "superseded"}:
            notes.append(f"{where}: unknown tag {tag!r}")
        if tokenizer is not None:
            counts = [len(tokenizer(c, add_special_tokens=False).input_ids) for c in p.choices]
            if max(counts) - min(counts) > 2:
                notes.append(f"{where}: choice token counts {counts} (answer {counts[p.answer]})")

    for i, t in enumerate(raw["turns"]):
        for span in t.get("persist", []):
            if span.get("type") not in PERSIST_TYPES:
                errors.append(f"turn {i}: persist type {span.get('type')!r} not one of {', '.join(PERSIST_TYPES)}")
            if span.get("span", "") not in t["user"] or not span.get("span"):
                errors.append(f"turn {i}: persist span {span.get('span')!r} is not in the user text")
        for ref in t.get("refs", []):
            if ref.get("type") not in REF_TYPES:
                errors.append(f"turn {i}: ref type {ref.get('type')!r} not one of {', '.join(REF_TYPES)}")
            if not ref.get("span") or ref["span"] not in t["user"]:
                errors.append(f"turn {i}: ref span {ref.get('span')!r} is not in the user text")
            k = ref.get("antecedent")
            if not isinstance(k, int) or not 0 <= k < i:
                errors.append(f"turn {i}: ref antecedent {k!r} is not an earlier turn")
            elif not occurs(ref.get("entity", ""), turn_text(dialogue, k)):
                errors.append(f"turn {i}: ref entity {ref.get('entity')!r} is not named in turn {k}")
    refs = sum(len(t.get("refs", [])) for t in raw["turns"])
    persists = sum(len(t.get("persist", [])) for t in raw["turns"])
    notes.append(f"{len(seen)} topics, {boundaries} boundaries, {returns} returns; {len(probes)} probes "
                 f"({far} with evidence 20+ back); {persists} persist spans, {refs} refs")
    return errors, notes


def main() -> None:
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the token counts")
    args = parser.parse_args()
    tokenizer = None
    if not args.no_tokenizer:
        from transformers import AutoTokenizer

        from agent.model import convert_embedded

        tokenizer = AutoTokenizer.from_pretrained(convert_embedded())
    failed = False
    for path in args.paths:
        raws = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        for dialogue, raw in zip(load_dialogues([path]), raws):
            errors, notes = lint(dialogue, raw, tokenizer)
            failed |= bool(errors)
            print(f"{path}: {dialogue.id}: {'FAIL' if errors else 'ok'}")
            for line in errors:
                print(f"  error: {line}")
            for line in notes:
                print(f"  note: {line}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
