"""`palace bench --parts c`: the memory palace's work per turn, by step, over a scripted dialogue, against
the same dialogue run by the hybrid without memory in the same process (the baseline).

The dialogue is the first of `data/dialogues.jsonl` (the generator's, never the held-out set), or the
first of `--memory-dialogue PATH` (e.g. a hand-written one of `data/dev/`, whose longer messages cost
more to embed and fill a larger budget), or the first `--memory-count N` of the file, fed by teacher
forcing through the Agent's own steps at a quarter of its full length as the budget, like
`palace eval --budget 25%`.

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


def scripted_turns(path: Path, limit: int | None, count: int = 1) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """The first `count` dialogues of `path`: each one's id, system prompt and (user, reply) pairs. DialogueError
    (one line) if the file is not a dialogue file, holds fewer dialogues, or a turn has no scripted reply to
    teacher-force."""
    from agent.eval.dialogue import DialogueError, load_dialogues

    dialogues = load_dialogues([path])
    if len(dialogues) < count:
        raise DialogueError(f"{path}: {len(dialogues)} dialogues in it, {count} wanted" if dialogues else f"{path}: no dialogue in it")
    scripted = []
    for dialogue in dialogues[:count]:
        turns = dialogue.turns[:limit] if limit else dialogue.turns
        missing = [k for k, turn in enumerate(turns) if turn.assistant is None]
        if missing:
            raise DialogueError(f"{path}: dialogue {dialogue.id}: turn {missing[0]} has no assistant reply to feed")
        scripted.append((dialogue.id, dialogue.system, [(turn.user, turn.assistant) for turn in turns]))
    return scripted


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))} if values else {}


def part_c(loaded, turns_limit: int | None, log: Callable[[str], None], path: Path = DEFAULT_DIALOGUE,
           dialogues: int = 1) -> dict:
    """Both runs over the first `dialogues` dialogues of `path`, alternated (hybrid, palace, hybrid, ...) so that
    a machine slowing down slows both, each dialogue at a quarter of its own length as the budget; percentiles
    over every dialogue's turns (one dialogue's p95 is its third-slowest turn of 50, which moves by 10 ms from
    run to run on a shared 2-core machine). Distinct dialogues, not one dialogue again: a second pass would
    find its texts' analyses in the process's caches; the embedder's text cache is emptied before each."""
    from agent.agent import AgentConfig
    from agent.chat_format import ChatFormat
    from cache.storage import StorageConfig
    from memory.embedder import shared_embedder
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    fmt = ChatFormat.from_tokenizer(loaded.tokenizer)
    kv = str(loaded.dtype).removeprefix("torch.")  # the KV in the model's dtype, as `palace eval --kv-dtype auto`
    arms = {"hybrid": {}, "hybrid+palace": dict(memory=MemoryConfig(), topics=True, graph=True, profile=ProfileConfig())}
    samples = {name: {"ttft": [], "totals": [], "steps": {step: [] for step in STEPS}} for name in arms}
    scripted, budgets, fulls = scripted_turns(path, turns_limit, dialogues), [], []
    for _, system, turns in scripted:
        fulls.append(len(fmt.system_prompt(system)) + sum(len(fmt.user_message(u)) + len(fmt.assistant_reply(a)) +
                                                          len(fmt.next_user_header()) for u, a in turns))
        budgets.append(max(64, fulls[-1] // 4))
        shared_embedder().forget_texts()  # the generator's dialogues share replies: each dialogue embeds its own
        for name, extra in arms.items():
            config = AgentConfig(policy="hybrid", budget_tokens=budgets[-1], system=system, storage=StorageConfig(kv), **extra)
            _one_pass(loaded, config, turns, samples[name])
    runs = {}
    for name, taken in samples.items():
        steps, totals = taken["steps"], taken["totals"]
        runs[name] = {"samples": len(taken["ttft"]), "ttft_ms": percentiles(taken["ttft"]), "memory_ms": percentiles(totals),
                      "on_clock_ms": percentiles([sum(steps[s][i] for s in ON_CLOCK) for i in range(len(totals))]),
                      "steps": {step: percentiles(values) for step, values in steps.items() if values}}
        log(f"  {name}: {len(taken['ttft'])} turns at budgets of {min(budgets)}-{max(budgets)} tokens")
    base, palace = runs["hybrid"]["ttft_ms"], runs["hybrid+palace"]["ttft_ms"]
    where = Path(path).resolve()
    ids = scripted[0][0] if len(scripted) == 1 else f"{scripted[0][0]}..{scripted[-1][0]}"
    return {"dialogue": f"{where.relative_to(ROOT) if where.is_relative_to(ROOT) else where} {ids}",
            "dialogues": len(scripted), "turns": len(scripted[0][2]), "budget_tokens": budgets[0], "full_tokens": fulls[0],
            "budgets": budgets, "dtype": kv, "embedder": shared_embedder().mode, "runs": runs,
            "ttft_p95_vs_hybrid": palace["p95"] / base["p95"], "ttft_p50_vs_hybrid": palace["p50"] / base["p50"]}


def _one_pass(loaded, config, turns: list[tuple[str, str]], samples: dict) -> None:
    """The dialogue once through a fresh agent, teacher-forced, adding each turn's timings to `samples`."""
    from agent.agent import Agent

    agent = Agent(loaded, config)
    try:
        for user, reply in turns:
            started = time.perf_counter()
            turn = agent.observe(user)
            agent.recall(turn)
            agent.prefill(turn)
            samples["ttft"].append((time.perf_counter() - started) * 1000)
            agent.remember(turn, reply)
            if agent.memory is not None:
                for step in STEPS:
                    samples["steps"][step].append(agent.memory.steps.get(step, 0.0))
                samples["totals"].append(agent.memory.last_ms)
    finally:
        agent.close()


def render_part_c(result: dict) -> list[str]:
    palace = result["runs"]["hybrid+palace"]
    hybrid = result["runs"]["hybrid"]
    head = (f"{result['turns']} turns of {result['dialogue']} at a {result['budget_tokens']}-token budget "
            f"(25 % of {result['full_tokens']})" if result["dialogues"] == 1 else
            f"{result['dialogues']} dialogues of {result['turns']} turns, {result['dialogue']}, each at 25 % of its "
            f"length ({min(result['budgets'])}-{max(result['budgets'])} tokens)")
    lines = [f"{head}, model and KV in {result['dtype']}, embedder {result['embedder']}",
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
