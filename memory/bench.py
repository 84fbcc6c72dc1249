"""Per-turn cost of the long-term store on this machine, against the project's target: all memory work
of a turn (embed, search, archive, splice) under 30 ms p95.

    python -m memory.bench [--model-dir DIR] [--json out/memory-bench.json]

Measures: embedding one short sentence (never a cache hit) at 1 and 2 threads; search over 1k and 10k
segments of one scope, flat vs HNSW vs LSH; Archive add/get of a SmolLM2-sized segment (40 tokens x 30
layers x 3 KV heads x 64 dims) in float32 and int8, from memory and from disk. With --model-dir (a local
SmolLM2 directory), also the int8 error on the model's real KV."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import faiss
import numpy as np
import torch

from memory.archive import Archive, ArchiveConfig
from memory.embedder import DTYPES, Embedder, EmbedderConfig, embed_mode
from memory.index import IndexConfig, VectorIndex
from memory.segment import Segment

LAYERS, HEADS, DIM, TOKENS = 30, 3, 64, 40


def timed(run: Callable[[int], object], count: int, warmup: int = 5) -> dict[str, float]:
    """Wall-clock p50/p95 and the p50 of process CPU time (all threads): on a shared machine the CPU
    time is what the work costs, the wall time what a user waits, contention included."""
    for step in range(warmup):
        run(-1 - step)
    wall, cpu = [], []
    for step in range(count):
        start, start_cpu = time.perf_counter(), time.process_time()
        run(step)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    p50, p95 = np.percentile(np.asarray(wall) * 1000, [50, 95])
    cpu50, cpu95 = np.percentile(np.asarray(cpu) * 1000, [50, 95])
    return {"p50_ms": round(float(p50), 3), "p95_ms": round(float(p95), 3),
            "cpu_p50_ms": round(float(cpu50), 3), "cpu_p95_ms": round(float(cpu95), 3)}


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)


def bench_embed(count: int) -> dict:
    """Each dtype the embedder offers (`auto` picks one: memory/embedder.py), at 1 and 2 threads, and how
    close the others' embeddings are to float32's (the lowest cosine over the sentences timed)."""
    sentence = "Turn {}: my order {} has not arrived yet, can you check where it is?"
    out, vectors = {"auto": embed_mode("auto", torch.device("cpu"))}, {}
    for dtype in DTYPES:
        embedder = Embedder(EmbedderConfig(dtype=dtype, cache_size=0))
        for threads in (1, 2):
            set_threads(threads)
            out[f"{dtype}, {threads} thread(s)"] = timed(
                lambda i: embedder.embed(sentence.format(f"{threads}.{i}", i * 7919)), count)
        vectors[dtype] = embedder.embed([sentence.format(i, i * 7919) for i in range(count)])
    for dtype in DTYPES.keys() - {"float32"}:
        out[f"{dtype} min cosine to float32"] = round(float((vectors["float32"] * vectors[dtype]).sum(1).min()), 6)
    cached = Embedder()
    out["cache hit"] = timed(lambda i: cached.embed(sentence.format("1.0", 0)), count)
    return out


def unit(rng: np.random.Generator, count: int) -> np.ndarray:
    vectors = rng.standard_normal((count, 384)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def bench_search(sizes: tuple[int, ...], queries: int) -> dict:
    """Random unit vectors; each query is a stored vector moved to cosine ~0.7 from it (a question
    about one memory). hit@1: the query's source comes first; recall@5: overlap with exact search's top
    5, which on random data (near-ties after the first) is the approximate indexes' worst case."""
    rng = np.random.default_rng(0)
    out = {}
    for size in sizes:
        vectors = unit(rng, size)
        sources = rng.integers(0, size, queries + 5)
        probes = vectors[sources] + 0.05 * rng.standard_normal((queries + 5, 384)).astype(np.float32)
        probes /= np.linalg.norm(probes, axis=1, keepdims=True)
        exact = VectorIndex()
        exact.add(range(size), vectors, "user", "session")
        for kind in ("flat", "hnsw", "lsh"):
            index = VectorIndex(IndexConfig(kind=kind))
            start = time.perf_counter()
            index.add(range(size), vectors, "user", "session")
            build = time.perf_counter() - start
            row = timed(lambda i: index.search(probes[i], "user", "session", k=5), queries)
            found = [[i for i, _ in index.search(q, "user", "session", 5)] for q in probes[:queries]]
            row["hit@1"] = round(float(np.mean([f[0] == s for f, s in zip(found, sources)])), 3)
            row["recall@5"] = round(float(np.mean([len(set(f) & {i for i, _ in exact.search(q, "user", "session", 5)})
                                                   for f, q in zip(found, probes)])) / 5, 3)
            with tempfile.TemporaryDirectory() as scratch:
                start = time.perf_counter()
                index.save(Path(scratch) / "index.faiss")
                row["save_ms"] = round((time.perf_counter() - start) * 1000, 1)
            row["build_ms"] = round(build * 1000, 1)
            out[f"{kind} {size}"] = row
    return out


def kv_segment(seed: int) -> Segment:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 8.0, DIM)
    keys = torch.randn(LAYERS, HEADS, TOKENS, DIM, generator=generator) * scales
    values = torch.randn(LAYERS, HEADS, TOKENS, DIM, generator=generator)
    return Segment("user", "session", list(range(TOKENS)), f"segment {seed}", seed, "user", 0,
                   torch.arange(TOKENS), keys, values, torch.rand(TOKENS), torch.rand(TOKENS),
                   torch.arange(TOKENS) + TOKENS * seed)


def bench_archive(count: int) -> dict:
    rng = np.random.default_rng(1)
    segments = [kv_segment(seed) for seed in range(8)]
    vectors = unit(rng, count + 10)
    out = {}
    for kv_codec in ("float", "int8"):
        for where, cap in (("memory", 2**40), ("disk", 0)):  # cap 0: every add spills its own KV
            with tempfile.TemporaryDirectory() as scratch:
                archive = Archive.create(Path(scratch) / "session", ArchiveConfig(kv_codec=kv_codec, memory_cap_bytes=cap))
                ids: list[int] = []
                add = timed(lambda i: ids.append(archive.add(segments[i % 8], vectors[i])), count)
                get = timed(lambda i: archive.get(ids[i % len(ids)]), count)
                name = "float32" if kv_codec == "float" else "int8"
                out[f"{name} add, KV to {where}"] = add
                out[f"{name} get, KV from {where}"] = get
                if where == "memory":
                    out[f"{name} bytes a segment"] = archive.nbytes() // len(ids)
                archive.close()
    return out


def bench_real_kv(model_dir: str) -> dict:
    """int8 error on SmolLM2's own KV: relative Frobenius error and worst element against the bound."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memory import codec

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    text = ("The customer wrote that the parcel with order number 4417 never arrived at her flat in Zurich, "
            "although the tracking page says it was delivered on Monday. She wants a refund or a new parcel, "
            "and asks whether the courier left it with a neighbour. ") * 4
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :4 * TOKENS]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    out = {}
    for start in range(0, ids.shape[1], TOKENS):
        keys = torch.stack([layer.keys[0, :, start:start + TOKENS] for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:start + TOKENS] for layer in cache.layers])
        got_keys, got_values = codec.decode(codec.encode(keys, values, "int8"), "int8", torch.float32, "cpu", copy=False)
        per_token = codec.dequantize(*codec.quantize(keys, dim=3), torch.float32, "cpu")
        for side, want, got in (("keys (per channel)", keys, got_keys), ("values (per token)", values, got_values),
                                ("keys if per token (not used)", keys, per_token)):
            relative = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
            worst = out.setdefault(side, {"relative_error_max": 0.0, "max_abs_error": 0.0, "max_abs_value": 0.0})
            worst["relative_error_max"] = round(max(worst["relative_error_max"], relative), 5)
            worst["max_abs_error"] = round(max(worst["max_abs_error"], float((got - want).abs().max())), 4)
            worst["max_abs_value"] = round(max(worst["max_abs_value"], float(want.abs().max())), 2)
    out["segments"] = ids.shape[1] // TOKENS
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="local SmolLM2 directory, for the int8 error on real KV")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    report = {"load_average_before": os.getloadavg(), "torch": torch.__version__, "faiss": faiss.__version__}
    report["embed"] = bench_embed(args.count)
    set_threads(1)
    report["search (1 thread)"] = bench_search((1000, 10_000), args.count)
    report["archive (1 thread)"] = bench_archive(args.count)
    if args.model_dir:
        report["int8 on real KV"] = bench_real_kv(args.model_dir)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
