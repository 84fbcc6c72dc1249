"""Check that two dialogue files differ only in their `topic` labels, and print topic statistics.

    python data/diff_topics.py OLD.jsonl NEW.jsonl

Used when the generator's topic labels were made finer: the regenerated file must hold the same
dialogues byte for byte apart from the label values, so every eval figure measured on it stands.
"""

import json
import re
import statistics
import sys


def stats(dialogues: list[dict]) -> str:
    topics, boundaries, returns = [], [], []
    for d in dialogues:
        labels = [t["topic"] for t in d["turns"]]
        b = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
        topics.append(len(set(labels)))
        boundaries.append(len(b))
        returns.append(sum(labels[i] in labels[:i] for i in b))
    f = lambda x: f"min {min(x)} mean {statistics.mean(x):.1f} max {max(x)}"  # noqa: E731
    return f"topics {f(topics)}; boundaries {f(boundaries)}; returns {f(returns)}"


def main() -> None:
    old_text, new_text = (open(p, encoding="utf-8").read() for p in sys.argv[1:3])
    label = re.compile(r'"topic": "[^"]*"')
    same = label.sub("T", old_text) == label.sub("T", new_text)
    print("byte-identical apart from the topic values:", same)
    old, new = ([json.loads(line) for line in text.splitlines() if line.strip()] for text in (old_text, new_text))
    changed = sum(x.get("topic") != y.get("topic") for a, b in zip(old, new) for x, y in zip(a["turns"], b["turns"]))
    print(f"turn labels changed: {changed}")
    print("old:", stats(old))
    print("new:", stats(new))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
