"""Evaluation spread over worker processes, each with its own copy of the model and its own dialogues.

On a CPU, one process's forwards of a few dozen tokens do not keep two cores busy (two threads give
about 1.3x one thread), so `palace eval` runs one single-threaded worker per core instead and merges the
runs. Timings are then those of one thread per worker, for every policy alike."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from typing import Callable

import torch

from agent.allocator import keep_freed_memory
from agent.eval.dialogue import Dialogue
from agent.eval.harness import EvalConfig, run_policies
from agent.eval.results import PolicyRun, merge_runs
from agent.model import LoadedModel, load_model


@dataclass(frozen=True)
class ModelSpec:
    """What each worker loads (the arguments of load_model)."""

    model: str
    device: str
    dtype: str
    weights: str = "float"


def default_workers(device: torch.device, dialogues: int) -> int:
    """One worker per available core on a CPU (at most 8, at most one per dialogue); one on a GPU."""
    if device.type != "cpu":
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), 8, dialogues))


_loaded: LoadedModel | None = None  # the model of this worker process


PRIMITIVES_KEPT = "64"  # oneDNN's cache of compiled products (default 1,024): a worker meets a new shape at every
# reprefill answer and kept each one's buffers, 4 MB a shape (peak RSS of 8 acceptance dialogues 2.52 -> 2.15 GB
# with 64, the same time and probes)


def _start(spec: ModelSpec, threads: int) -> None:
    global _loaded
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVES_KEPT)  # read at oneDNN's first product
    keep_freed_memory()  # a spawned process starts with glibc's defaults (agent/allocator.py)
    torch.set_num_threads(threads)
    _loaded = load_model(spec.model, spec.device, spec.dtype, spec.weights)


def _run_one(task: tuple[Dialogue, EvalConfig, int, str]) -> list[PolicyRun]:
    dialogue, config, budget_tokens, map_id = task
    return run_policies(_loaded, [dialogue], config, budget_tokens, map_id)


class WorkerPool:
    """`workers` processes, each loading `spec` once; dialogues are handed out one at a time."""

    def __init__(self, spec: ModelSpec, workers: int):
        self.spec, self.workers = spec, workers

    def run(self, dialogues: list[Dialogue], config: EvalConfig, budget_tokens: int, map_id: str,
            on_dialogue: Callable[[], None]) -> list[PolicyRun]:
        threads = max(1, len(os.sched_getaffinity(0)) // self.workers)
        context = multiprocessing.get_context("spawn")  # fork would copy torch's thread pools
        with context.Pool(self.workers, initializer=_start, initargs=(self.spec, threads)) as pool:
            parts = []
            for runs in pool.imap(_run_one, [(d, config, budget_tokens, map_id) for d in dialogues]):
                parts.append(runs)
                on_dialogue()
        return merge_runs(parts)
