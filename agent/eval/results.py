"""What an evaluation records: one record per policy and probe, one sample per policy and turn, and each
policy's run with its summary (the figures of the report and of `--json`, documented in docs/eval-json.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

FAR = 20  # turns: a probe whose newest evidence is at least this far back tests long-range memory
EARLY, LATE = 20, 40  # turns: time to first token late in a dialogue (40 on) against early (before 20: probes start at 15)


@dataclass
class ProbeRecord:
    """One policy's answer to one probe."""

    policy: str
    dialogue: str
    turn: int
    kind: str
    tags: list[str]
    correct: bool
    chosen: int | None  # index of the best-scored choice (None in generate mode)
    answer: int
    margin: float | None  # log-prob of the answer minus the best other choice (choice mode)
    evidence: list[int]
    evidence_distance: int | None  # turns since the newest evidence turn
    evidence_retention: float | None  # share of the evidence turns' tokens in the cache when scored
    recalled: list[dict] = field(default_factory=list)  # segments re-injected at this turn, and why

    @property
    def far(self) -> bool:
        return self.evidence_distance is not None and self.evidence_distance >= FAR


@dataclass
class TurnSample:
    policy: str
    dialogue: str
    turn: int
    kv_tokens: int
    kv_bytes: int
    ttft_ms: float | None  # timed at probe turns only; None elsewhere (fed packed, or nothing encoded)
    reinjected: int | None = None  # tokens re-injected from long-term memory before this turn (memory runs)
    memory_ms: float | None = None  # memory work of this turn: recall, and archiving after the reply


def _mean(values: list) -> float | None:
    return float(np.mean(values)) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _grouped(records: list[ProbeRecord], keys) -> dict[str, float]:
    groups: dict[str, list[bool]] = {}
    for record in records:
        for key in keys(record):
            groups.setdefault(key, []).append(record.correct)
    return {key: _mean(values) for key, values in sorted(groups.items())}


@dataclass
class PolicyRun:
    policy: str
    budget_tokens: int | None
    kv_dtype: str
    mode: str
    probes: list[ProbeRecord] = field(default_factory=list)
    turns: list[TurnSample] = field(default_factory=list)
    kv_bytes_peak: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    residency: np.ndarray | None = None  # [turn x, turn y]: share of turn y's tokens cached after turn x

    def summary(self, full_kv_bytes_peak: int) -> dict:
        ttfts = [t.ttft_ms for t in self.turns if t.ttft_ms is not None]
        retained = [p.evidence_retention for p in self.probes if p.evidence_retention is not None]
        far = [p for p in self.probes if p.far]
        memory = [t for t in self.turns if t.memory_ms is not None]
        return {
            "policy": self.policy,
            "budget_tokens": self.budget_tokens,
            "kv_dtype": self.kv_dtype,
            "mode": self.mode,
            "probes": len(self.probes),
            "accuracy": _mean([p.correct for p in self.probes]),
            "by_kind": _grouped(self.probes, lambda p: [p.kind]),
            "by_tag": _grouped(self.probes, lambda p: p.tags or ["untagged"]),
            "far_probes": len(far),
            "far_accuracy": _mean([p.correct for p in far]),
            "far_by_kind": _grouped(far, lambda p: [p.kind]),
            "evidence_retention": _mean(retained),
            "kv_bytes_peak": self.kv_bytes_peak,
            "kv_bytes_mean": _mean([t.kv_bytes for t in self.turns]),
            "full_kv_bytes_peak": full_kv_bytes_peak,
            "ttft_ms_p50": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_ms_p95": float(np.percentile(ttfts, 95)) if ttfts else None,
            "ttft_late_over_early": _ratio(_mean([t.ttft_ms for t in self.turns if t.ttft_ms is not None and t.turn >= LATE]),
                                           _mean([t.ttft_ms for t in self.turns if t.ttft_ms is not None and t.turn < EARLY])),
            "reinjected_per_turn": _mean([t.reinjected for t in memory]),
            "memory_ms_p50": float(np.percentile([t.memory_ms for t in memory], 50)) if memory else None,
            "memory_ms_p95": float(np.percentile([t.memory_ms for t in memory], 95)) if memory else None,
            "decode_ms_per_token": 1000 * self.decode_s / self.decode_tokens if self.decode_tokens else None,
            "wall_s": round(self.wall_s, 2),
        }


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


@dataclass
class EvalResult:
    config: object  # EvalConfig
    budget_tokens: int
    runs: list[PolicyRun]
    map_dialogue: str
    full_kv_bytes_peak: int  # the `full` run's peak, else token count x bytes per token

    def to_json(self) -> dict:
        return {
            "runs": [run.summary(self.full_kv_bytes_peak) for run in self.runs],
            "probes": [asdict(record) for run in self.runs for record in run.probes],
            "per_turn": [asdict(sample) for run in self.runs for sample in run.turns],
        }
