"""The evaluation harness: runs scripted dialogues (teacher forcing) under each cache policy, in one
process over one loaded model, and measures what a policy costs (KV bytes, time to first token, decode
speed) against what it forgets (probe accuracy, evidence retention).

Every policy sees the same history: after each turn the dialogue continues with the scripted assistant
reply, whatever the model would have said. The policies run in lockstep, turn by turn. A turn without a
probe needs no answer, so each policy's whole turn (user message, reference reply, next header) is one
feed, and the feeds of all policies share one packed forward (each against its own cache): the weights
are read once per turn instead of twice per policy. At a probe turn every policy works alone: it
prefills the user's message (timed: its time to first token), scores the choices, and only then are the
reference replies fed, packed again. Time to first token is therefore measured at probe turns, for every
policy alike; the `reprefill` baseline, which keeps no cache and re-encodes the whole history, only
encodes there. A policy's wall time is its own work plus its token share of the packed forwards."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from agent.chat_format import ChatFormat
from agent.engine import Feed, prefill_packed
from agent.eval.dialogue import Dialogue, Probe, ScriptedTurn
from agent.eval.results import EvalResult, PolicyRun, ProbeRecord, TurnSample, merge_runs
from agent.eval.runners import BASELINE, KINDS, Runner, make_runner
from agent.model import LoadedModel
from agent.scoring import score_together
from cache.policies import POLICIES, Budget
from cache.storage import KV_DTYPES
from memory.profile import ProfileConfig
from memory.recall import MemoryConfig

EVAL_POLICIES = (*POLICIES, *(name + kind for kind in KINDS[1:] for name in POLICIES if name != "full"), BASELINE)
MODES = ("choice", "generate")


@dataclass
class EvalConfig:
    policies: list[str]
    budget: Budget
    kv_dtype: str = "auto"  # auto: the model's dtype
    mode: str = "choice"
    map_dialogue: str | None = None  # residency map for this dialogue (default: the first)
    reply_tokens: int = 48  # generate mode: longest free reply
    decode_sample_tokens: int = 4  # choice mode: tokens decoded at each dialogue's last probe to time decode
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # of the "<policy>+memory" runs
    notes: ProfileConfig = field(default_factory=ProfileConfig)  # of the runs with notes (+notes, +palace)

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("--policy needs at least one policy")
        for name in self.policies:
            if name not in EVAL_POLICIES:
                raise ValueError(f"unknown policy {name!r}: choose from {', '.join(EVAL_POLICIES)}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policy lists a policy twice: {','.join(self.policies)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.kv_dtype not in (*KV_DTYPES, "auto"):
            raise ValueError(f"unknown --kv-dtype {self.kv_dtype!r}: choose from auto, {', '.join(KV_DTYPES)}")


# --- token layout: what the full cache would hold, per turn ---------------------------------------------
def turn_tokens(dialogue: Dialogue, fmt: ChatFormat) -> Counter[int]:
    """Tokens the agent feeds per turn index, as tagged in the store's metadata: the system prompt and
    first user header are turn -1; turn t holds its user message, its reply and the next user header."""
    counts: Counter[int] = Counter({-1: len(fmt.system_prompt(dialogue.system))})
    header = len(fmt.next_user_header())
    for t, turn in enumerate(dialogue.turns):
        reply = len(fmt.assistant_reply(turn.assistant)) if turn.assistant is not None else 0
        counts[t] = len(fmt.user_message(turn.user)) + reply + header
    return counts


def full_cache_tokens(dialogue: Dialogue, fmt: ChatFormat) -> int:
    """What the full cache holds at the end of the dialogue."""
    return sum(turn_tokens(dialogue, fmt).values())


# --- the run --------------------------------------------------------------------------------------------
def reply_is_correct(reply: str, probe: Probe) -> bool:
    """Generate mode: some `expect` string (when any are given) and no `forbid` string, case-insensitive."""
    reply = reply.lower()
    expected = not probe.expect or any(e.lower() in reply for e in probe.expect)
    return expected and not any(f.lower() in reply for f in probe.forbid)


@dataclass
class Lane:
    """One policy's runner and the run it fills, as the dialogues go by in lockstep."""

    runner: Runner
    run: PolicyRun

    def timed(self, work, *args):
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            self.run.wall_s += time.perf_counter() - started


def feed_together(model: torch.nn.Module, lanes: list[Lane], feeds: list[list[Feed]]) -> None:
    """Prefill every lane's feeds in shared packed forwards; each lane is charged its token share. Then
    each lane settles (archives what the feeds evicted), on its own clock."""
    flat = [feed for lane_feeds in feeds for feed in lane_feeds]
    total = sum(len(feed.ids) for feed in flat)
    if not total:
        return
    started = time.perf_counter()
    prefill_packed(model, flat)
    elapsed = time.perf_counter() - started
    for lane, lane_feeds in zip(lanes, feeds):
        lane.run.wall_s += elapsed * sum(len(feed.ids) for feed in lane_feeds) / total
    for lane in lanes:
        lane.timed(lane.runner.settle)


def score_lanes(model: torch.nn.Module, fmt: ChatFormat, lanes: list[Lane], choices: list[str]) -> list[list[float]]:
    """Every lane's choice scores: those with a scoring store in one packed forward (each charged an
    equal share), the others on their own."""
    stores = {id(lane): lane.runner.scoring_store() for lane in lanes}
    shared = [lane for lane in lanes if stores[id(lane)] is not None]
    started = time.perf_counter()
    together = iter(score_together(model, fmt, [stores[id(lane)] for lane in shared], choices) if shared else [])
    for lane in shared:
        lane.run.wall_s += (time.perf_counter() - started) / len(shared)
    return [next(together) if stores[id(lane)] is not None else lane.timed(lane.runner.score, choices)
            for lane in lanes]


def probe_turn(lanes: list[Lane], model: torch.nn.Module, turn: ScriptedTurn, t: int, last_probe: int,
               fed: Counter[int], fmt: ChatFormat, config: EvalConfig, dialogue_id: str) -> None:
    """A probe: each policy prefills the user's message alone (timed: its time to first token); then the
    choices are scored (packed) or each policy drafts a reply alone; the reference replies follow."""
    probe = turn.probe
    retention, recalled = {}, {}
    for lane in lanes:
        runner, run = lane.runner, lane.run
        ttft = lane.timed(runner.user_turn, turn.user)
        run.turns.append(TurnSample(run.policy, dialogue_id, t, runner.kv_tokens(), runner.kv_bytes(), ttft))
        recalled[id(lane)] = (runner.memory() or ([], 0.0))[0]
        run.kv_bytes_peak = max(run.kv_bytes_peak, runner.kv_bytes())
        if probe.evidence:
            present = runner.resident()
            retention[id(lane)] = sum(present[e] for e in probe.evidence) / sum(fed[e] for e in probe.evidence)
    scores = score_lanes(model, fmt, lanes, probe.choices) if config.mode == "choice" else [None] * len(lanes)
    distance = t - max(probe.evidence) if probe.evidence else None
    for lane, score in zip(lanes, scores):
        chosen = margin = None
        if config.mode == "generate":
            ids, seconds = lane.timed(lane.runner.draft, config.reply_tokens)
            correct = reply_is_correct(fmt.decode(ids), probe)
        else:
            chosen = int(np.argmax(score))
            correct = chosen == probe.answer
            margin = score[probe.answer] - max(s for k, s in enumerate(score) if k != probe.answer)
            ids, seconds = lane.timed(lane.runner.draft, config.decode_sample_tokens) if t == last_probe else ([], 0.0)
        lane.run.decode_tokens += len(ids)
        lane.run.decode_s += seconds
        lane.run.probes.append(ProbeRecord(lane.run.policy, dialogue_id, t, probe.kind, probe.tags, correct, chosen,
                                           probe.answer, margin, probe.evidence, distance, retention.get(id(lane)),
                                           recalled[id(lane)]))
    feed_together(model, lanes, [lane.timed(lane.runner.reply, turn.assistant) for lane in lanes])
    for lane in lanes:
        note_memory(lane.run.turns[-1], lane.runner)


def note_memory(sample: TurnSample, runner: Runner) -> None:
    """A memory run's turn: tokens re-injected and memory milliseconds (recall plus archiving)."""
    memory = runner.memory()
    if memory is not None:
        recalled, ms = memory
        sample.reinjected, sample.memory_ms = sum(r["tokens"] for r in recalled), ms


def run_dialogue(lanes: list[Lane], model: torch.nn.Module, dialogue: Dialogue, fmt: ChatFormat,
                 config: EvalConfig, mapped: bool) -> None:
    """Feed one dialogue turn by turn to every lane, scoring probes with the cache as each policy left it."""
    fed = turn_tokens(dialogue, fmt)
    last_probe = max((t for t, turn in enumerate(dialogue.turns) if turn.probe), default=-1)
    n = len(dialogue.turns)
    residency = [np.full((n, n), np.nan) for _ in lanes] if mapped else None
    for lane in lanes:
        lane.timed(lane.runner.start, dialogue.system)
    for t, turn in enumerate(dialogue.turns):
        if turn.probe is None:
            feeds = [lane.timed(lane.runner.scripted_turn, turn.user, turn.assistant) for lane in lanes]
            feed_together(model, lanes, feeds)
            for lane in lanes:
                runner = lane.runner
                lane.run.turns.append(TurnSample(lane.run.policy, dialogue.id, t, runner.kv_tokens(), runner.kv_bytes(), None))
                note_memory(lane.run.turns[-1], runner)
        else:
            probe_turn(lanes, model, turn, t, last_probe, fed, fmt, config, dialogue.id)
        for k, lane in enumerate(lanes):
            lane.run.kv_bytes_peak = max(lane.run.kv_bytes_peak, lane.runner.kv_bytes())
            if residency is not None:
                present = lane.runner.resident()
                residency[k][t, : t + 1] = [present[y] / fed[y] for y in range(t + 1)]
    if residency is not None:
        for lane, grid in zip(lanes, residency):
            lane.run.residency = grid


def run_policies(loaded: LoadedModel, dialogues: list[Dialogue], config: EvalConfig, budget_tokens: int,
                 map_id: str, on_dialogue: Callable[[], None] | None = None) -> list[PolicyRun]:
    """Every requested policy over these dialogues, in lockstep, in this process."""
    fmt = ChatFormat.from_tokenizer(loaded.tokenizer)
    model_dtype = str(loaded.dtype).removeprefix("torch.")
    lanes = []
    for policy in config.policies:
        budget = None if policy in ("full", BASELINE) else budget_tokens  # both unbounded
        kv_dtype = model_dtype if policy == BASELINE or config.kv_dtype == "auto" else config.kv_dtype
        runner = make_runner(policy, budget, kv_dtype, loaded, config.memory, config.notes)
        lanes.append(Lane(runner, PolicyRun(policy, budget, kv_dtype, config.mode)))
    try:
        for dialogue in dialogues:
            run_dialogue(lanes, loaded.model, dialogue, fmt, config, mapped=dialogue.id == map_id)
            if on_dialogue is not None:
                on_dialogue()
    finally:
        for lane in lanes:
            lane.runner.close()
    return [lane.run for lane in lanes]


class Pool(Protocol):
    """Runs `run_policies` over dialogues in other processes (agent/eval/workers.py)."""

    def run(self, dialogues: list[Dialogue], config: EvalConfig, budget_tokens: int, map_id: str,
            on_dialogue: Callable[[], None]) -> list[PolicyRun]: ...


def evaluate(loaded: LoadedModel, dialogues: list[Dialogue], config: EvalConfig, progress=None,
             pool: Pool | None = None) -> EvalResult:
    """Run every requested policy over the same dialogues, here or spread over a pool of worker
    processes. `progress`: an optional rich Progress (a bar per policy)."""
    fmt = ChatFormat.from_tokenizer(loaded.tokenizer)
    map_id = config.map_dialogue or dialogues[0].id
    if map_id not in {d.id for d in dialogues}:
        raise ValueError(f"--map: no dialogue {map_id!r} among the {len(dialogues)} evaluated")
    longest = max(full_cache_tokens(d, fmt) for d in dialogues)
    budget_tokens = config.budget.tokens(longest)
    tasks = [progress.add_task(policy, total=len(dialogues)) for policy in config.policies] if progress else []

    def on_dialogue() -> None:
        for task in tasks:
            progress.advance(task)

    if pool is None:
        runs = run_policies(loaded, dialogues, config, budget_tokens, map_id, on_dialogue)
    else:
        runs = pool.run(dialogues, config, budget_tokens, map_id, on_dialogue)
    full = next((run for run in runs if run.policy == "full"), None)
    full_peak = full.kv_bytes_peak if full is not None else longest * loaded.kv_bytes_per_token()
    return EvalResult(config, budget_tokens, runs, map_id, full_peak)
