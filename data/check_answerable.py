"""Check that scripted probes are fair: answerable with the evidence, a coin toss without it.

For each probe, the history is the teacher-forced dialogue in the model's chat template
(system + earlier turns with their reference replies + the probe's user message +
`<|im_start|>assistant\\n`), and each choice is scored by the total log-probability of its
tokens followed by `<|im_end|>`, as in the harness's choice scoring. This runs twice: with
the full history, and with the probe's evidence turns removed. Untagged probes should be
mostly right with the full history and near chance (1 / number of choices) without the
evidence; much better than chance without it means the distractors can be told apart without
the evidence, which is a bug in the data, not a property of any cache.

    python data/check_answerable.py data/dialogues.jsonl --dialogues 10
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from agent.eval.dialogue import Dialogue, load_dialogues  # noqa: E402
from agent.model import convert_embedded  # noqa: E402


class Prefix:
    """A token prefix and its KV cache, extended incrementally (a dialogue is prefilled once)."""

    def __init__(self, model, cache=None, last=None):
        self.model, self.cache, self.last = model, cache, last

    def extend(self, ids: list[int]) -> None:
        if ids:
            out = self.model(torch.tensor([ids]), cache=self.cache, use_cache=True)
            self.cache, self.last = out.past_key_values, out.logits[0, -1:]

    def copy(self) -> "Prefix":
        return Prefix(self.model, copy.deepcopy(self.cache), self.last)

    def choice_scores(self, choices: list[list[int]]) -> list[float]:
        """Total log-prob of each choice's tokens as the continuation; leaves the cache as it was."""
        scores = []
        for ids in choices:
            logits = torch.cat([self.last, self.model(torch.tensor([ids]), cache=self.cache, use_cache=True).logits[0, :-1]])
            scores.append(logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).sum().item())
            self.cache.crop(-len(ids))
        return scores


def segments(tok, d: Dialogue) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Token ids of the system message and of each turn's user and assistant messages in the
    SmolLM2 chat template, which renders every message on its own (main() checks this)."""
    def msg(role: str, content: str) -> list[int]:
        return tok(f"<|im_start|>{role}\n{content}<|im_end|>\n", add_special_tokens=False).input_ids
    system = msg("system", d.system) if d.system else []
    return system, [(msg("user", t.user), msg("assistant", t.assistant or "")) for t in d.turns]


@torch.no_grad()
def check_dialogue(model, tok, d: Dialogue) -> list[tuple[int, str, bool]]:
    """(turn, condition, correct) for every probe, with full history and without the evidence."""
    system, turns = segments(tok, d)
    gen = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    probes = [(i, t.probe) for i, t in enumerate(d.turns) if t.probe]
    first_evidence = {min(p.evidence) for _, p in probes if p.evidence}
    full, snapshots, results = Prefix(model), {}, []
    full.extend(system)
    for i, (user, assistant) in enumerate(turns):
        if i in first_evidence:
            snapshots[i] = full.copy()
        full.extend(user + gen)
        if (p := d.turns[i].probe):
            choices = [tok(c + "<|im_end|>", add_special_tokens=False).input_ids for c in p.choices]
            results.append((i, "full", _best(full.choice_scores(choices)) == p.answer))
            if p.evidence:
                blind = snapshots[min(p.evidence)].copy()
                blind.extend([x for j in range(min(p.evidence), i) if j not in p.evidence for x in sum(turns[j], [])])
                blind.extend(user + gen)
                results.append((i, "no-evidence", _best(blind.choice_scores(choices)) == p.answer))
        assert assistant[: len(gen)] == gen
        full.extend(assistant[len(gen):])
    return results


def _best(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded model's converted copy)")
    ap.add_argument("--dialogues", type=int, default=10, help="how many dialogues to check")
    args = ap.parse_args()
    path = args.model or convert_embedded()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    right = defaultdict(lambda: [0, 0])  # (condition, group) -> [correct, total]
    for d in load_dialogues(args.paths)[: args.dialogues]:
        system, turns = segments(tok, d)
        messages = [{"role": "system", "content": d.system}] if d.system else []
        for t in d.turns:
            messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.assistant or ""}]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert system + sum((u + a for u, a in turns), []) == tok(rendered, add_special_tokens=False).input_ids
        for i, condition, ok in check_dialogue(model, tok, d):
            p = d.turns[i].probe
            group = ",".join(p.tags) or "untagged"
            for key in (group, f"{group}/{p.kind}"):
                right[condition, key][0] += ok
                right[condition, key][1] += 1
            print(f"{d.id} turn {i:2} {p.kind:12} {group:10} {condition:11} {'ok' if ok else 'WRONG'}", flush=True)
    for (condition, key), (ok, n) in sorted(right.items()):
        print(f"{condition:11} {key:24} {ok}/{n} = {ok / n:.2f}")


if __name__ == "__main__":
    main()
