"""Cost of the cache side of long-term memory on this machine, against the project's target (all memory
work of a turn, embed + search + archive + splice, under 30 ms p95): on the embedded SmolLM2 with float32
KV, a 1000-token cache, a 40-token span (one turn), at 1 and 2 threads.

    python -m cache.splice_bench [--runs 20] [--json out.json]

Measures, each from the same restored cache every run: a compaction that evicts the span (no sink, and
handing it to a sink), and injecting it back at the end and chronologically (where it was, 480 tokens
in), both with room in the budget and, at the end, into a full hybrid budget that must evict first.
A restored cache fills its contiguous storage to the next 64-token step, so an injection of 40 makes it
grow (a copy of the whole cache into fresh memory, which the turn's prefill would pay otherwise);
`inject_end_within_capacity` is the splice alone, from a cache with room to grow into."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from agent.engine import forward
from agent.model import load_model
from cache.meta import TokenMeta
from cache.policies import PolicyConfig, make_policy
from cache.span import KVSpan
from cache.store import KVStore

TEXT = ("The lighthouse at the end of the harbour was built in 1852, after a winter storm drove three fishing "
        "boats onto the rocks below the headland. For almost a century it was kept by a single family. ")
CACHE, SPAN, SPAN_AT = 1000, 40, 480


@dataclass
class Snapshot:
    """A store's KV and metadata, to put it back exactly before each timed run."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    meta: TokenMeta
    next_serial: int

    @classmethod
    def of(cls, store: KVStore) -> "Snapshot":
        return cls([tuple(t.clone() for t in layer.storage.fetch()) for layer in store.layers], store.meta.clone(),
                   store.next_serial)

    def restore(self, store: KVStore) -> None:
        for layer, (keys, values) in zip(store.layers, self.kv):  # into fresh memory, sized to the tokens
            layer.storage.load_state({"kind": "contiguous", "keys": keys, "values": values})
        store.meta, store.next_serial = self.meta.clone(), self.next_serial


def timed(prepare: Callable[[], None], run: Callable[[], object], count: int, warmup: int = 3) -> dict[str, float]:
    """Wall p50/p95 and process-CPU p50 of `run` (ms), `prepare` untimed before each. On a shared machine
    the CPU time is what the work costs, the wall time what a user waits, contention included."""
    wall, cpu = [], []
    for step in range(warmup + count):
        prepare()
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        if step >= warmup:
            wall.append((time.perf_counter() - start) * 1000)
            cpu.append((time.process_time() - start_cpu) * 1000)
    p50, p95 = np.percentile(wall, [50, 95])
    return {"p50_ms": round(float(p50), 3), "p95_ms": round(float(p95), 3), "cpu_p50_ms": round(float(np.median(cpu)), 3)}


def build(model: torch.nn.Module, ids: list[int]) -> KVStore:
    """A store holding `ids` as turns of SPAN tokens (so the span is one whole turn), fed in one forward."""
    store = KVStore.for_model(model, make_policy("full", PolicyConfig()))
    for turn, start in enumerate(range(0, len(ids), SPAN)):
        store.expect(len(ids[start : start + SPAN]), turn, "user", turn, ids[start : start + SPAN])
    forward(model, store, ids)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    loaded = load_model("embedded", device="cpu", dtype="float32")
    ids = loaded.tokenizer(TEXT * 40)["input_ids"][: CACHE + SPAN]
    store = build(loaded.model, ids)
    whole = Snapshot.of(store)
    keep = torch.cat((torch.arange(SPAN_AT), torch.arange(SPAN_AT + SPAN, CACHE + SPAN)))
    spans: list[KVSpan] = []
    store.on_evict = spans.append
    store.keep(keep)
    store.on_evict = None
    [span] = spans
    evicted = Snapshot.of(store)
    unbounded, full_budget = store.policy, make_policy("hybrid", PolicyConfig(budget=CACHE + SPAN // 2))

    def inject(at: str) -> Callable[[], object]:
        return lambda: store.inject(span, turn=CACHE // SPAN, at=at)

    def under(policy, snapshot: Snapshot, sink: bool = False, room: int = 0) -> Callable[[], None]:
        """Restore `snapshot` under `policy`, with capacity for `room` more tokens without growing."""
        def prepare() -> None:
            snapshot.restore(store)
            for layer, (keys, values) in zip(store.layers, snapshot.kv):
                layer.storage.append(keys[:, :, :room], values[:, :, :room])
                layer.storage.truncate(len(snapshot.meta))
            store.policy, store.on_evict = policy, (spans.append if sink else None)
            spans.clear()
        return prepare

    figures = {"cache_tokens": CACHE, "span_tokens": SPAN, "kv_bytes_span": span.nbytes(), "threads": {}}
    for threads in args.threads:
        torch.set_num_threads(threads)
        figures["threads"][threads] = {
            "evict_no_sink": timed(under(unbounded, whole), lambda: store.keep(keep), args.runs),
            "evict_to_sink": timed(under(unbounded, whole, sink=True), lambda: store.keep(keep), args.runs),
            "inject_end": timed(under(unbounded, evicted), inject("end"), args.runs),
            "inject_end_within_capacity": timed(under(unbounded, evicted, room=2 * SPAN), inject("end"), args.runs),
            "inject_chronological": timed(under(unbounded, evicted), inject("chronological"), args.runs),
            "inject_end_full_hybrid_budget": timed(under(full_budget, evicted, sink=True), inject("end"), args.runs),
        }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
