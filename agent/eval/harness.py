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

import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np
import torch

from agent.agent import Agent, AgentConfig, score_together
from agent.chat_format import ChatFormat
from agent.engine import Feed, prefill_packed
from agent.eval.dialogue import Dialogue, Probe, Turn
from agent.model import LoadedModel
from agent.eval.reprefill import Reprefill
from cache.policies import POLICIES
from cache.storage import KV_DTYPES

BASELINE = "reprefill"
EVAL_POLICIES = (*POLICIES, BASELINE)
MODES = ("choice", "generate")


@dataclass(frozen=True)
class Budget:
    """`1024` (tokens) or `25%` (of the longest dialogue's full cache, computed by tokenizing, no forward)."""

    value: int
    percent: bool

    @classmethod
    def parse(cls, spec: str) -> "Budget":
        match = re.fullmatch(r"(\d+)(%?)", spec)
        if not match or int(match.group(1)) == 0:
            raise ValueError(f"--budget must be a positive token count like 1024 or a percentage like 25%, got {spec!r}")
        budget = cls(int(match.group(1)), bool(match.group(2)))
        if budget.percent and budget.value > 100:
            raise ValueError(f"--budget percentage must be at most 100%, got {spec!r}")
        return budget

    def tokens(self, dialogues: list[Dialogue], fmt: ChatFormat) -> int:
        tokens = self.value
        if self.percent:
            tokens = max(full_cache_tokens(d, fmt) for d in dialogues) * self.value // 100
        if tokens < 16:
            raise ValueError(f"--budget {self} is {tokens} tokens; a cache policy needs at least 16")
        return tokens

    def __str__(self) -> str:
        return f"{self.value}{'%' if self.percent else ''}"


@dataclass
class EvalConfig:
    policies: list[str]
    budget: Budget
    kv_dtype: str = "auto"  # auto: the model's dtype
    mode: str = "choice"
    map_dialogue: str | None = None  # residency map for this dialogue (default: the first)
    reply_tokens: int = 48  # generate mode: longest free reply
    decode_sample_tokens: int = 4  # choice mode: tokens decoded at each dialogue's last probe to time decode

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


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    config = loaded.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * loaded.dtype.itemsize


# --- runners: one surface over the managed-cache agent and the no-cache baseline --------------------------
class Runner(Protocol):
    def start(self, system: str | None) -> None: ...
    def user_turn(self, text: str) -> float: ...
    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]: ...
    def reply(self, text: str | None) -> list[Feed]: ...
    def score(self, choices: list[str]) -> list[float]: ...
    def draft(self, max_new_tokens: int) -> tuple[list[int], float]: ...
    def resident(self) -> Counter[int]: ...
    def kv_tokens(self) -> int: ...
    def kv_bytes(self) -> int: ...


class CacheRunner:
    """The Agent under one cache policy: solo prefill at probe turns, feeds for the packed forwards
    elsewhere, score/draft from the managed store."""

    def __init__(self, loaded: LoadedModel, config: AgentConfig):
        self.loaded, self.config = loaded, config

    def start(self, system: str | None) -> None:
        self.agent = Agent(self.loaded, replace(self.config, system=system))
        self.turn = None

    def user_turn(self, text: str) -> float:
        self.turn = self.agent.user_turn(text)
        return self.agent.timing.ttft_ms

    def scripted_turn(self, text: str, reply: str | None) -> list[Feed]:
        return [self.agent.scripted_turn(text, reply)]

    def reply(self, text: str | None) -> list[Feed]:
        return [self.agent.reply_feed(self.turn, text)]

    def score(self, choices: list[str]) -> list[float]:
        return self.agent.score(choices)

    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        return self.agent.draft(self.turn, max_new_tokens)

    def resident(self) -> Counter[int]:
        turns, counts = torch.unique(self.agent.store.meta.turn, return_counts=True)
        return Counter(dict(zip(turns.tolist(), counts.tolist())))

    def kv_tokens(self) -> int:
        return self.agent.store.length

    def kv_bytes(self) -> int:
        return self.agent.store.memory_bytes()


def make_runner(policy: str, budget: int | None, kv_dtype: str, loaded: LoadedModel) -> Runner:
    if policy == BASELINE:
        return Reprefill(loaded, kv_bytes_per_token(loaded))
    return CacheRunner(loaded, AgentConfig(policy=policy, budget_tokens=budget, kv_dtype=kv_dtype))


# --- results ------------------------------------------------------------------------------------------
@dataclass
class ProbeOutcome:
    dialogue: str
    turn: int
    kind: str
    tags: list[str]
    correct: bool
    retention: float | None  # None: the probe names no evidence


@dataclass
class TurnSample:
    policy: str
    dialogue: str
    turn: int
    kv_tokens: int
    kv_bytes: int
    ttft_ms: float | None  # timed at probe turns only; None elsewhere (fed packed, or nothing encoded)


@dataclass
class PolicyRun:
    policy: str
    budget_tokens: int | None
    kv_dtype: str
    mode: str
    probes: list[ProbeOutcome] = field(default_factory=list)
    turns: list[TurnSample] = field(default_factory=list)
    kv_bytes_peak: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    residency: np.ndarray | None = None  # [turn x, turn y]: share of turn y's tokens cached after turn x

    def summary(self, full_kv_bytes_peak: int) -> dict:
        ttfts = [t.ttft_ms for t in self.turns if t.ttft_ms is not None]
        retained = [p.retention for p in self.probes if p.retention is not None]
        by_tag: dict[str, list[bool]] = {}
        for probe in self.probes:
            for tag in probe.tags or ["untagged"]:
                by_tag.setdefault(tag, []).append(probe.correct)
        by_kind: dict[str, list[bool]] = {}
        for probe in self.probes:
            by_kind.setdefault(probe.kind, []).append(probe.correct)
        return {
            "policy": self.policy,
            "budget_tokens": self.budget_tokens,
            "kv_dtype": self.kv_dtype,
            "mode": self.mode,
            "probes": len(self.probes),
            "accuracy": _mean([p.correct for p in self.probes]),
            "by_kind": {kind: _mean(v) for kind, v in sorted(by_kind.items())},
            "by_tag": {tag: _mean(v) for tag, v in sorted(by_tag.items())},
            "evidence_retention": _mean(retained),
            "kv_bytes_peak": self.kv_bytes_peak,
            "kv_bytes_mean": _mean([t.kv_bytes for t in self.turns]),
            "full_kv_bytes_peak": full_kv_bytes_peak,
            "ttft_ms_p50": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_ms_p95": float(np.percentile(ttfts, 95)) if ttfts else None,
            "decode_ms_per_token": 1000 * self.decode_s / self.decode_tokens if self.decode_tokens else None,
            "wall_s": round(self.wall_s, 2),
        }


def _mean(values: list) -> float | None:
    return float(np.mean(values)) if values else None


@dataclass
class EvalResult:
    config: EvalConfig
    budget_tokens: int
    runs: list[PolicyRun]
    map_dialogue: str
    full_kv_bytes_peak: int  # the `full` run's peak, else token count x bytes per token

    def to_json(self) -> dict:
        return {
            "runs": [run.summary(self.full_kv_bytes_peak) for run in self.runs],
            "per_turn": [vars(sample) for run in self.runs for sample in run.turns],
        }


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
    """Prefill every lane's feeds in shared packed forwards; each lane is charged its token share."""
    flat = [feed for lane_feeds in feeds for feed in lane_feeds]
    total = sum(len(feed.ids) for feed in flat)
    if not total:
        return
    started = time.perf_counter()
    prefill_packed(model, flat)
    elapsed = time.perf_counter() - started
    for lane, lane_feeds in zip(lanes, feeds):
        lane.run.wall_s += elapsed * sum(len(feed.ids) for feed in lane_feeds) / total


def score_lanes(lanes: list[Lane], choices: list[str]) -> list[list[float]]:
    """Every lane's choice scores: the cache policies' in one packed forward (each charged an equal
    share), the baseline's on its own."""
    shared = [lane for lane in lanes if isinstance(lane.runner, CacheRunner)]
    started = time.perf_counter()
    together = iter(score_together([lane.runner.agent for lane in shared], choices))
    for lane in shared:
        lane.run.wall_s += (time.perf_counter() - started) / len(shared)
    return [next(together) if isinstance(lane.runner, CacheRunner) else lane.timed(lane.runner.score, choices)
            for lane in lanes]


def probe_turn(lanes: list[Lane], model: torch.nn.Module, turn: Turn, t: int, last_probe: int,
               fed: Counter[int], fmt: ChatFormat, config: EvalConfig, dialogue_id: str) -> None:
    """A probe: each policy prefills the user's message alone (timed: its time to first token); then the
    choices are scored (packed) or each policy drafts a reply alone; the reference replies follow."""
    probe = turn.probe
    retention = {}
    for lane in lanes:
        runner, run = lane.runner, lane.run
        ttft = lane.timed(runner.user_turn, turn.user)
        run.turns.append(TurnSample(run.policy, dialogue_id, t, runner.kv_tokens(), runner.kv_bytes(), ttft))
        run.kv_bytes_peak = max(run.kv_bytes_peak, runner.kv_bytes())
        if probe.evidence:
            present = runner.resident()
            retention[id(lane)] = sum(present[e] for e in probe.evidence) / sum(fed[e] for e in probe.evidence)
    scores = score_lanes(lanes, probe.choices) if config.mode == "choice" else [None] * len(lanes)
    for lane, score in zip(lanes, scores):
        if config.mode == "generate":
            ids, seconds = lane.timed(lane.runner.draft, config.reply_tokens)
            correct = reply_is_correct(fmt.decode(ids), probe)
        else:
            correct = int(np.argmax(score)) == probe.answer
            ids, seconds = lane.timed(lane.runner.draft, config.decode_sample_tokens) if t == last_probe else ([], 0.0)
        lane.run.decode_tokens += len(ids)
        lane.run.decode_s += seconds
        lane.run.probes.append(ProbeOutcome(dialogue_id, t, probe.kind, probe.tags, correct, retention.get(id(lane))))
    feed_together(model, lanes, [lane.timed(lane.runner.reply, turn.assistant) for lane in lanes])


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
        lanes.append(Lane(make_runner(policy, budget, kv_dtype, loaded), PolicyRun(policy, budget, kv_dtype, config.mode)))
    for dialogue in dialogues:
        run_dialogue(lanes, loaded.model, dialogue, fmt, config, mapped=dialogue.id == map_id)
        if on_dialogue is not None:
            on_dialogue()
    return [lane.run for lane in lanes]


def merge_runs(parts: list[list[PolicyRun]]) -> list[PolicyRun]:
    """One run per policy from runs over disjoint sets of dialogues (in the order given)."""
    merged = [PolicyRun(run.policy, run.budget_tokens, run.kv_dtype, run.mode) for run in parts[0]]
    for runs in parts:
        for total, run in zip(merged, runs):
            total.probes += run.probes
            total.turns += run.turns
            total.kv_bytes_peak = max(total.kv_bytes_peak, run.kv_bytes_peak)
            total.decode_tokens += run.decode_tokens
            total.decode_s += run.decode_s
            total.wall_s += run.wall_s
            if run.residency is not None:
                total.residency = run.residency
    return merged


class Pool(Protocol):
    """Runs `run_policies` over dialogues in other processes (agent/workers.py)."""

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
    budget_tokens = config.budget.tokens(dialogues, fmt)
    tasks = [progress.add_task(policy, total=len(dialogues)) for policy in config.policies] if progress else []

    def on_dialogue() -> None:
        for task in tasks:
            progress.advance(task)

    if pool is None:
        runs = run_policies(loaded, dialogues, config, budget_tokens, map_id, on_dialogue)
    else:
        runs = pool.run(dialogues, config, budget_tokens, map_id, on_dialogue)
    full = next((run for run in runs if run.policy == "full"), None)
    longest = max(full_cache_tokens(d, fmt) for d in dialogues)
    full_peak = full.kv_bytes_peak if full is not None else longest * kv_bytes_per_token(loaded)
    return EvalResult(config, budget_tokens, runs, map_id, full_peak)
