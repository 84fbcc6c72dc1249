"""`palace bench` on the tiny model: its figures against ones computed here independently (bytes from the
model's geometry, tokens from a plain greedy loop); no timing asserts."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from agent.bench.bench import (WEIGHT_LABELS, BenchConfig, best_of, build_histories, bench_text, dialogue_turns, install,
                         part_a, part_b, random_turns, render_part_a, render_part_b, sentences)
import torch

from cache import native
from cache.policies import PolicyConfig, make_policy
from cache.storage import StorageConfig
from tests.helpers import tiny_llama

# The tiny Llama: 2 layers x 2 KV heads x head_dim 16, keys and values, float32 = 512 bytes per cached token
# (4 query heads: 1024 without GQA); contiguous storage holds capacity in steps of 64 tokens.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def held_bytes(tokens: int, per_token: int = BYTES_PER_TOKEN) -> int:
    return -(-tokens // 64) * 64 * per_token


def greedy(model, ids: list[int], count: int) -> list[int]:
    """A plain greedy loop: one full forward per token, no cache."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(count):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]

CONFIG = BenchConfig(prompt_tokens=24, new_tokens=5, repeats=1, histories=(48, 128), decode_tokens=3, warmup_tokens=1, rounds=2,
                     nocache_work=96, chunk=40, turn_tokens=20, hybrid_budget=48)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def result_a(model):
    return part_a(model, list(range(3, 3 + CONFIG.prompt_tokens)), CONFIG)


@pytest.fixture(scope="module")
def result_b(model):
    return part_b(model, random_turns(model.config.vocab_size, max(CONFIG.histories), CONFIG.turn_tokens), CONFIG)


def test_part_a_tokens_are_the_plain_greedy_continuation(result_a, model):
    expected = greedy(model, list(range(3, 3 + CONFIG.prompt_tokens)), CONFIG.new_tokens)
    rows = {row["run"]: row for row in result_a["rows"]}
    assert rows["engine float32"]["tokens"] == rows["generate() float32"]["tokens"] == expected


def test_part_a_rows_and_ratios(result_a):
    runs = [row["run"] for row in result_a["rows"]]
    assert runs == ["generate() float32", "engine float32", "generate() int8", "engine int8", "generate() int4",
                    "engine int4"]
    base = result_a["rows"][0]
    assert base["decode_vs_generate_f32"] == pytest.approx(1.0)
    for row in result_a["rows"]:
        assert row["new_tokens"] == CONFIG.new_tokens  # no early stop on either side
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
        assert row["decode_vs_generate_f32"] == pytest.approx(row["decode_tok_s"] / base["decode_tok_s"])
    engine = result_a["rows"][1]
    assert engine["same_tokens_as_generate"]  # greedy over the same model: the same continuation
    rows = {row["run"]: row for row in result_a["rows"]}
    labels = [a["weights"] for a in result_a["agreement"]]
    assert [label[:len(WEIGHT_LABELS[w])] for label, w in zip(labels, CONFIG.weights)] == [WEIGHT_LABELS[w] for w in CONFIG.weights]
    assert labels[-1].endswith("(native kernel)" if native.q4_fast() else "bfloat16 activations")  # int4's activations
    for agreement, weights in zip(result_a["agreement"], CONFIG.weights):
        assert 0.0 <= agreement["top1"] <= 1.0 and agreement["positions"] == CONFIG.prompt_tokens
        assert agreement["decode_vs_generate_f32"] == rows[f"engine {weights}"]["decode_vs_generate_f32"]
        assert agreement["decode_cpu_vs_generate_f32"] == rows[f"engine {weights}"]["decode_cpu_vs_generate_f32"]
    text = "\n".join(render_part_a(result_a))
    assert "engine int4" in text and "exact Q4_1" in text and "one scale per row" in text
    json.dumps(result_a)  # every row serialises


def test_part_a_float32_only(model):
    result = part_a(model, list(range(3, 3 + CONFIG.prompt_tokens)), replace(CONFIG, weights=()))
    assert [row["run"] for row in result["rows"]] == ["generate() float32", "engine float32"]
    assert result["agreement"] == []



def test_llama_cpp_anchor_times_the_same_gguf_or_says_how_to_install(embedded):
    """Where llama-cpp-python is installed (the bench extra), llama.cpp decodes the embedded GGUF greedily
    from the same prompt ids, and our rows are put against it; where it is not, the bench says how to
    install it instead of leaving the row out silently."""
    import importlib.util

    from agent.bench.bench import LLAMA_CPP_INSTALL, llama_cpp_anchor, time_engine
    from agent.model import embedded_gguf

    ids = embedded.tokenizer("The capital of France is").input_ids
    rows = [time_engine(embedded.model, ids, 4, "engine float32")]
    anchor = llama_cpp_anchor(embedded_gguf(), ids, replace(CONFIG, new_tokens=4), rows)
    text = "\n".join(render_part_a({"rows": [], "agreement": [], "llama_cpp": anchor}))
    if importlib.util.find_spec("llama_cpp") is None:
        assert anchor == {"missing": f"not installed ({LLAMA_CPP_INSTALL})"} and f"not installed ({LLAMA_CPP_INSTALL})" in text
        return
    row = anchor["row"]
    assert row["run"] == "llama.cpp Q4_1" and row["new_tokens"] == 4 and row["decode_tok_s"] > 0
    assert row["tokens"][0] == rows[0]["tokens"][0]  # our float32 weights are this GGUF's, dequantized
    [ours] = anchor["ours"]
    assert ours["decode_vs_llama_cpp"] == pytest.approx(rows[0]["decode_tok_s"] / row["decode_tok_s"])
    assert "llama.cpp Q4_1" in text and "x llama.cpp" in text


def test_a_llama_cpp_that_is_installed_but_does_not_import_is_named_as_such(tmp_path, monkeypatch):
    """A `--no-deps` install of llama-cpp-python lacks `diskcache`: the bench says which module is missing,
    not that llama.cpp is not installed."""
    from agent.bench.bench import llama_cpp_missing

    package = tmp_path / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text("import diskcache_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    assert llama_cpp_missing() == "llama-cpp-python does not import: No module named 'diskcache_that_is_not_there'"


def test_best_of_takes_fastest_of_each_phase():
    runs = [{"prefill_s": 2.0, "prefill_tok_s": 5.0, "decode_s": 1.0, "decode_tok_s": 9.0},
            {"prefill_s": 1.0, "prefill_tok_s": 10.0, "decode_s": 3.0, "decode_tok_s": 3.0}]
    best = best_of(runs)
    assert (best["prefill_s"], best["prefill_tok_s"], best["decode_s"], best["decode_tok_s"]) == (1.0, 10.0, 1.0, 9.0)


def test_part_b_tables_are_consistent(result_b, model):
    assert [table["history"] for table in result_b["tables"]] == list(CONFIG.histories)
    for table in result_b["tables"]:
        rows = {row["strategy"]: row for row in table["rows"]}
        nocache, base = rows["no cache (recompute)"], rows["contiguous float32"]
        assert nocache["kv_bytes"] == 0 and nocache["kv_vs_contiguous"] == 0
        tokens = table["history"] + CONFIG.warmup_tokens + CONFIG.decode_tokens + 1  # bytes are read after the decode
        assert base["kv_tokens"] == tokens and base["ms_vs_contiguous"] == pytest.approx(1.0)
        for row in table["rows"][1:]:  # every strategy timed in each round, the median run reported
            assert len(row["ms_per_token_runs"]) == CONFIG.rounds and row["ms_per_token"] in row["ms_per_token_runs"]
            assert row["ms_vs_contiguous_runs"] == pytest.approx(
                [a / b for a, b in zip(row["ms_per_token_runs"], base["ms_per_token_runs"])])
        for row in table["rows"]:
            assert row["ms_per_token"] > 0
            assert row["ms_vs_contiguous"] == pytest.approx(row["ms_per_token"] / base["ms_per_token"])
            assert row["kv_vs_contiguous"] == pytest.approx(row["kv_bytes"] / base["kv_bytes"])
        assert base["kv_bytes"] == held_bytes(tokens)
        assert rows["bfloat16 KV"]["kv_bytes"] == held_bytes(tokens, BYTES_PER_TOKEN // 2)
        needed = -(-tokens // 16) * 16 * BYTES_PER_TOKEN  # whole blocks; a pool counts its free blocks too
        assert needed <= rows["paged float32"]["kv_bytes"] <= max(1.25 * needed, 16 * 16 * BYTES_PER_TOKEN)
        assert all(isinstance(row["resident_bytes"], int) for row in table["rows"][1:])
        assert rows["int8 KV"]["kv_bytes"] < base["kv_bytes"]
        gqa = table["gqa"]
        assert (gqa["bytes_per_token_gqa"], gqa["bytes_per_token_without_gqa"]) == (BYTES_PER_TOKEN, 2 * BYTES_PER_TOKEN)
    long = {row["strategy"]: row for row in result_b["tables"][-1]["rows"]}
    assert long["int4 KV"]["kv_bytes"] < long["int8 KV"]["kv_bytes"]  # past the residual window, int4 is smaller
    (hybrid,) = [row for name, row in long.items() if "@48" in name]
    assert hybrid["kv_tokens"] <= CONFIG.hybrid_budget and hybrid["kv_bytes"] == held_bytes(hybrid["kv_tokens"])
    assert not any("@48" in row["strategy"] for row in result_b["tables"][0]["rows"])  # history within budget
    text = "\n".join(render_part_b(result_b))
    assert "without GQA" in text and "no cache" in text
    json.dumps(result_b)  # every row serialises


def test_install_reproduces_the_prefilled_history(model):
    turns = random_turns(model.config.vocab_size, 64, 16)
    snapshots = build_histories(model, turns, (32, 64), chunk=24)
    assert set(snapshots) == {32, 64}
    for kind in ("float32", "int8"):
        store = install(model, snapshots[64], StorageConfig(kind), make_policy("full", PolicyConfig()))
        assert store.length == 64 and len(store.meta) == 64
        assert store.meta.turn.tolist() == [t for t, _, ids in turns for _ in ids]


def test_dialogue_history_is_real_varied_text():

    class Words:  # whitespace "tokenizer": enough to check structure
        def __call__(self, text, add_special_tokens=False):
            return type("Out", (), {"input_ids": [hash(w) % 1000 for w in text.split()]})()

    assert len(sentences(bench_text())) > 10
    turns = dialogue_turns(Words(), 500, 40)
    assert sum(len(ids) for _, _, ids in turns) == 500
    assert turns[0][:2] == (-1, "system") and {role for _, role, _ in turns[1:]} == {"user", "assistant"}
    assert len({tuple(ids) for _, _, ids in turns}) == len(turns)  # no turn is a copy of another


def test_preset_quick_is_smaller():
    quick, full = BenchConfig.preset(True), BenchConfig.preset(False)
    assert max(quick.histories) < max(full.histories) and quick.new_tokens < full.new_tokens
    assert max(full.histories) + full.decode_tokens + full.warmup_tokens + 2 <= 8192  # SmolLM2's positions
    assert BenchConfig.preset(True, threads=1).threads == 1


def test_part_c_reports_every_step_of_the_memory_palace_against_the_hybrid(embedded):
    from agent.bench.memory_part import ON_CLOCK, part_c, render_part_c

    result = part_c(embedded, 8, lambda message: None)
    palace, hybrid = result["runs"]["hybrid+palace"], result["runs"]["hybrid"]
    assert result["turns"] == 8 and result["budget_tokens"] == max(64, result["full_tokens"] // 4)
    assert set(palace["steps"]) >= {"embed", "topics", "graph", "search", "embed_reply", "forget", "archive", "notes"} \
        and not hybrid["steps"]
    assert palace["on_clock_ms"]["p50"] <= palace["memory_ms"]["p50"] + 1e-9
    assert palace["steps"]["embed"]["p50"] > 0 and hybrid["memory_ms"] == {}
    assert result["ttft_p95_vs_hybrid"] == palace["ttft_ms"]["p95"] / hybrid["ttft_ms"]["p95"]
    text = "\n".join(render_part_c(result))
    assert "all memory work" in text and all(step in text for step in ON_CLOCK if step in palace["steps"])
    assert text.startswith("8 turns of data/dialogues.jsonl cs-0001 at a")


def test_part_c_runs_in_the_dtype_it_is_given_with_the_kv_in_it_too():
    """`palace bench --parts c --memory-dtype bfloat16`: the configuration `palace eval` runs on AMX and AVX-512 BF16
    CPUs (model and KV in bfloat16), said in the table."""
    from agent.bench.memory_part import part_c, render_part_c
    from agent.model import load_model

    result = part_c(load_model("embedded", "cpu", "bfloat16"), 3, lambda message: None)
    assert result["dtype"] == "bfloat16" and result["runs"]["hybrid+palace"]["steps"]["embed"]["p50"] > 0
    assert "model and KV in bfloat16" in render_part_c(result)[0]


def test_part_c_runs_any_scripted_dialogue_and_refuses_one_without_replies(embedded, tmp_path):
    """`--memory-dialogue` and `--memory-count`: the file's first dialogues, the two runs alternated, each dialogue
    at a quarter of its own length and with the embedder's text cache emptied, percentiles over all their turns."""
    from agent.bench.memory_part import ROOT, part_c, render_part_c
    from agent.eval.dialogue import DialogueError
    from memory.embedder import shared_embedder

    result = part_c(embedded, 3, lambda message: None, ROOT / "data" / "dev" / "dev-05.jsonl")
    assert result["turns"] == 3 and result["dialogue"].startswith("data/dev/dev-05.jsonl ")
    result = part_c(embedded, 3, lambda message: None, ROOT / "data" / "dialogues.jsonl", dialogues=2)
    assert result["dialogue"] == "data/dialogues.jsonl cs-0001..cs-0002" and len(result["budgets"]) == 2
    assert {run["samples"] for run in result["runs"].values()} == {6}
    assert shared_embedder().cache_info().size <= 6  # the second dialogue's 3 user turns and 3 replies, no more
    assert render_part_c(result)[0].startswith("2 dialogues of 3 turns, data/dialogues.jsonl cs-0001..cs-0002")
    unscripted = tmp_path / "unscripted.jsonl"
    unscripted.write_text(json.dumps({"id": "u1", "turns": [{"user": "Hello there."}]}) + "\n")
    with pytest.raises(DialogueError, match="turn 0 has no assistant reply"):
        part_c(embedded, None, lambda message: None, unscripted)
    with pytest.raises(DialogueError, match="1 dialogues in it, 2 wanted"):
        part_c(embedded, None, lambda message: None, ROOT / "data" / "dev" / "dev-05.jsonl", dialogues=2)
