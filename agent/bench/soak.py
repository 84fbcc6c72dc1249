"""`palace bench --soak`: one long conversation under a fixed budget, with memory on, to show that the
palace's resources stay bounded as turns go by rather than at the few dozen turns the other benches run.

The Agent runs the configuration `palace chat --session DIR` uses (hybrid policy, topics, memory with an
archive under a memory and a disk cap, the entity graph, the profile) in ONE session, saved to a session
directory at the start (the archive moves there) and then every `save_every` turns (`Agent.save`, the
durability point). Its turns are the user turns and reference replies of `data/dialogues.jsonl`,
concatenated in order (from dialogue `seed`) and cycled, fed by teacher forcing through the Agent's own
steps (observe, recall, prefill, remember). Four checks:

- kv: after every step the store holds at most `budget` tokens, and its allocated storage
  (`store.memory_bytes()`, capacity included) at most budget x bytes per token; the capacity slack
  (allocated - held) is reported on its own.
- rss: the process's resident memory (VmRSS; without /proc, getrusage's peak) after warm-up (the first
  `warmup` share of the turns) grows by less than `rss_growth_max`, judged on its peak after warm-up.
- archive: the live KV files (those of segments still archived) stay within disk_cap + the bytes the
  latest save() flushed. save() writes a file for every payload still in the memory tier, and the tiers
  never evict a payload held in memory, so right after a save the live files may pass the cap by those
  files until later spills let older disk-only segments go (memory/tiers.py). The whole footprint
  (`Archive.disk_bytes()`: db, index, live files and the files of removed segments, deleted only at the
  next save) is reported beside it, not checked: between saves it also holds what was removed since.
- ttft: time to first token (observe + recall + prefill, as in memory_part.py) over the last `warmup`
  share of the turns, median, within `ttft_ratio_max` of the median over as many turns right after warm-up.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.bench.memory_part import ROOT, percentiles

if TYPE_CHECKING:
    from agent.model import LoadedModel

MIB = 2**20


@dataclass(frozen=True)
class SoakConfig:
    turns: int = 1000
    budget: int = 1024  # tokens (chat's default)
    warmup: float = 0.1  # share of the turns before RSS is the baseline; also the TTFT windows' length
    memory_cap_bytes: int = 16 * MIB  # the archive's KV held in memory
    disk_cap_bytes: int = 64 * MIB  # the archive's KV files of segments held only on disk
    save_every: int = 10  # turns between Agent.save() (palace chat saves after every reply)
    checkpoint_every: int = 50  # turns between rows of the series
    seed: int = 0  # the dialogue the cycle starts at (its system prompt is the session's)
    rss_growth_max: float = 0.10
    ttft_ratio_max: float = 1.2


def soak_turns(path: Path, count: int, start: int) -> tuple[str | None, list[tuple[str, str]], int]:
    """The session's system prompt, `count` (user, reply) turns of the dialogues in `path` concatenated
    in order from dialogue `start` and cycled, and how many dialogues they came from."""
    dialogues = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    dialogues = dialogues[start % len(dialogues):] + dialogues[:start % len(dialogues)]
    turns: list[tuple[str, str]] = []
    used = 0
    while len(turns) < count:
        turns += [(t["user"], t["assistant"]) for t in dialogues[used % len(dialogues)]["turns"]]
        used += 1
    return dialogues[0].get("system"), turns[:count], used


def rss_bytes() -> tuple[int, str]:
    """Resident memory now (VmRSS) and its source; without /proc, getrusage's peak (a high-water mark)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024, "VmRSS"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "ru_maxrss"  # bytes on macOS, KiB elsewhere


def kv_files(archive, directory: Path) -> tuple[int, int]:
    """Bytes of the archive's KV files: (live: of segments still archived, removed: awaiting deletion)."""
    from memory.archive import KV_DIR
    from memory.tiers import SUFFIX

    live = removed = 0
    for path in (directory / KV_DIR).glob(f"*{SUFFIX}"):
        stem = path.name.removesuffix(SUFFIX)
        if stem.isdigit():
            size = path.stat().st_size
            live, removed = (live + size, removed) if int(stem) in archive else (live, removed + size)
    return live, removed


def run_soak(loaded: LoadedModel, config: SoakConfig, log: Callable[[str], None]) -> dict:
    """Run the soak (see the module docstring) and return its series, summary figures and checks."""
    from agent.agent import Agent, AgentConfig
    from memory.archive import ArchiveConfig
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    system, turns, dialogues = soak_turns(ROOT / "data" / "dialogues.jsonl", config.turns, config.seed)
    per_token = loaded.kv_bytes_per_token()
    budget_bytes = config.budget * per_token
    warmup = max(1, round(config.turns * config.warmup))
    started_run = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="palace-soak-") as scratch:
        archive_config = ArchiveConfig(memory_cap_bytes=config.memory_cap_bytes, disk_cap_bytes=config.disk_cap_bytes)
        agent = Agent(loaded, AgentConfig(
            policy="hybrid", budget_tokens=config.budget, system=system, topics=True, graph=True,
            memory=MemoryConfig(archive=archive_config), profile=ProfileConfig()))
        agent.save(Path(scratch) / "session")  # as `palace chat --session` starts: the archive now lives there
        memory, store = agent.memory, agent.store
        archive = memory.archive
        directory = archive.directory
        max_tokens = max_held = max_allocated = max_slack = 0
        ttft, work, rss = [], [], []
        rss_source = ""
        flushed = max_flushed = 0  # live KV bytes the latest save() wrote
        max_live = max_removed = max_footprint = 0
        over_bound = []  # live KV bytes - (disk cap + flushed), each time the disk is measured
        series = []

        def step_done() -> None:
            nonlocal max_tokens, max_held, max_allocated, max_slack
            held, allocated = store.length * per_token, store.memory_bytes()
            max_tokens, max_held = max(max_tokens, store.length), max(max_held, held)
            max_allocated, max_slack = max(max_allocated, allocated), max(max_slack, allocated - held)

        def disk_done() -> int:
            nonlocal max_live, max_removed, max_footprint
            live, removed = kv_files(archive, directory)
            max_live, max_removed = max(max_live, live), max(max_removed, removed)
            over_bound.append(live - (config.disk_cap_bytes + flushed))
            max_footprint = max(max_footprint, archive.disk_bytes())
            return live

        for index, (user, reply) in enumerate(turns):
            started = time.perf_counter()
            turn = agent.observe(user)
            agent.recall(turn)
            step_done()
            agent.prefill(turn)
            ttft.append((time.perf_counter() - started) * 1000)
            step_done()
            agent.remember(turn, reply)
            step_done()
            work.append(memory.last_ms)
            live = disk_done()
            if (index + 1) % config.save_every == 0:
                agent.save()
                flushed = kv_files(archive, directory)[0] - live
                max_flushed = max(max_flushed, flushed)
                disk_done()
            now, rss_source = rss_bytes()
            rss.append(now)
            if (index + 1) % config.checkpoint_every == 0 or index + 1 == len(turns):
                live, removed = kv_files(archive, directory)
                window = slice(series[-1]["turn"] if series else 0, index + 1)
                series.append({
                    "turn": index + 1, "kv_tokens": store.length, "kv_allocated_bytes": store.memory_bytes(),
                    "rss_bytes": now, "ttft_ms_p50": percentiles(ttft[window])["p50"],
                    "memory_ms_p50": percentiles(work[window])["p50"], "segments_held": len(archive),
                    "segments_archived": archive.last_id(), "archive_memory_bytes": archive.nbytes(),
                    "live_kv_file_bytes": live, "removed_file_bytes": removed, "disk_bytes": archive.disk_bytes()})
                row = series[-1]
                log(f"  turn {row['turn']}: kv {row['kv_tokens']} tokens, rss {now / MIB:.0f} MiB, ttft p50 "
                    f"{row['ttft_ms_p50']:.0f} ms, archive {row['segments_held']}/{row['segments_archived']} segments, "
                    f"live files {live / MIB:.1f} MiB, on disk {row['disk_bytes'] / MIB:.1f} MiB")
        archived, held = archive.last_id(), len(archive)
        agent.close()

    base = rss[warmup - 1]
    after = max(rss[warmup - 1:])
    early, late = percentiles(ttft[warmup:2 * warmup])["p50"], percentiles(ttft[-warmup:])["p50"]
    kv = {"budget_tokens": config.budget, "bytes_per_token": per_token, "budget_bytes": budget_bytes,
          "max_tokens": max_tokens, "max_held_bytes": max_held, "max_allocated_bytes": max_allocated,
          "max_capacity_slack_bytes": max_slack,
          "pass": max_tokens <= config.budget and max_allocated <= budget_bytes}
    rss_summary = {"source": rss_source, "warmup_turns": warmup, "warmup_end_bytes": base, "end_bytes": rss[-1],
                   "max_bytes": after, "growth": rss[-1] / base - 1, "peak_growth": after / base - 1,
                   "limit": config.rss_growth_max, "pass": after / base - 1 < config.rss_growth_max}
    archive_summary = {
        "memory_cap_bytes": config.memory_cap_bytes, "disk_cap_bytes": config.disk_cap_bytes,
        "bound": "live KV files <= disk_cap_bytes + bytes the latest save() flushed for payloads in memory",
        "max_live_kv_file_bytes": max_live, "max_flushed_bytes": max_flushed, "max_over_bound_bytes": max(over_bound),
        "max_removed_file_bytes": max_removed, "max_disk_bytes": max_footprint,
        "segments_archived": archived, "segments_held": held, "segments_removed": archived - held,
        "saves": config.turns // config.save_every, "pass": max(over_bound) <= 0}
    ttft_summary = {"early_turns": [warmup, 2 * warmup], "late_turns": [config.turns - warmup, config.turns],
                    "early_ms_p50": early, "late_ms_p50": late, "ratio": late / early, "all": percentiles(ttft),
                    "limit": config.ttft_ratio_max, "pass": late / early <= config.ttft_ratio_max}
    return {"config": asdict(config), "model": loaded.name, "dialogues": dialogues, "turns": len(turns),
            "seconds": time.perf_counter() - started_run, "series": series, "kv": kv, "rss": rss_summary,
            "archive": archive_summary, "ttft": ttft_summary,
            "checks": {name: part["pass"] for name, part in
                       (("kv", kv), ("rss", rss_summary), ("archive", archive_summary), ("ttft", ttft_summary))}}


def render_soak(result: dict) -> list[str]:
    """The series as a table, then one line per check."""
    config, kv, rss, archive, ttft = (result[k] for k in ("config", "kv", "rss", "archive", "ttft"))
    verdict = lambda ok: "pass" if ok else "FAIL"  # noqa: E731
    lines = [f"{result['turns']} turns of data/dialogues.jsonl ({result['dialogues']} dialogues, one session) at a "
             f"{kv['budget_tokens']}-token budget, archive caps {config['memory_cap_bytes'] / MIB:.0f} MiB memory / "
             f"{config['disk_cap_bytes'] / MIB:.0f} MiB disk, saved every {config['save_every']} turns "
             f"({result['seconds'] / 60:.1f} min)",
             f"  {'turn':>5} {'kv tok':>6} {'rss MiB':>8} {'ttft p50':>8} {'mem ms':>7} {'segments':>11} "
             f"{'arch mem':>8} {'live MiB':>8} {'removed':>8} {'disk MiB':>8}"]
    for row in result["series"]:
        lines.append(f"  {row['turn']:>5} {row['kv_tokens']:>6} {row['rss_bytes'] / MIB:>8.0f} {row['ttft_ms_p50']:>8.0f} "
                     f"{row['memory_ms_p50']:>7.0f} {row['segments_held']:>5}/{row['segments_archived']:<5} "
                     f"{row['archive_memory_bytes'] / MIB:>8.1f} {row['live_kv_file_bytes'] / MIB:>8.1f} "
                     f"{row['removed_file_bytes'] / MIB:>8.1f} {row['disk_bytes'] / MIB:>8.1f}")
    lines += [
        f"  kv ({verdict(kv['pass'])}): at most {kv['max_tokens']} of {kv['budget_tokens']} tokens, "
        f"{kv['max_held_bytes'] / MIB:.1f} MiB held, {kv['max_allocated_bytes'] / MIB:.1f} MiB allocated "
        f"of {kv['budget_bytes'] / MIB:.1f} MiB budget ({kv['bytes_per_token']} B/token); "
        f"capacity slack up to {kv['max_capacity_slack_bytes'] / MIB:.2f} MiB",
        f"  rss ({verdict(rss['pass'])}, {rss['source']}): {rss['warmup_end_bytes'] / MIB:.0f} MiB after "
        f"{rss['warmup_turns']} warm-up turns, {rss['end_bytes'] / MIB:.0f} MiB at the end, "
        f"{rss['max_bytes'] / MIB:.0f} MiB max: {rss['growth']:+.1%} (peak {rss['peak_growth']:+.1%}, limit "
        f"{rss['limit']:.0%})",
        f"  archive ({verdict(archive['pass'])}): live KV files at most {archive['max_live_kv_file_bytes'] / MIB:.1f} "
        f"MiB vs cap {archive['disk_cap_bytes'] / MIB:.0f} MiB + up to {archive['max_flushed_bytes'] / MIB:.1f} MiB "
        f"a save flushed (closest: {abs(archive['max_over_bound_bytes']) / MIB:.2f} MiB "
        f"{'under' if archive['max_over_bound_bytes'] <= 0 else 'over'}); whole footprint at most "
        f"{archive['max_disk_bytes'] / MIB:.1f} MiB (removed files awaiting the next save: up to "
        f"{archive['max_removed_file_bytes'] / MIB:.1f} MiB); {archive['segments_held']} of "
        f"{archive['segments_archived']} segments held, {archive['segments_removed']} removed",
        f"  ttft ({verdict(ttft['pass'])}): p50 {ttft['early_ms_p50']:.0f} ms over turns "
        f"{ttft['early_turns'][0] + 1}-{ttft['early_turns'][1]}, {ttft['late_ms_p50']:.0f} ms over turns "
        f"{ttft['late_turns'][0] + 1}-{ttft['late_turns'][1]}: {ttft['ratio']:.2f}x (limit {ttft['limit']}x)",
    ]
    return lines
