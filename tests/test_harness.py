"""The evaluation harness on the embedded model and a small scripted dialogue: a fact stated at turn 0,
asked for at turns 10 and 11. Full keeps it and answers; a tiny window loses it."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import cli
from agent.agent import Agent, AgentConfig
from agent.eval.dialogue import load_dialogues
from agent.eval.harness import EvalConfig, evaluate, reply_is_correct
from agent.eval.workers import ModelSpec, WorkerPool
from agent.model import load_model
from agent.scoring import score_together
from cache.policies import Budget
from memory.recall import REASONS, MemoryConfig
from tests.helpers import ask, teacher_force

FIXTURE = Path(__file__).parent / "fixtures" / "harness_dialogue.jsonl"
WINDOW = 64  # tokens: far less than the ~350 between the fact and the probes


@pytest.fixture(scope="module")
def loaded():
    return load_model("embedded", device="cpu")


@pytest.fixture(scope="module")
def dialogues():
    return load_dialogues([FIXTURE])


@pytest.fixture(scope="module")
def result(loaded, dialogues):
    return evaluate(loaded, dialogues, EvalConfig(["full", "window", "reprefill"], Budget(WINDOW, percent=False)))


def run_of(result, policy):
    return next(run for run in result.runs if run.policy == policy)


def test_full_and_reprefill_recall_the_fact(result):
    for policy in ("full", "reprefill"):
        summary = run_of(result, policy).summary(result.full_kv_bytes_peak)
        assert summary["probes"] == 2
        assert summary["evidence_retention"] == 1.0
        assert summary["accuracy"] == 1.0, policy
        assert summary["by_kind"] == {"recall": 1.0} and summary["by_tag"] == {"name": 1.0, "untagged": 1.0}


def test_window_loses_the_evidence_and_stays_in_budget(result):
    window = run_of(result, "window")
    assert window.summary(result.full_kv_bytes_peak)["evidence_retention"] == 0.0
    assert max(sample.kv_tokens for sample in window.turns) <= WINDOW
    assert window.kv_bytes_peak < run_of(result, "full").kv_bytes_peak


def test_memory_brings_the_evidence_back_and_records_why(loaded, dialogues):
    """window+memory under the same tiny window: "What was my order number again?" re-injects turn 0 (it asks
    for an identifier by its noun, and turn 0 gave an order number), the record says why, the evidence is in
    the cache when scored and the probe is answered; the budget holds. ("And what is my name?" resembles
    turn 0 too little: cosine 0.29.)"""
    config = EvalConfig(["window", "window+memory"], Budget(WINDOW, percent=False), memory=MemoryConfig(share=1.0))
    memory = run_of(evaluate(loaded, dialogues, config), "window+memory")
    first = memory.probes[0]
    assert (first.recalled[0]["turn"], first.recalled[0]["reason"], first.recalled[0]["detail"]) == (0, "asked", "order")
    assert first.recalled[0]["tokens"] > 0
    assert first.evidence_retention > 0.5 and first.correct
    assert all(r["reason"] in REASONS for p in memory.probes for r in p.recalled)
    assert all(t.memory_ms is not None and t.kv_tokens <= WINDOW for t in memory.turns)
    assert sum(t.reinjected for t in memory.turns if t.turn in (10, 11)) > 0
    summary = memory.summary(memory.kv_bytes_peak)
    assert summary["memory_ms_p95"] >= summary["memory_ms_p50"] > 0 and summary["reinjected_per_turn"] > 0


def test_recomputed_scoring_follows_the_memory_run_and_reads_the_kv_fresh(loaded, dialogues):
    """`+memory-recompute` keeps the `+memory` run's cache path (same recalls, same retention) and scores its
    probes on the same tokens re-encoded: with room for everything (nothing evicted, nothing spliced) the
    scores are the memory run's; when turn 0 was evicted and spliced back under a tight window they move."""
    roomy = EvalConfig(["hybrid+memory", "hybrid+memory-recompute"], Budget(4096, percent=False))
    tight = EvalConfig(["window+memory", "window+memory-recompute"], Budget(WINDOW, percent=False),
                       memory=MemoryConfig(share=1.0))
    for config, spliced in ((roomy, False), (tight, True)):
        result = evaluate(loaded, dialogues, config)
        live, fresh = (run_of(result, policy).probes for policy in config.policies)
        assert [(p.recalled, p.evidence_retention) for p in live] == [(p.recalled, p.evidence_retention) for p in fresh]
        assert any(p.recalled for p in live) == spliced
        moved = max(abs(a.margin - b.margin) for a, b in zip(live, fresh))
        assert moved > 1e-3 if spliced else moved < 1e-3, moved


def test_residency_map_matches_the_token_layout(result, dialogues):
    """Full holds every fed token, so each earlier turn's share is exactly 1: the harness's per-turn token
    counts agree with what the agent feeds and tags."""
    full, window = run_of(result, "full"), run_of(result, "window")
    n = len(dialogues[0].turns)
    lower = np.tril(np.ones((n, n), dtype=bool))
    assert (full.residency[lower] == 1.0).all() and np.isnan(full.residency[~lower]).all()
    assert window.residency[-1, 0] == 0.0 and window.residency[-1, -1] > 0.0


def test_score_leaves_the_cache_byte_identical(loaded, dialogues):
    agent = Agent(loaded, AgentConfig(policy="h2o", budget_tokens=96, system=dialogues[0].system))
    for turn in dialogues[0].turns[:6]:
        teacher_force(agent, turn.user, turn.assistant)
    ask(agent, dialogues[0].turns[10].user)
    before = agent.store.state()
    before_layers = [{k: v.clone() for k, v in layer.items() if torch.is_tensor(v)} for layer in before["layers"]]
    agent.score(dialogues[0].turns[10].probe.choices)
    after = agent.store.state()
    for name, column in before["meta"].items():
        assert torch.equal(column, after["meta"][name]), name
    for old, new in zip(before_layers, after["layers"]):
        assert old.keys() and all(torch.equal(old[k], new[k]) for k in old)


def test_scoring_packed_across_agents_equals_scoring_each_alone(loaded, dialogues):
    """Two policies' caches differ after the same turns; scoring both in one packed forward gives each
    the scores it gets alone and leaves both stores as they were."""
    agents = [Agent(loaded, AgentConfig(policy=name, budget_tokens=96, system=dialogues[0].system))
              for name in ("full", "h2o")]
    for agent in agents:
        for turn in dialogues[0].turns[:6]:
            teacher_force(agent, turn.user, turn.assistant)
        ask(agent, dialogues[0].turns[10].user)
    choices = dialogues[0].turns[10].probe.choices
    alone = [agent.score(choices) for agent in agents]
    lengths = [agent.store.length for agent in agents]
    together = score_together(loaded.model, agents[0].format, [agent.store for agent in agents], choices)
    assert agents[0].store.length != agents[1].store.length
    assert [agent.store.length for agent in agents] == lengths
    for want, got in zip(alone, together):
        assert np.allclose(want, got, atol=1e-3), (want, got)
    assert alone[0] != alone[1]


def test_worker_pool_gives_the_in_process_results(loaded, dialogues, tmp_path):
    """Two dialogues over two worker processes: the merged runs equal one process's runs."""
    second = json.loads(FIXTURE.read_text().splitlines()[0])
    second["id"] = "second"
    both = tmp_path / "both.jsonl"
    both.write_text(FIXTURE.read_text().rstrip("\n") + "\n" + json.dumps(second) + "\n")
    pair = load_dialogues([both])
    config = EvalConfig(["full", "window", "reprefill"], Budget(WINDOW, percent=False))
    here = evaluate(loaded, pair, config)
    pooled = evaluate(loaded, pair, config, pool=WorkerPool(ModelSpec("embedded", "cpu", "float32"), workers=2))
    for mine, theirs in zip(here.runs, pooled.runs):
        assert [(p.dialogue, p.turn, p.correct, p.evidence_retention) for p in mine.probes] == \
               [(p.dialogue, p.turn, p.correct, p.evidence_retention) for p in theirs.probes]
        assert [(t.dialogue, t.kv_tokens, t.kv_bytes) for t in mine.turns] == [(t.dialogue, t.kv_tokens, t.kv_bytes) for t in theirs.turns]
        assert mine.kv_bytes_peak == theirs.kv_bytes_peak and theirs.wall_s > 0
        assert np.array_equal(mine.residency, theirs.residency, equal_nan=True)


def test_memory_runs_leave_no_scratch_directories(loaded, dialogues, tmp_path, monkeypatch):
    """Each dialogue's archive lives in a temporary directory; in process and in worker processes (which
    their pool terminates, so nothing is collected at exit) every one is gone when the evaluation returns."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the workers' temporary directory
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # this process's, computed once
    config = EvalConfig(["window+memory"], Budget(WINDOW, percent=False))
    run = run_of(evaluate(loaded, dialogues * 2, config), "window+memory")
    assert sum(t.reinjected for t in run.turns) > 0 and list(scratch.iterdir()) == []
    evaluate(loaded, dialogues * 2, config, pool=WorkerPool(ModelSpec("embedded", "cpu", "float32"), workers=2))
    assert list(scratch.iterdir()) == []


def test_generate_mode_keeps_the_scripted_history(loaded, dialogues, result):
    config = EvalConfig(["full"], Budget(WINDOW, percent=False), mode="generate", reply_tokens=12)
    generated = run_of(evaluate(loaded, dialogues, config), "full")
    assert [s.kv_tokens for s in generated.turns] == [s.kv_tokens for s in run_of(result, "full").turns]
    assert generated.decode_tokens > 0


def test_reply_check_is_case_insensitive(dialogues):
    probe = dialogues[0].turns[11].probe  # expect Dana, forbid Maria
    assert reply_is_correct("your name is DANA whitfield", probe)
    assert not reply_is_correct("Dana or Maria?", probe)
    assert not reply_is_correct("I do not know", probe)


def palace(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["palace", *args])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out, out.err


def test_cli_eval_writes_json_and_plot(monkeypatch, capsys, tmp_path):
    out_json, out_png = tmp_path / "out.json", tmp_path / "figures" / "out.png"  # a folder not yet made
    code, out, err = palace(monkeypatch, capsys, "eval", str(FIXTURE), "--policy", "full,window", "--budget", "25%",
                            "--json", str(out_json), "--plot", str(out_png))
    assert code == 0 and "accuracy" in out
    assert [line.split()[:2] for line in err.splitlines()] == [["full", "1/1"], ["window", "1/1"]]  # a log: lines, no bars
    data = json.loads(out_json.read_text())
    assert {run["policy"] for run in data["runs"]} == {"full", "window"}
    assert set(data["runs"][0]) == {
        "policy", "budget_tokens", "kv_dtype", "mode", "probes", "accuracy", "by_kind", "by_tag",
        "far_probes", "far_accuracy", "far_by_kind", "evidence_retention", "kv_bytes_peak", "kv_bytes_mean",
        "full_kv_bytes_peak", "ttft_ms_p50", "ttft_ms_p95", "ttft_late_over_early", "reinjected_per_turn",
        "memory_ms_p50", "memory_ms_p95", "decode_ms_per_token", "wall_s"}
    assert data["runs"][0]["memory_ms_p95"] is None and data["runs"][0]["reinjected_per_turn"] is None  # no memory
    assert data["runs"][0]["ttft_late_over_early"] is None  # 12 turns: nothing timed late
    assert set(data["per_turn"][0]) == {"policy", "dialogue", "turn", "kv_tokens", "kv_bytes", "ttft_ms", "reinjected",
                                        "memory_ms"}
    assert len(data["per_turn"]) == 2 * 12
    records = {(r["policy"], r["turn"]): r for r in data["probes"]}
    assert len(data["probes"]) == 2 * 2 and set(records[("full", 10)]) == {
        "policy", "dialogue", "turn", "kind", "tags", "correct", "chosen", "answer", "margin", "evidence",
        "evidence_distance", "evidence_retention", "recalled"}
    full, window = records[("full", 10)], records[("window", 10)]
    assert full["evidence"] == [0] and full["evidence_distance"] == 10 and full["recalled"] == []
    assert full["correct"] and full["chosen"] == full["answer"] and full["margin"] > 0
    assert full["evidence_retention"] == 1.0 and window["evidence_retention"] < 1.0
    assert window["correct"] == (window["margin"] > 0)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--budget", "25 %"], "--budget"),
    (["--budget", "abc"], "--budget"),
    (["--budget", "0"], "--budget"),
    (["--policy", "full,lru"], "unknown policy 'lru'"),
    (["--mode", "sample"], "unknown mode"),
    (["--kv-dtype", "int3"], "--kv-dtype"),
    (["--memory-threshold", "-2"], "memory threshold -2.0 must be a cosine similarity"),
    (["--notes-placement", "middle"], "unknown notes placement 'middle'"),
])
def test_cli_eval_bad_options_are_one_line(monkeypatch, capsys, args, message):
    code, _, err = palace(monkeypatch, capsys, "eval", str(FIXTURE), *args)
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1


def test_cli_bad_files_are_one_line(monkeypatch, capsys, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "x", "turns": [{"user": ""}]}\n')
    for args in (["eval", str(tmp_path / "missing.jsonl")], ["eval", str(broken)], ["data", "check", str(broken)]):
        code, _, err = palace(monkeypatch, capsys, *args)
        assert code != 0 and len(err.strip().splitlines()) == 1, args
    code, _, err = palace(monkeypatch, capsys, "data", "check", str(broken))
    assert code == 1 and "dialogue x, turn 0" in err


def test_cli_data_check(monkeypatch, capsys):
    code, out, _ = palace(monkeypatch, capsys, "data", "check", str(FIXTURE))
    assert code == 0 and "1 dialogues · 12 turns · 2 probes" in out


def test_hybrid_topics_evicts_whole_topic_segments_within_budget(loaded, dialogues):
    """`hybrid+topics`: no memory, the classifier's topics as segments, the hybrid's segment granularity."""
    from agent.eval.runners import make_runner

    config = make_runner("hybrid+topics", 128, "float32", loaded).config
    assert config.topics and config.memory is None and config.hybrid.granularity == "segment"
    assert make_runner("hybrid", 128, "float32", loaded).config.hybrid.granularity == "token"
    palace, keep = (make_runner(f"hybrid{kind}", 128, "float32", loaded).config for kind in ("+palace", "+palace-keep"))
    assert palace.forget_stale and not keep.forget_stale and keep.graph and keep.profile == palace.profile
    result = evaluate(loaded, dialogues, EvalConfig(["hybrid", "hybrid+topics"], Budget(128, percent=False)))
    topics = run_of(result, "hybrid+topics")
    assert max(sample.kv_tokens for sample in topics.turns) <= 128 and len(topics.probes) == len(run_of(result, "hybrid").probes)


def test_time_to_first_token_late_over_early_compares_probe_turns_40_on_with_those_before_20():
    from agent.eval.results import PolicyRun, TurnSample

    run = PolicyRun("full", None, "float32", "teacher")
    run.turns = [TurnSample("full", "d", turn, 0, 0, ms) for turn, ms in
                 ((3, 10.0), (18, 14.0), (9, None), (25, 99.0), (41, 15.0), (49, 21.0), (48, None))]
    assert run.summary(0)["ttft_late_over_early"] == pytest.approx(18.0 / 12.0)
