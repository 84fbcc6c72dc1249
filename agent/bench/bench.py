"""`palace bench`: how fast the engine is, and what each KV strategy costs in time and memory.

Every ratio is against a baseline measured in the same run, in the same process, at the same thread
count. Part A times our engine (prefill + greedy decode over the managed store, `full` policy) against
transformers' own `generate()` with its DynamicCache on the same model, then the same pair with int8 and
int4 weights (agent.model's weight-only quantizers, lm_head kept float32); it also measures each quantized
model's top-1 next-token agreement with float32 on a real text. Part B builds a dialogue
history of 2K and 8K tokens and times decode under each KV strategy (no cache, contiguous, paged,
bfloat16, int8, int4, fp8, dynamic, and the hybrid policy at a 2K budget), with the KV bytes each store
reports and, beside them, the process's resident growth from before the store was built to after its
decode (garbage collected and freed heap pages handed back first), which a retained copy would show.

Timing notes. A token's time is the gap between two emitted tokens (sample + one forward), for the
engine and for generate() alike, so prefill and decode are separated the same way for both. The history
is prefilled once per run in float32 (in chunks, as the engine would) and installed into each storage
kind with `replace`, so every row decodes from the same history without re-prefilling 8K tokens per row.
Wall-clock numbers on a shared machine are noisy: each timing is the best of `repeats`, runs are
interleaved, the load average is printed with the results, and every timing is also given in this
process's CPU time, which other processes barely disturb; at `--threads 1` CPU-time ratios are the
trustworthy ones on a loaded machine (with more threads, CPU time also counts threads spinning)."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import random
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from agent.engine import SamplingConfig, decode, forward, prefill
from agent.model import EMBEDDED, embedded_gguf, head_dim, kv_bytes_per_token
from agent.qlinear import Int4Linear
from cache.policies import HybridConfig, Policy, PolicyConfig, make_policy
from cache.storage import StorageConfig
from cache.store import KVStore, TokenMeta

TEXT_PATH = Path(__file__).with_name("bench_text.txt")
KV_ROWS = ("contiguous", "paged", "bfloat16", "int8", "int4", "fp8", "dynamic")


@dataclass
class BenchConfig:
    prompt_tokens: int = 400  # Part A prompt (real text)
    new_tokens: int = 64  # Part A greedy tokens, no early stop
    repeats: int = 2  # Part A: best of this many interleaved runs
    histories: tuple[int, ...] = (2048, 8192 - 64)  # Part B history lengths (SmolLM2 has 8192 positions)
    decode_tokens: int = 16  # Part B timed decode tokens per row
    rounds: int = 3  # Part B: every strategy timed this many times, interleaved; the median is reported
    warmup_tokens: int = 2  # Part B untimed tokens before those
    nocache_work: int = 4096  # Part B no-cache row: timed tokens = max(1, nocache_work // history)
    chunk: int = 512  # history prefill chunk
    turn_tokens: int = 128  # about this many tokens per dialogue turn in the history
    hybrid_budget: int = 2048  # the hybrid row's budget; only run where the history exceeds it
    kv_rows: tuple[str, ...] = KV_ROWS
    weights: tuple[str, ...] = ("int8", "int4")  # Part A quantized-weight rows and agreement, beside float32
    threads: int | None = None
    parts: str = "ab"  # a: engine vs generate(); b: KV strategies; c: memory work per turn (agent/bench/memory_part.py)
    memory_turns: int | None = None  # Part C: the dialogue's first this many turns (None: all 50)
    memory_dialogue: str | None = None  # Part C: the first dialogue of this file (None: data/dialogues.jsonl)
    memory_dtype: str = "float32"  # Part C: the model's and the KV's dtype ("auto": what `palace eval` picks here)
    memory_count: int = 1  # Part C: the file's first this many dialogues, runs alternated, percentiles over all

    @classmethod
    def preset(cls, quick: bool = False, **overrides) -> "BenchConfig":
        base = cls(prompt_tokens=128, new_tokens=16, repeats=1, histories=(256, 1024), decode_tokens=8, rounds=1,
                   nocache_work=1024, chunk=256, turn_tokens=64, hybrid_budget=256, memory_turns=20) if quick else cls()
        return base if not overrides else BenchConfig(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})


# --- text ---------------------------------------------------------------------------------------------
def bench_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_ids(tokenizer, count: int) -> list[int]:
    """`count` tokens of the bench text (repeated if it is shorter)."""
    ids = tokenize(tokenizer, bench_text())
    return (ids * (count // len(ids) + 1))[:count]


def dialogue_turns(tokenizer, total: int, turn_tokens: int, seed: int = 0) -> list[tuple[int, str, list[int]]]:
    """A varied dialogue history of `total` tokens: (turn, role, ids), a short system turn (-1) first, then
    turns of about `turn_tokens` tokens each, alternating user/assistant, drawn from the bench text's
    sentences in a different order every turn (so the text is real English but never one repeated block)."""
    pool, rng = sentences(bench_text()), random.Random(seed)
    turns = [(-1, "system", tokenize(tokenizer, "You are a helpful assistant who remembers what the user said."))]
    size, index = len(turns[0][2]), 0
    while size < total:
        ids: list[int] = []
        while len(ids) < turn_tokens:
            ids += tokenize(tokenizer, " " + rng.choice(pool))
        turns.append((index, "user" if index % 2 == 0 else "assistant", ids))
        size += len(ids)
        index += 1
    return trim_turns(turns, total)


def trim_turns(turns: list[tuple[int, str, list[int]]], total: int) -> list[tuple[int, str, list[int]]]:
    out, size = [], 0
    for turn, role, ids in turns:
        if size >= total:
            break
        out.append((turn, role, ids[: total - size]))
        size += len(out[-1][2])
    return out


def random_turns(vocab: int, total: int, turn_tokens: int, seed: int = 0) -> list[tuple[int, str, list[int]]]:
    """Token ids for models without a tokenizer (the tiny test model)."""
    g = torch.Generator().manual_seed(seed)
    turns, size, index = [], 0, -1
    while size < total:
        ids = torch.randint(3, vocab, (turn_tokens,), generator=g).tolist()
        turns.append((index, "system" if index < 0 else ("user" if index % 2 == 0 else "assistant"), ids))
        size, index = size + turn_tokens, index + 1
    return trim_turns(turns, total)


# --- helpers ------------------------------------------------------------------------------------------
def set_threads(threads: int | None) -> int:
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline


def kv_heads_info(config) -> dict:
    return {"layers": config.num_hidden_layers, "query_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "head_dim": head_dim(config)}


WEIGHT_LABELS = {"int8": "weight-only int8, one scale per row, lm_head float32",
                 "int4": "weight-only int4, groups of 32, exact Q4_1, lm_head float32"}


def quantized_model(model: torch.nn.Module, weights: str) -> torch.nn.Module:
    """A copy of the model as `--weights int8|int4` loads it (lm_head float32), routed through our attention."""
    from agent.model import quantize_linear_int4, quantize_linear_int8
    from cache.attention import enable_palace_attention

    quantize = {"int8": quantize_linear_int8, "int4": quantize_linear_int4}[weights]
    quantized = quantize(model)
    enable_palace_attention(quantized)
    return quantized.eval()


class _Clock:
    """A generate() streamer that only timestamps: the first put is the prompt, then one per new token."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(now())
        self.tokens.extend(int(t) for t in value.reshape(-1))

    def end(self):
        pass


# --- Part A: engine speed -----------------------------------------------------------------------------
def now() -> tuple[float, float]:
    """(wall-clock, this process's CPU time): CPU time is what the work cost even on a loaded machine
    (at one thread; with more, it also counts threads spinning at barriers)."""
    return time.perf_counter(), time.process_time()


def timing_row(name: str, prompt: int, started: tuple[float, float], times: list[tuple[float, float]],
               tokens: list[int]) -> dict:
    """Prefill = start to the first new token; decode = first to last new token over len-1 tokens."""
    prefill_s, prefill_cpu_s = times[0][0] - started[0], times[0][1] - started[1]
    decode_s, decode_cpu_s = times[-1][0] - times[0][0], times[-1][1] - times[0][1]
    rate = lambda count, seconds: count / seconds if seconds > 0 and count > 0 else None  # noqa: E731
    return {"run": name, "prompt_tokens": prompt, "new_tokens": len(tokens), "prefill_s": prefill_s,
            "decode_s": decode_s, "prefill_cpu_s": prefill_cpu_s, "decode_cpu_s": decode_cpu_s,
            "prefill_tok_s": rate(prompt, prefill_s), "decode_tok_s": rate(len(tokens) - 1, decode_s),
            "decode_tok_s_cpu": rate(len(tokens) - 1, decode_cpu_s), "tokens": tokens}


def time_engine(model: torch.nn.Module, ids: list[int], new_tokens: int, name: str = "engine") -> dict:
    """Our engine, `full` policy, greedy, no stop tokens (exactly `new_tokens` tokens)."""
    store = KVStore.for_model(model, make_policy("full", PolicyConfig()))
    times, tokens = [], []
    started = now()
    prefill(model, store, ids, 0, "user", 0)
    for token in decode(model, store, [], SamplingConfig(max_new_tokens=new_tokens), 0, 0):
        times.append(now())
        tokens.append(token)
    return timing_row(name, len(ids), started, times, tokens)


@torch.inference_mode()
def time_generate(model: torch.nn.Module, ids: list[int], new_tokens: int, name: str = "generate") -> dict:
    """transformers' generate() with its default DynamicCache, plain SDPA attention, greedy, and
    min_new_tokens = max_new_tokens so it never stops early."""
    from cache.attention import enable_palace_attention

    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    clock = _Clock()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.set_attn_implementation("sdpa")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            started = now()
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                           pad_token_id=pad, streamer=clock, use_cache=True)
    finally:
        enable_palace_attention(model)
    return timing_row(name, len(ids), started, clock.times, clock.tokens)


def best_of(runs: list[dict]) -> dict:
    """Fastest prefill and fastest decode among repeated runs (noise on a shared machine only adds time)."""
    best = dict(runs[0])
    for key, rate in (("prefill_s", "prefill_tok_s"), ("decode_s", "decode_tok_s"), ("prefill_cpu_s", None),
                      ("decode_cpu_s", "decode_tok_s_cpu")):
        fastest = min(runs, key=lambda r: r.get(key, 0.0))
        best[key] = fastest.get(key)
        if rate:
            best[rate] = fastest.get(rate)
    best["repeats"] = len(runs)
    return best


@torch.inference_mode()
def top1_agreement(reference: torch.nn.Module, candidate: torch.nn.Module, ids: list[int]) -> float:
    """Teacher-force `ids` through both models; share of positions whose argmax next token agrees."""
    x = torch.tensor([ids])
    want = reference(input_ids=x).logits[0].argmax(-1)
    got = candidate(input_ids=x).logits[0].argmax(-1)
    return float((want == got).float().mean())


def part_a(model: torch.nn.Module, ids: list[int], config: BenchConfig, text_ids: list[int] | None = None,
           log: Callable[[str], None] = lambda _: None, gguf: Path | None = None) -> dict:
    """Rows: generate() float32 (baseline) and engine float32, then the same pair for each of
    `config.weights`; with `gguf` (the model's own GGUF file), llama.cpp on it as the anchor."""
    models = {"float32": model, **{weights: quantized_model(model, weights) for weights in config.weights}}
    runs: dict[str, list[dict]] = {}
    for m in models.values():  # warm-up: first-call allocations and kernel selection
        time_engine(m, ids[:16], 2)
        time_generate(m, ids[:16], 2)
    for repeat in range(config.repeats):
        for kind, m in models.items():
            for name, fn in ((f"generate() {kind}", time_generate), (f"engine {kind}", time_engine)):
                log(f"  part A: {name} (run {repeat + 1}/{config.repeats})")
                runs.setdefault(name, []).append(fn(m, ids, config.new_tokens, name))
    rows = [best_of(r) for r in runs.values()]
    baseline = rows[0]
    for row in rows:
        same = next(r for r in rows if r["run"] == "generate() " + row["run"].split()[-1])
        row["decode_vs_generate_f32"] = ratio(row["decode_tok_s"], baseline["decode_tok_s"])
        row["prefill_vs_generate_f32"] = ratio(row["prefill_tok_s"], baseline["prefill_tok_s"])
        row["decode_vs_generate_same_dtype"] = ratio(row["decode_tok_s"], same["decode_tok_s"])
        row["decode_cpu_vs_generate_f32"] = ratio(row["decode_tok_s_cpu"], baseline["decode_tok_s_cpu"])
        row["same_tokens_as_generate"] = row["tokens"] == same["tokens"]
    text = text_ids if text_ids is not None else ids
    agreement = [weight_agreement(model, models[weights], weights, text, rows) for weights in config.weights]
    result = {"rows": rows, "agreement": agreement}
    if gguf is not None:
        log("  part A: llama.cpp on the same GGUF")
        result["llama_cpp"] = llama_cpp_anchor(gguf, ids, config, rows)
    return result


# --- Part A's anchor: llama.cpp on the same GGUF -------------------------------------------------------
LLAMA_CPP_INSTALL = "pip install llama-cpp-python (an optional extra, .[bench]: it builds llama.cpp, several minutes)"


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp anchor cannot run, or None: not installed, or installed without a dependency of its
    own (a `--no-deps` install lacks `diskcache`), which is said as such rather than as 'not installed'."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        if error.name == "llama_cpp":
            return f"not installed ({LLAMA_CPP_INSTALL})"
        return f"llama-cpp-python does not import: {error}"
    return None


def time_llama_cpp(gguf: Path, ids: list[int], new_tokens: int, threads: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same GGUF file, fed the same prompt ids, greedy, at the same
    thread count: the pace issue 15 measures our decode against."""
    from llama_cpp import Llama
    llm = Llama(str(gguf), n_ctx=len(ids) + new_tokens + 8, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    times, tokens = [], []
    started = now()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(now())
        tokens.append(int(token))
        if len(tokens) == new_tokens:
            break
    llm.close()
    return timing_row(f"llama.cpp {gguf.stem.rsplit('.', 1)[-1]}", len(ids), started, times, tokens)


def llama_cpp_anchor(gguf: Path, ids: list[int], config: BenchConfig, rows: list[dict]) -> dict:
    """The anchor row (best of `config.repeats`, after a warm-up) and our rows' speed against it, or why
    there is none."""
    threads = torch.get_num_threads()
    if (missing := llama_cpp_missing()) is not None:
        return {"missing": missing}
    time_llama_cpp(gguf, ids[:16], 2, threads)
    row = best_of([time_llama_cpp(gguf, ids, config.new_tokens, threads) for _ in range(config.repeats)])
    row["threads"] = threads
    return {"row": row, "ours": [{"run": r["run"], "decode_vs_llama_cpp": ratio(r["decode_tok_s"], row["decode_tok_s"]),
                                  "prefill_vs_llama_cpp": ratio(r["prefill_tok_s"], row["prefill_tok_s"])}
                                 for r in rows if r["run"].startswith("engine")]}


def weight_agreement(model: torch.nn.Module, quantized: torch.nn.Module, weights: str, text: list[int],
                     rows: list[dict]) -> dict:
    """The quantized model's top-1 agreement with float32 over `text`, with its engine row's decode ratios."""
    engine = next(r for r in rows if r["run"] == f"engine {weights}")
    label = WEIGHT_LABELS[weights]
    if weights == "int4":
        int4 = next(m for m in quantized.modules() if type(m) is Int4Linear)
        label += ", activations in two int8 levels per group (native kernel)" if int4.dot else ", bfloat16 activations"
    return {"weights": label, "positions": len(text), "top1": top1_agreement(model, quantized, text),
            "decode_vs_generate_f32": engine["decode_vs_generate_f32"],
            "decode_cpu_vs_generate_f32": engine["decode_cpu_vs_generate_f32"]}


# --- Part B: KV strategies ----------------------------------------------------------------------------
@dataclass
class Snapshot:
    """A prefilled history: every layer's keys/values (float32), the token metadata, the last logits."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    meta: dict
    next_logits: torch.Tensor
    ids: list[int] = field(repr=False, default_factory=list)


def build_histories(model: torch.nn.Module, turns: list[tuple[int, str, list[int]]], lengths: tuple[int, ...],
                    chunk: int, surprisal: bool = False, log: Callable[[str], None] = lambda _: None) -> dict[int, Snapshot]:
    """Prefill the dialogue once in `chunk`-token forwards (each turn's metadata declared as it goes) and
    snapshot the store when it reaches each of `lengths`. Importance is not recorded here (its attention
    mass over 8K keys would dominate the run); surprisal is, when a policy ranks by it."""
    tokens = [(turn, role, token) for turn, role, ids in turns for token in ids]
    total = max(lengths)
    if len(tokens) < total:
        raise ValueError(f"history has {len(tokens)} tokens, fewer than {total}")
    recorder = make_policy("hybrid", PolicyConfig(), HybridConfig(score="surprisal")) if surprisal else \
        make_policy("full", PolicyConfig())  # the columns a policy needs, nothing evicted here
    store = KVStore.for_model(model, recorder)
    cuts = sorted(set(range(chunk, total, chunk)) | set(lengths))
    snapshots, start = {}, 0
    started = time.perf_counter()
    for stop in cuts:
        piece = tokens[start:stop]
        run_start = 0
        for i in range(1, len(piece) + 1):  # one expect per run of same-turn tokens
            if i == len(piece) or piece[i][:2] != piece[run_start][:2]:
                turn, role, _ = piece[run_start]
                store.expect(i - run_start, turn, role, max(turn, -1), [t for _, _, t in piece[run_start:i]])
                run_start = i
        forward(model, store, [t for _, _, t in piece])
        start = stop
        if stop in lengths:
            kv = [tuple(t.clone() for t in layer.storage.fetch()) for layer in store.layers]
            snapshots[stop] = Snapshot(stop, kv, store.meta.state(), store.next_logits.clone(),
                                       [t for _, _, t in tokens[:stop]])
            log(f"  part B: history of {stop} tokens prefilled ({time.perf_counter() - started:.0f} s so far)")
    return snapshots


def install(model: torch.nn.Module, snapshot: Snapshot, storage: StorageConfig, policy: Policy) -> KVStore:
    """A fresh store of the given storage kind, under `policy`, holding the snapshot's history."""
    store = KVStore.for_model(model, policy, storage)
    for layer, (keys, values) in zip(store.layers, snapshot.kv):
        layer.storage.replace(keys, values)
        layer.lazy_initialization(keys, values)
    store.meta = TokenMeta(**{name: value.clone() for name, value in snapshot.meta.items()})
    store.next_logits = snapshot.next_logits.clone()
    return store


def time_decode(model: torch.nn.Module, store: KVStore, tokens: int, warmup: int) -> tuple[float, float]:
    """(wall, CPU) seconds per decoded token (sample + make_room + one forward), after `warmup` untimed
    tokens. Decoded tokens belong to a new assistant turn after the history."""
    times = []
    config = SamplingConfig(max_new_tokens=warmup + tokens + 1)
    turn = int(store.meta.turn.max()) + 1 if len(store.meta) else 0
    for _ in decode(model, store, [], config, turn, turn):
        times.append(now())
    (wall0, cpu0), (wall1, cpu1) = times[warmup], times[-1]
    count = len(times) - 1 - warmup
    return (wall1 - wall0) / count, (cpu1 - cpu0) / count


@torch.inference_mode()
def time_nocache(model: torch.nn.Module, ids: list[int], tokens: int) -> tuple[float, float]:
    """(wall, CPU) seconds per token when every token re-runs the whole sequence (no KV cache at all)."""
    device = next(model.parameters()).device
    sequence = list(ids)
    wall, cpu = now()
    for _ in range(tokens):
        logits = model(input_ids=torch.tensor([sequence], device=device), use_cache=False, logits_to_keep=1).logits
        sequence.append(int(logits[0, -1].argmax()))
    end = now()
    return (end[0] - wall) / tokens, (end[1] - cpu) / tokens


def settled_rss() -> int:
    """Resident bytes after collecting garbage and handing freed heap pages back to the system (glibc's
    malloc_trim, where there is one), so what is left is what live objects hold."""
    from agent.bench.soak import rss_bytes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss_bytes()[0]


def measure_row(model: torch.nn.Module, snap: "Snapshot", storage: StorageConfig, policy: Policy,
                config: BenchConfig, compact: bool = False) -> dict:
    """Install the history in a store, (optionally compact it to the policy's budget, timed apart), decode,
    and report the time per token, the bytes the store says it holds and the process's resident growth
    from before the store existed to after its decode (what it really holds, transient buffers freed)."""
    before = settled_rss()
    store = install(model, snap, storage, policy)
    row = {}
    if compact:
        started = time.perf_counter()
        store.make_room(1)
        row["compact_ms"] = 1000 * (time.perf_counter() - started)
    wall, cpu = time_decode(model, store, config.decode_tokens, config.warmup_tokens)
    kv_bytes, kv_tokens = store.memory_bytes(), store.length  # after the decode, like the resident figure
    resident = settled_rss() - before
    del store
    return {"kv_tokens": kv_tokens, "kv_bytes": kv_bytes, "resident_bytes": resident,
            "timed_tokens": config.decode_tokens, "ms_per_token": 1000 * wall, "cpu_ms_per_token": 1000 * cpu, **row}


def median_run(runs: list[dict]) -> dict:
    """The run with the median time per token (its bytes with it), and every run's time, for the spread."""
    middle = sorted(runs, key=lambda r: r["ms_per_token"])[len(runs) // 2]
    return {**middle, "ms_per_token_runs": [r["ms_per_token"] for r in runs]}


def storage_for(kind: str) -> tuple[StorageConfig, str]:
    if kind == "contiguous":
        return StorageConfig("float32"), "contiguous float32"
    if kind == "paged":
        return StorageConfig("float32", paged=True), "paged float32"
    return StorageConfig(kind), f"{kind} KV"


def part_b(model: torch.nn.Module, turns: list[tuple[int, str, list[int]]], config: BenchConfig,
           log: Callable[[str], None] = lambda _: None) -> dict:
    """Per history length: rows of ms/token and KV bytes, ratios vs contiguous float32."""
    policy = make_policy("hybrid", PolicyConfig(budget=config.hybrid_budget))
    hybrid_label = f"hybrid @{config.hybrid_budget}"
    needs_hybrid = any(length > config.hybrid_budget for length in config.histories)
    surprisal = needs_hybrid and policy.needs_surprisal
    snapshots = build_histories(model, turns, config.histories, config.chunk, surprisal, log)
    info = kv_heads_info(model.config)
    tables = []
    for length in config.histories:
        snap, rows = snapshots[length], []
        count = max(1, min(config.decode_tokens, config.nocache_work // length))
        log(f"  part B @{length}: no cache ({count} token{'s' if count > 1 else ''})")
        wall, cpu = time_nocache(model, snap.ids, count)
        rows.append({"strategy": "no cache (recompute)", "kv_tokens": 0, "kv_bytes": 0, "timed_tokens": count,
                     "ms_per_token": 1000 * wall, "cpu_ms_per_token": 1000 * cpu})
        strategies = [(label, storage, lambda: make_policy("full", PolicyConfig()), False)
                      for storage, label in map(storage_for, config.kv_rows)]
        if length > config.hybrid_budget:
            strategies.append((f"{hybrid_label} (float32)", storage_for("contiguous")[0],
                               lambda: make_policy("hybrid", PolicyConfig(budget=config.hybrid_budget)), True))
        runs: dict[str, list[dict]] = {label: [] for label, *_ in strategies}
        for round_ in range(config.rounds):  # interleaved, so a slow spell of the machine hits every row alike
            for label, storage, policy, compact in strategies:
                log(f"  part B @{length}: {label} (round {round_ + 1}/{config.rounds})")
                runs[label].append(measure_row(model, snap, storage, policy(), config, compact))
        rows += [{"strategy": label, **median_run(measured)} for label, measured in runs.items()]
        base = next((r for r in rows if r["strategy"] == "contiguous float32"), None)
        for row in rows:
            row["history"] = length
            row["kv_mb"] = row["kv_bytes"] / 2**20
            row["ms_vs_contiguous"] = ratio(row["ms_per_token"], base and base["ms_per_token"])
            if base and "ms_per_token_runs" in row:  # round by round: the spread of the ratio
                row["ms_vs_contiguous_runs"] = [a / b for a, b in zip(row["ms_per_token_runs"], base["ms_per_token_runs"])]
            row["cpu_ms_vs_contiguous"] = ratio(row["cpu_ms_per_token"], base and base["cpu_ms_per_token"])
            row["kv_vs_contiguous"] = ratio(row["kv_bytes"], base and base["kv_bytes"])
            row["resident_vs_contiguous"] = ratio(row.get("resident_bytes"), base and base["resident_bytes"])
        per_token = kv_bytes_per_token(model.config, torch.float32)
        without = kv_bytes_per_token(model.config, torch.float32, gqa=False)
        no_gqa = {"history": length, "bytes_per_token_gqa": per_token, "bytes_per_token_without_gqa": without,
                  "kv_mb_gqa": per_token * length / 2**20, "kv_mb_without_gqa": without * length / 2**20}
        tables.append({"history": length, "rows": rows, "gqa": no_gqa})
    return {"tables": tables, "model": info}


# --- running and printing -----------------------------------------------------------------------------
def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def render_part_a(result: dict) -> list[str]:
    lines = [f"{'run':20} {'prefill tok/s':>13} {'decode tok/s':>12} {'x gen f32':>9} {'x gen same':>10} "
             f"{'cpu tok/s':>9} {'x gen f32 (cpu)':>15} {'same tokens':>11}"]
    for r in result["rows"]:
        lines.append(f"{r['run']:20} {fmt(r['prefill_tok_s']):>13} {fmt(r['decode_tok_s'], '.2f'):>12} "
                     f"{fmt(r['decode_vs_generate_f32'], '.2f'):>9} {fmt(r['decode_vs_generate_same_dtype'], '.2f'):>10} "
                     f"{fmt(r.get('decode_tok_s_cpu'), '.2f'):>9} {fmt(r.get('decode_cpu_vs_generate_f32'), '.2f'):>15} "
                     f"{'yes' if r['same_tokens_as_generate'] else 'no':>11}")
    for a in result["agreement"]:
        speed = (f", decode {fmt(a.get('decode_vs_generate_f32'), '.2f')}x generate() f32 "
                 f"({fmt(a.get('decode_cpu_vs_generate_f32'), '.2f')}x by CPU time)")
        lines.append(f"top-1 agreement with float32 over {a['positions']} positions: {100 * a['top1']:.1f}%  [{a['weights']}{speed}]")
    anchor = result.get("llama_cpp")
    if anchor and "missing" in anchor:
        lines.append(f"llama.cpp anchor: {anchor['missing']}")
    elif anchor:
        r = anchor["row"]
        lines.append(f"{r['run']:20} {fmt(r['prefill_tok_s']):>13} {fmt(r['decode_tok_s'], '.2f'):>12}   "
                     f"(same GGUF, {r['threads']} threads)")
        lines += [f"  {o['run']:18} decode {fmt(o['decode_vs_llama_cpp'], '.2f')}x llama.cpp, prefill "
                  f"{fmt(o['prefill_vs_llama_cpp'], '.2f')}x" for o in anchor["ours"]]
    return lines


def render_part_b(result: dict) -> list[str]:
    lines = []
    for table in result["tables"]:
        lines.append(f"history {table['history']} tokens")
        lines.append(f"  {'strategy':32} {'ms/token':>9} {'x contig':>8} {'cpu ms/tok':>10} {'x contig':>8} "
                     f"{'KV MB':>8} {'x contig':>8} {'RSS MB':>8} {'x contig':>8} {'KV tokens':>9}  x contig by round")
        for r in table["rows"]:
            resident = r.get("resident_bytes")
            lines.append(f"  {r['strategy']:32} {fmt(r['ms_per_token']):>9} {fmt(r['ms_vs_contiguous'], '.2f'):>8} "
                         f"{fmt(r.get('cpu_ms_per_token')):>10} {fmt(r.get('cpu_ms_vs_contiguous'), '.2f'):>8} "
                         f"{fmt(r['kv_mb']):>8} {fmt(r['kv_vs_contiguous'], '.3f'):>8} "
                         f"{fmt(None if resident is None else resident / 2**20):>8} "
                         f"{fmt(r.get('resident_vs_contiguous'), '.3f'):>8} {r['kv_tokens']:>9}  "
                         + " ".join(f"{x:.2f}" for x in r.get("ms_vs_contiguous_runs", [])))
        g = table["gqa"]
        lines.append(f"  GQA: float32 KV for {table['history']} tokens is {g['kv_mb_gqa']:.1f} MB with "
                     f"{result['model']['kv_heads']} KV heads; {g['kv_mb_without_gqa']:.1f} MB without GQA "
                     f"({result['model']['query_heads']} heads, {g['bytes_per_token_without_gqa'] // g['bytes_per_token_gqa']}x)")
    return lines


def run_bench(config: BenchConfig, model_spec: str = "embedded", json_path: str | None = None,
              echo: Callable[[str], None] = print) -> dict:
    """Load the model on CPU in float32, run the parts asked for, print the tables, write JSON."""
    from agent.model import load_model, resolve_dtype

    threads = set_threads(config.threads)
    loaded = load_model(model_spec, "cpu", "float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    echo(f"palace bench · {loaded.name} · cpu float32 · {threads} threads · torch {torch.__version__} · "
         f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    result = {"config": asdict(config), "model": loaded.name, "threads": threads, "torch": torch.__version__,
              "platform": platform.platform(), "load_average_start": os.getloadavg()}
    started = time.perf_counter()
    log = lambda message: echo(message)  # noqa: E731
    if "a" in config.parts:
        echo(f"\nPart A: engine vs transformers generate() — {config.prompt_tokens}-token prompt, {config.new_tokens} greedy tokens")
        result["part_a"] = part_a(model, prompt_ids(tokenizer, config.prompt_tokens), config,
                                  tokenize(tokenizer, bench_text()), log,
                                  embedded_gguf() if model_spec == EMBEDDED else None)
        echo("\n".join(render_part_a(result["part_a"])))
    if "b" in config.parts:
        limit = model.config.max_position_embeddings
        room = config.warmup_tokens + config.decode_tokens + 2
        if max(config.histories) + room > limit:
            raise ValueError(f"history {max(config.histories)} + {room} decode tokens exceeds the model's {limit} positions")
        echo(f"\nPart B: KV strategies — decode {config.decode_tokens} tokens after each history")
        turns = dialogue_turns(tokenizer, max(config.histories), config.turn_tokens)
        result["part_b"] = part_b(model, turns, config, log)
        echo("\n".join(render_part_b(result["part_b"])))
    if "c" in config.parts:
        from agent.bench.memory_part import DEFAULT_DIALOGUE, part_c, render_part_c

        echo("\nPart C: memory work per turn, hybrid+palace against the hybrid alone (same dialogue, same run)")
        same = resolve_dtype(config.memory_dtype) == loaded.dtype  # "auto" is float32 on CPUs without bfloat16
        memory_loaded = loaded if same else load_model(model_spec, "cpu", config.memory_dtype)
        result["part_c"] = part_c(memory_loaded, config.memory_turns, log,
                                  Path(config.memory_dialogue) if config.memory_dialogue else DEFAULT_DIALOGUE,
                                  config.memory_count)
        echo("\n".join(render_part_c(result["part_c"])))
    result["seconds"] = time.perf_counter() - started
    result["load_average_end"] = os.getloadavg()
    echo(f"\n{result['seconds']:.0f} s · load average now {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
         + (" (a loaded machine makes wall-clock numbers noisy)" if os.getloadavg()[0] > threads + 0.5 else ""))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
        echo(f"wrote {json_path}")
    return result
