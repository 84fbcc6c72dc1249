"""The evaluation harness: runs scripted dialogues (teacher forcing) under each cache policy, in one
process over one loaded model, and measures what a policy costs (KV bytes, time to first token, decode
speed) against what it forgets (probe accuracy, evidence retention).

Every policy sees the same history: after each turn the dialogue continues with the scripted assistant
reply, whatever the model would have said. The `reprefill` baseline keeps no cache and re-encodes the
whole history, but only at probe turns (where an answer is needed), which keeps the run affordable;
its TTFT percentiles therefore cover probe turns only."""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from agent.agent import Agent, AgentConfig
from agent.chat_format import ChatFormat
from agent.dialogue import Dialogue, Probe
from agent.model import LoadedModel
from agent.reprefill import Reprefill
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
    kv_dtype: str = "float32"
    mode: str = "choice"
    map_dialogue: str | None = None  # residency map for this dialogue (default: the first)
    reply_tokens: int = 48  # generate mode: longest free reply
    decode_sample_tokens: int = 8  # choice mode: tokens decoded at each dialogue's last probe to time decode

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
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown --kv-dtype {self.kv_dtype!r}: choose from {', '.join(KV_DTYPES)}")


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
    def user_turn(self, text: str, needed: bool) -> float | None: ...
    def score(self, choices: list[str]) -> list[float]: ...
    def draft(self, max_new_tokens: int) -> tuple[list[int], float]: ...
    def reference_reply(self, text: str | None) -> None: ...
    def resident(self) -> Counter[int]: ...
    def kv_tokens(self) -> int: ...
    def kv_bytes(self) -> int: ...


class CacheRunner:
    """The Agent under one cache policy: prefill per turn, score/draft from the managed store."""

    def __init__(self, loaded: LoadedModel, config: AgentConfig):
        self.loaded, self.config = loaded, config

    def start(self, system: str | None) -> None:
        self.agent = Agent(self.loaded, replace(self.config, system=system))
        self.turn = None

    def user_turn(self, text: str, needed: bool) -> float:
        self.turn = self.agent.user_turn(text)
        return self.agent.timing.ttft_ms

    def score(self, choices: list[str]) -> list[float]:
        return self.agent.score(choices)

    def draft(self, max_new_tokens: int) -> tuple[list[int], float]:
        return self.agent.draft(self.turn, max_new_tokens)

    def reference_reply(self, text: str | None) -> None:
        if text is None:
            self.agent.remember(self.turn)
        else:
            self.agent.reference_reply(self.turn, text)

    def resident(self) -> Counter[int]:
        turns, counts = torch.unique(self.agent.store.meta.turn, return_counts=True)
        return Counter(dict(zip(turns.tolist(), counts.tolist())))

    def kv_tokens(self) -> int:
        return self.agent.store.length

    def kv_bytes(self) -> int:
        return self.agent.store.memory_bytes()


def make_runner(policy: str, budget: int | None, loaded: LoadedModel, config: EvalConfig) -> Runner:
    if policy == BASELINE:
        return Reprefill(loaded, kv_bytes_per_token(loaded))
    return CacheRunner(loaded, AgentConfig(policy=policy, budget_tokens=budget, kv_dtype=config.kv_dtype))


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
    ttft_ms: float | None  # None: nothing was encoded at this turn (reprefill off probe turns)


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


def run_dialogue(runner: Runner, run: PolicyRun, dialogue: Dialogue, fmt: ChatFormat, config: EvalConfig,
                 mapped: bool) -> None:
    """Feed one dialogue turn by turn, scoring probes with the cache as the policy left it."""
    fed = turn_tokens(dialogue, fmt)
    last_probe = max((t for t, turn in enumerate(dialogue.turns) if turn.probe), default=-1)
    n = len(dialogue.turns)
    residency = np.full((n, n), np.nan) if mapped else None
    runner.start(dialogue.system)
    for t, turn in enumerate(dialogue.turns):
        probe = turn.probe
        ttft = runner.user_turn(turn.user, needed=probe is not None)
        run.kv_bytes_peak = max(run.kv_bytes_peak, runner.kv_bytes())
        run.turns.append(TurnSample(run.policy, dialogue.id, t, runner.kv_tokens(), runner.kv_bytes(), ttft))
        if probe is not None:
            retention = None
            if probe.evidence:
                present = runner.resident()
                retention = sum(present[e] for e in probe.evidence) / sum(fed[e] for e in probe.evidence)
            if config.mode == "generate":
                ids, seconds = runner.draft(config.reply_tokens)
                correct = reply_is_correct(fmt.decode(ids), probe)
            else:
                correct = int(np.argmax(runner.score(probe.choices))) == probe.answer
                ids, seconds = runner.draft(config.decode_sample_tokens) if t == last_probe else ([], 0.0)
            run.decode_tokens += len(ids)
            run.decode_s += seconds
            run.probes.append(ProbeOutcome(dialogue.id, t, probe.kind, probe.tags, correct, retention))
        runner.reference_reply(turn.assistant)
        run.kv_bytes_peak = max(run.kv_bytes_peak, runner.kv_bytes())
        if residency is not None:
            present = runner.resident()
            residency[t, : t + 1] = [present[y] / fed[y] for y in range(t + 1)]
    if residency is not None:
        run.residency = residency


def evaluate(loaded: LoadedModel, dialogues: list[Dialogue], config: EvalConfig, progress=None) -> EvalResult:
    """Run every requested policy over the same dialogues. `progress`: an optional rich Progress."""
    fmt = ChatFormat.from_tokenizer(loaded.tokenizer)
    map_id = config.map_dialogue or dialogues[0].id
    if map_id not in {d.id for d in dialogues}:
        raise ValueError(f"--map: no dialogue {map_id!r} among the {len(dialogues)} evaluated")
    budget_tokens = config.budget.tokens(dialogues, fmt)
    total_turns = sum(len(d.turns) for d in dialogues)
    runs = []
    for policy in config.policies:
        budget = None if policy in ("full", BASELINE) else budget_tokens  # both unbounded
        kv_dtype = str(loaded.dtype).removeprefix("torch.") if policy == BASELINE else config.kv_dtype
        run = PolicyRun(policy, budget, kv_dtype, config.mode)
        runner = make_runner(policy, budget, loaded, config)
        task = progress.add_task(policy, total=total_turns) if progress is not None else None
        started = time.perf_counter()
        for dialogue in dialogues:
            run_dialogue(runner, run, dialogue, fmt, config, mapped=dialogue.id == map_id)
            if progress is not None:
                progress.advance(task, len(dialogue.turns))
        run.wall_s = time.perf_counter() - started
        runs.append(run)
    full = next((run for run in runs if run.policy == "full"), None)
    longest = max(full_cache_tokens(d, fmt) for d in dialogues)
    full_peak = full.kv_bytes_peak if full is not None else longest * kv_bytes_per_token(loaded)
    return EvalResult(config, budget_tokens, runs, map_id, full_peak)
