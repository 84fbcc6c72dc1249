"""`palace bench --parts c`: the memory palace's work per turn, by step, over a scripted dialogue, against
the same dialogue run by the hybrid without memory in the same process (the baseline).

The dialogue is the first of `data/dialogues.jsonl` (the generator's, never the held-out set), or the
first of `--memory-dialogue PATH` (e.g. a hand-written one of `data/dev/`, whose longer messages cost
more to embed and fill a larger budget), fed by teacher forcing through the Agent's own steps at a
quarter of its full length as the budget, like `palace eval --budget 25%`.

Steps (LongTermMemory.steps): on the turn's clock `embed` (the user's words), `topics` (the topic
classifier's decision), `graph` (facts, references), `search` (FAISS and the archive's metadata),
`splice` (re-injecting KV, with the eviction that makes room); after the reply `embed_reply` (the reply,
for its topic and its archived stretches), `graph_reply` (the reply's mentions and corrections, the running
summary), `forget` (dropping the live tokens of values a correction superseded), `archive` (what the turn evicted) and `notes` (rendering the profile and, when it changed, dropping its
old KV; the new notes' forward is part of the reply's feed)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ON_CLOCK = ("embed", "topics", "graph", "search", "splice")
STEPS = (*ON_CLOCK, "embed_reply", "graph_reply", "forget", "archive", "notes")


DEFAULT_DIALOGUE = ROOT / "data" / "dialogues.jsonl"


def scripted_turns(path: Path, limit: int | None) -> tuple[str, str | None, list[tuple[str, str]]]:
    """The first dialogue of `path`: its id, system prompt and (user, reply) pairs. DialogueError (one
    line) if the file is not a dialogue file or a turn has no scripted reply to teacher-force."""
    from agent.eval.dialogue import DialogueError, load_dialogues

    dialogues = load_dialogues([path])
    if not dialogues:
        raise DialogueError(f"{path}: no dialogue in it")
    dialogue = dialogues[0]
    turns = dialogue.turns[:limit] if limit else dialogue.turns
    missing = [k for k, turn in enumerate(turns) if turn.assistant is None]
    if missing:
        raise DialogueError(f"{path}: dialogue {dialogue.id}: turn {missing[0]} has no assistant reply to feed")
    return dialogue.id, dialogue.system, [(turn.user, turn.assistant) for turn in turns]


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))} if values else {}


def part_c(loaded, turns_limit: int | None, log: Callable[[str], None], path: Path = DEFAULT_DIALOGUE) -> dict:
    from agent.agent import Agent, AgentConfig
    from agent.chat_format import ChatFormat
    from cache.storage import StorageConfig
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    dialogue, system, turns = scripted_turns(path, turns_limit)
    fmt = ChatFormat.from_tokenizer(loaded.tokenizer)
    full = len(fmt.system_prompt(system)) + sum(len(fmt.user_message(u)) + len(fmt.assistant_reply(a)) +
                                                 len(fmt.next_user_header()) for u, a in turns)
    budget = max(64, full // 4)
    kv = str(loaded.dtype).removeprefix("torch.")  # the KV in the model's dtype, as `palace eval --kv-dtype auto`
    runs = {}
    for name, extra in (("hybrid", {}), ("hybrid+palace", dict(memory=MemoryConfig(), topics=True, graph=True,
                                                                profile=ProfileConfig()))):
        agent = Agent(loaded, AgentConfig(policy="hybrid", budget_tokens=budget, system=system,
                                          storage=StorageConfig(kv), **extra))
        ttft, steps, totals = [], {step: [] for step in STEPS}, []
        for user, reply in turns:
            started = time.perf_counter()
            turn = agent.observe(user)
            agent.recall(turn)
            agent.prefill(turn)
            ttft.append((time.perf_counter() - started) * 1000)
            agent.remember(turn, reply)
            if agent.memory is not None:
                for step in STEPS:
                    steps[step].append(agent.memory.steps.get(step, 0.0))
                totals.append(agent.memory.last_ms)
        runs[name] = {"ttft_ms": percentiles(ttft), "memory_ms": percentiles(totals),
                      "on_clock_ms": percentiles([sum(steps[s][i] for s in ON_CLOCK) for i in range(len(totals))]),
                      "steps": {step: percentiles(values) for step, values in steps.items() if values}}
        log(f"  {name}: {len(turns)} turns at a {budget}-token budget")
    base, palace = runs["hybrid"]["ttft_ms"], runs["hybrid+palace"]["ttft_ms"]
    where = Path(path).resolve()
    return {"dialogue": f"{where.relative_to(ROOT) if where.is_relative_to(ROOT) else where} {dialogue}",
            "turns": len(turns), "budget_tokens": budget, "full_tokens": full, "dtype": kv, "runs": runs,
            "ttft_p95_vs_hybrid": palace["p95"] / base["p95"], "ttft_p50_vs_hybrid": palace["p50"] / base["p50"]}


def render_part_c(result: dict) -> list[str]:
    palace = result["runs"]["hybrid+palace"]
    hybrid = result["runs"]["hybrid"]
    lines = [f"{result['turns']} turns of {result['dialogue']} at a {result['budget_tokens']}-token budget "
             f"(25 % of {result['full_tokens']}), model and KV in {result['dtype']}",
             f"  {'step':30} {'p50 ms':>8} {'p95 ms':>8}"]
    for step, row in palace["steps"].items():
        lines.append(f"  {step + (' (on the clock)' if step in ON_CLOCK else ' (after the reply)'):30} "
                     f"{row['p50']:>8.1f} {row['p95']:>8.1f}")
    lines.append(f"  {'on the clock':30} {palace['on_clock_ms']['p50']:>8.1f} {palace['on_clock_ms']['p95']:>8.1f}")
    lines.append(f"  {'all memory work':30} {palace['memory_ms']['p50']:>8.1f} {palace['memory_ms']['p95']:>8.1f}"
                 f"   (target: under 30 ms p95)")
    lines.append(f"  time to first token: hybrid p50 {hybrid['ttft_ms']['p50']:.0f} / p95 {hybrid['ttft_ms']['p95']:.0f} ms, "
                 f"hybrid+palace {palace['ttft_ms']['p50']:.0f} / {palace['ttft_ms']['p95']:.0f} ms "
                 f"({result['ttft_p50_vs_hybrid']:.2f}x / {result['ttft_p95_vs_hybrid']:.2f}x)")
    return lines
