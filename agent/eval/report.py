"""Presenting an evaluation: one rich table (a column per policy, a row per measure, so any number of
probe kinds and tags fits) and one figure (what each policy costs against what it remembers)."""

from __future__ import annotations

import numpy as np
from rich.table import Table

from agent.eval.results import EARLY, FAR, LATE, EvalResult

MIB = 1024 * 1024


def _cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "mib":
        return f"{value / MIB:.2f}"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "ratio":
        return f"{value:.2f}"
    return str(value)


def measures(summaries: list[dict]) -> list[tuple[str, list[str]]]:
    """The report's rows, (label, one cell per policy), from the runs' summaries (`EvalResult.to_json()["runs"]`)."""
    full = next((s["accuracy"] for s in summaries if s["policy"] == "full"), None)
    kinds = sorted({k for s in summaries for k in s["by_kind"]})
    tags = sorted({t for s in summaries for t in s["by_tag"]})
    far_kinds = sorted({k for s in summaries for k in s["far_by_kind"]})
    memory = any(s.get("memory_ms_p95") is not None for s in summaries)
    rows: list[tuple[str, str, object]] = [
        ("budget (tokens)", "raw", lambda s: s["budget_tokens"] or "none"),
        ("probes", "raw", lambda s: s["probes"]),
        ("accuracy", "pct", lambda s: s["accuracy"]),
        *([("  share of full", "ratio", lambda s: s["accuracy"] / full if s["accuracy"] is not None else None)]
          if full else []),
        *((f"  {kind}", "pct", lambda s, k=kind: s["by_kind"].get(k)) for kind in kinds),
        *((f"  tag {tag}", "pct", lambda s, t=tag: s["by_tag"].get(t)) for tag in tags),
        (f"evidence {FAR}+ turns back", "pct", lambda s: s["far_accuracy"]),
        (f"  probes", "raw", lambda s: s["far_probes"]),
        *((f"  {kind}", "pct", lambda s, k=kind: s["far_by_kind"].get(k)) for kind in far_kinds),
        ("evidence retention", "pct", lambda s: s["evidence_retention"]),
        ("KV peak (MiB)", "mib", lambda s: s["kv_bytes_peak"]),
        ("KV mean (MiB)", "mib", lambda s: s["kv_bytes_mean"]),
        ("TTFT p50 (ms)", "ms", lambda s: s["ttft_ms_p50"]),
        ("TTFT p95 (ms)", "ms", lambda s: s["ttft_ms_p95"]),
        (f"TTFT turns {LATE}+ / <{EARLY}", "ratio", lambda s: s.get("ttft_late_over_early")),
        *([("re-injected tokens/turn", "ms", lambda s: s["reinjected_per_turn"]),
           ("memory p50 (ms/turn)", "ms", lambda s: s["memory_ms_p50"]),
           ("memory p95 (ms/turn)", "ms", lambda s: s["memory_ms_p95"])] if memory else []),
        ("decode (ms/token)", "ms", lambda s: s["decode_ms_per_token"]),
        ("wall (s)", "ms", lambda s: s["wall_s"]),
    ]
    return [(label, [_cell(get(s), kind) for s in summaries]) for label, kind, get in rows]


def table(result: EvalResult) -> Table:
    summaries = [run.summary(result.full_kv_bytes_peak) for run in result.runs]
    config = result.config
    kv = ",".join(sorted({run.kv_dtype for run in result.runs if run.policy != "reprefill"})) or "-"
    title = (f"palace eval · mode {config.mode} · kv {kv} · "
             f"full cache peak {result.full_kv_bytes_peak / MIB:.2f} MiB")
    out = Table(title=title)
    out.add_column("measure", no_wrap=True)
    for s in summaries:
        out.add_column(s["policy"], justify="right", no_wrap=True)
    for label, cells in measures(summaries):
        out.add_row(label, *cells)
    return out


def markdown(summaries: list[dict]) -> str:
    """The same rows as a Markdown table (for the README: `python -m agent.eval.report OUT.json`)."""
    lines = ["| measure | " + " | ".join(s["policy"] for s in summaries) + " |",
             "|---|" + "---:|" * len(summaries)]
    lines += [f"| {label.strip() if not label.startswith('  ') else '&nbsp;&nbsp;' + label.strip()} | "
              + " | ".join(cells) + " |" for label, cells in measures(summaries)]
    return "\n".join(lines)


def _per_turn_mean(result: EvalResult, policy: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean over dialogues of a per-turn measure, skipping turns where it was not measured."""
    by_turn: dict[int, list[float]] = {}
    for sample in next(run for run in result.runs if run.policy == policy).turns:
        value = getattr(sample, key)
        if value is not None:
            by_turn.setdefault(sample.turn, []).append(value)
    turns = np.array(sorted(by_turn))
    return turns, np.array([np.mean(by_turn[t]) for t in turns])


def plot(result: EvalResult, path: str) -> None:
    """Top: accuracy vs KV memory, KV bytes per turn, TTFT per turn. Bottom: a residency map per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result.runs
    summaries = {s["policy"]: s for s in (run.summary(result.full_kv_bytes_peak) for run in runs)}
    colors = {run.policy: plt.cm.tab10(i) for i, run in enumerate(runs)}
    fig = plt.figure(figsize=(max(15, 3.6 * len(runs)), 9.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1.05])
    ax_acc, ax_kv, ax_ttft = top.subplots(1, 3)

    points: dict[tuple[float, float], list[str]] = {}  # policies landing on one point share one label
    for policy, s in summaries.items():
        if s["accuracy"] is not None:
            point = (round(s["kv_bytes_peak"] / MIB, 1), round(100 * s["accuracy"], 1))
            points.setdefault(point, []).append(policy)
            ax_acc.scatter(*point, s=80, color=colors[policy], alpha=0.8)
    for point, names in points.items():
        ax_acc.annotate(", ".join(names), point, textcoords="offset points", xytext=(7, 5), fontsize=9)
    ax_acc.set(title="probe accuracy vs KV memory", xlabel="KV peak (MiB)", ylabel="accuracy (%)", ylim=(-5, 105))
    ax_acc.grid(alpha=0.3)

    for run in runs:
        turns, kv = _per_turn_mean(result, run.policy, "kv_bytes")
        ax_kv.plot(turns, kv / MIB, color=colors[run.policy], label=run.policy)
        turns, ttft = _per_turn_mean(result, run.policy, "ttft_ms")
        style = "o" if len(turns) < len(kv) else "-"  # reprefill: measured at probe turns only
        ax_ttft.plot(turns, ttft, style, color=colors[run.policy], label=run.policy, markersize=3)
    ax_kv.set(title="KV cache per turn (mean over dialogues)", xlabel="turn", ylabel="MiB")
    ax_ttft.set(title="time to first token at probe turns (mean)", xlabel="turn", ylabel="ms")
    for ax in (ax_kv, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    maps = bottom.subplots(1, len(runs), squeeze=False)[0]
    for ax, run in zip(maps, runs):
        image = ax.imshow(run.residency, origin="lower", vmin=0, vmax=1, cmap="viridis", aspect="auto",
                          interpolation="nearest")
        ax.set(title=run.policy, xlabel="earlier turn y", ylabel="after turn x")
    bottom.colorbar(image, ax=maps.tolist(), label="share of turn y's tokens in the cache", shrink=0.9)
    bottom.suptitle(f"residency map · dialogue {result.map_dialogue}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m agent.eval.report OUT.json   (a file written by palace eval --json)")
    try:
        with open(sys.argv[1], encoding="utf-8") as source:
            print(markdown(json.load(source)["runs"]))
    except (OSError, ValueError, KeyError) as error:
        sys.exit(f"{sys.argv[1]}: not a palace eval --json file ({error})")
