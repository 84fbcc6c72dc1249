"""`palace`: chat with the agent, inspect the model, evaluate and benchmark cache policies."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="memory-palace: a chat agent that manages its KV cache like memory.")

ModelOpt = typer.Option("embedded", "--model", help="'embedded' (SmolLM2-135M) or a local Hugging Face model directory.")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda or auto.")
DtypeOpt = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16.")
WeightsOpt = typer.Option("auto", "--weights", help="auto (int4 for the embedded model in float32 on a CPU with the native int4 kernel, else float), float, int4 (group-wise 4-bit weights, lossless for the embedded Q4_1 model; CPU) or int8 (per-channel int8 weights, CPU).")


class UserError(Exception):
    """Bad input: reported as one line, exit code 2."""


def make_parents(*paths: str | None) -> None:
    """Create the folders output files go into, so a long run does not fail at its last step."""
    for path in paths:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)


@app.command()
def chat(
    model: str = ModelOpt,
    policy: str = typer.Option("hybrid", help="full, window, sink, h2o or hybrid."),
    budget: str = typer.Option("1024", help="KV budget in tokens, or 'none'."),
    max_new_tokens: int = typer.Option(128, min=1),
    temperature: float = typer.Option(0.0, min=0.0),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    top_k: int = typer.Option(0, min=0),
    seed: int = typer.Option(0),
    system: Optional[str] = typer.Option(None, help="System prompt."),
    kv_dtype: str = typer.Option("float32", "--kv-dtype", help="float32, bfloat16, float16, int8, int4, fp8 or dynamic."),
    paged: bool = typer.Option(False, "--paged", help="Hold KV in 16-token blocks from a pool (float kv dtypes)."),
    topics: bool = typer.Option(True, "--topics/--no-topics", help="Track topics (new / continue / return) per turn."),
    memory: bool = typer.Option(True, "--memory/--no-memory",
                                help="Archive evicted KV and re-inject it when its topic or an entity returns."),
    graph: bool = typer.Option(True, "--graph/--no-graph", help="Entity graph, profile and running summary as notes "
                               "in the permanent tier; references steer recall."),
    session: Optional[str] = typer.Option(None, "--session", help="Session directory: resumed if it holds one "
                                          "(its saved options win), else created; saved after every reply."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    weights: str = WeightsOpt,
) -> None:
    """Chat in the terminal. Commands: /stats, /memory, /save [DIR], /sessions, /reset, /quit. Ctrl-C stops a
    reply (it is kept); at the prompt, Ctrl-C or Ctrl-D quits. Piped stdin: one message per line."""
    from agent import Agent, AgentConfig, SamplingConfig
    from agent.session import MANIFEST
    from cache.policies import Budget
    from cache.storage import StorageConfig
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    if session is not None and Path(session).exists() and not Path(session).is_dir():
        raise UserError(f"--session {session}: not a directory")
    if session is not None and (Path(session) / MANIFEST).exists():
        agent = Agent.load(session, device=None if device == "auto" else device)
        typer.echo(f"(resumed session {session}: {agent.turn_index} turns, policy {agent.config.policy}, "
                   f"budget {agent.config.budget_tokens})", err=True)
        run_chat(agent)
        return
    config = AgentConfig(model=model, device=device, dtype=dtype, weights=weights, policy=policy,
                         budget_tokens=Budget.parse(budget).tokens(), system=system,
                         storage=StorageConfig(kv_dtype, paged=paged), topics=topics,
                         memory=MemoryConfig() if memory else None, graph=graph,
                         profile=ProfileConfig() if graph else None,
                         sampling=SamplingConfig(max_new_tokens, temperature, top_p, top_k, seed))
    agent = Agent.from_pretrained(config)
    if session is not None:
        agent.save(session)
    run_chat(agent)


def run_chat(agent) -> None:
    """The chat loop over standard input; with a session, every reply is saved, and so is the end."""
    from memory.files import ArchiveError

    interactive = sys.stdin.isatty()
    warned = False
    if interactive:
        typer.echo(f"{agent.loaded.name} · policy {agent.config.policy} · budget {agent.config.budget_tokens}. "
                   "/stats /memory /save /sessions /reset /quit")
    while True:
        if interactive:
            typer.echo("you> ", nl=False)
        try:
            raw = sys.stdin.buffer.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt quits, like Ctrl-D
            typer.echo("")
            break
        if not raw:
            break
        line = raw.decode("utf-8", errors="replace")
        if "\ufffd" in line and not warned and "\ufffd".encode() not in raw:
            typer.echo("(input was not valid UTF-8: undecodable bytes were replaced with \ufffd)", err=True)
            warned = True
        message = line.strip()
        if not message:
            continue
        if message == "/quit":
            break
        if message == "/reset":
            agent.reset()
            if agent.session_dir is not None:
                agent.save(overwrite=True)  # the session directory now holds the new conversation
            typer.echo("(conversation reset)")
            continue
        if message == "/save" or message.startswith("/save "):
            target = message[len("/save"):].strip() or None
            if target is None and agent.session_dir is None:
                typer.echo("(no session yet: /save DIR, or start with --session DIR)")
            else:
                try:
                    typer.echo(f"(saved to {agent.save(target)})")
                except (OSError, ArchiveError) as error:
                    typer.echo(f"(not saved: {error})")
            continue
        if message == "/sessions":
            typer.echo("\n".join(session_lines(agent)))
            continue
        if message == "/stats":
            typer.echo("\n".join(stats_lines(agent.stats())))
            continue
        if message == "/memory":
            typer.echo("\n".join(memory_lines(agent)))
            continue
        typer.echo("palace> ", nl=False)
        if stream_reply(agent, message):
            typer.echo("\n(interrupted: the partial reply is kept)")
        else:
            typer.echo("")
        save_quietly(agent)
    save_quietly(agent)


def save_quietly(agent) -> None:
    """Save the chat's session, if it has one; a failed save (a full disk) is one line, the chat goes on
    and the previous save stays as it was."""
    from memory.files import ArchiveError

    if agent.session_dir is not None:
        try:
            agent.save()
        except (OSError, ArchiveError) as error:
            typer.echo(f"(not saved: {error})", err=True)


def stream_reply(agent, message: str) -> bool:
    """Print the reply as it streams; Ctrl-C meanwhile ends it at the next token (the turn completes
    with what was said). Returns whether it was interrupted."""
    interrupted = False

    def on_sigint(signum, frame) -> None:
        nonlocal interrupted
        interrupted = True
        agent.interrupt()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        for piece in agent.stream(message):
            typer.echo(piece, nl=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    return interrupted


def session_lines(agent) -> list[str]:
    """What `/sessions` shows: the sessions beside this one (in its parent directory), newest first."""
    from agent.session import list_sessions

    if agent.session_dir is None:
        return ["(no session: start with --session DIR, or /save DIR)"]
    root = agent.session_dir.resolve().parent
    rows = [f"sessions in {root}:"]
    for info in list_sessions(root):
        here = " (this one)" if info.path.resolve() == agent.session_dir.resolve() else ""
        rows.append(f"  {info.path.name}{here}: " + (info.problem or f"{info.turns} turns, saved {info.saved_at}, "
                                                    f"{info.model}, {info.policy}"))
    return rows


def stats_lines(stats: dict, indent: str = "") -> list[str]:
    """`/stats` as a readable table: one aligned row per figure, nested figures indented under their name,
    lists one item per row (the notes' text is shown by /memory)."""
    lines = []
    width = max((len(key) for key in stats), default=0)
    for key, value in stats.items():
        if key == "notes":
            continue
        if isinstance(value, dict):
            lines.append(f"{indent}{key}")
            lines += stats_lines(value, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"{indent}{key}")
            lines += [f"{indent}  - " + ", ".join(f"{k} {v}" for k, v in item.items()) for item in value]
        else:
            shown = ", ".join(map(str, value)) if isinstance(value, list) else value
            lines.append(f"{indent}{key:<{width}}  {shown}")
    return lines


def memory_lines(agent) -> list[str]:
    """What `/memory` shows: the notes in the permanent tier, facts (superseded ones marked), the last
    turn's resolved references and what the last recall brought back."""
    lines = []
    if agent.graph is None and agent.memory is None:
        return ["(memory is off: --memory / --graph)"]
    if agent.notes:
        lines += ["notes in the permanent tier:", *("  " + line for line in agent.notes.splitlines())]
    if agent.graph is not None:
        for fact in agent.graph.facts:
            state = "current" if fact.current else f"superseded at turn {fact.invalid_from_turn} by {fact.superseded_by!r}"
            lines.append(f"fact  {fact.attribute}: {fact.value!r} (from turn {fact.valid_from_turn}, {state})")
        for resolution in agent.graph.resolutions.get(agent.turn_index - 1, []):
            lines.append(f"ref   {resolution.span!r} -> {resolution.entity!r} (named at turn {resolution.antecedent})")
    if agent.memory is not None:
        for recalled in agent.memory.last:
            lines.append(f"recalled turn {recalled.turn} ({recalled.reason}: {recalled.detail}), {recalled.tokens} tokens")
        lines.append(f"archive: {len(agent.memory.archive)} segments")
    return lines or ["(nothing remembered yet)"]


@app.command()
def info(model: str = ModelOpt, device: str = DeviceOpt, dtype: str = DtypeOpt) -> None:
    """Model, device, dtype, layers, KV heads, head dim and bytes per cached token."""
    from agent.model import head_dim, load_model

    loaded = load_model(model, device, dtype)
    config = loaded.config
    rows = {
        "model": loaded.name,
        "family": config.model_type,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "layers": config.num_hidden_layers,
        "query_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": head_dim(config),
        "bytes_per_cached_token": loaded.kv_bytes_per_token(),
        "bytes_per_token_without_gqa": loaded.kv_bytes_per_token(gqa=False),
    }
    for key, value in rows.items():
        typer.echo(f"{key:28} {value}")


class LineProgress:
    """`palace eval`'s progress where stderr is a log file, not a terminal: a line per policy and dialogue done
    (rich draws its bars there only when the run ends, so a long run would look hung)."""

    def __init__(self) -> None:
        self.tasks: list[list] = []
        self.started = time.monotonic()

    def add_task(self, name: str, total: int) -> int:
        self.tasks.append([name, 0, total])
        return len(self.tasks) - 1

    def advance(self, task: int) -> None:
        self.tasks[task][1] += 1
        name, done, total = self.tasks[task]
        typer.echo(f"{name} {done}/{total} {time.monotonic() - self.started:.0f} s", err=True)


@app.command("eval")
def eval_(
    files: list[str] = typer.Argument(..., help="Dialogue files (.json/.jsonl) or directories of them."),
    policy: str = typer.Option("full,window,sink,h2o,hybrid,reprefill",
                               help="Comma-separated: full, window, sink, h2o, hybrid, reprefill; "
                               "window+memory, sink+memory, h2o+memory, hybrid+memory add long-term memory "
                               "(+memory-text: recalled turns re-prefilled as text, the baseline; +memory-recompute: the +memory run, its "
                               "probes scored on its cache's tokens re-encoded; +graph, +notes, "
                               "+palace: the memory palace's parts; +palace-keep: the palace leaving what corrections superseded in "
                               "the cache; hybrid+topics: no memory, whole topic segments evicted)."),
    budget: str = typer.Option("25%", help="KV budget: tokens (1024) or a share of the longest full dialogue cache (25%)."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="Dtype the KV cache is stored in (auto: the model's)."),
    mode: str = typer.Option("choice", help="choice (score the probe's choices) or generate (greedy reply)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="Write a PNG figure here."),
    map_id: Optional[str] = typer.Option(None, "--map", help="Dialogue id for the residency map (default: the first)."),
    limit: Optional[int] = typer.Option(None, min=1, help="Evaluate only the first N dialogues."),
    workers: int = typer.Option(0, min=0, help="Worker processes, each with its own dialogues (0: one per CPU core, "
                                "at most 8; 1 on a GPU). Timings are per worker."),
    memory_placement: str = typer.Option("end", "--memory-placement",
                                         help="+memory: where re-injected KV goes: end (before the user's "
                                         "words) or chronological."),
    memory_unit: str = typer.Option("message", "--memory-unit",
                                    help="+memory: what an evicted stretch is embedded as, message or span."),
    memory_share: Optional[float] = typer.Option(None, "--memory-share",
                                                 help="+memory: most of the budget one recall re-injects (default: "
                                                 "MemoryConfig.share)."),
    memory_threshold: Optional[float] = typer.Option(None, "--memory-threshold",
                                                     help="+memory: least cosine similarity of an archived message "
                                                     "to the user's turn for it to be recalled as similar "
                                                     "(default: MemoryConfig.threshold)."),
    notes_placement: str = typer.Option("newest", "--notes-placement",
                                        help="+notes, +palace: where the notes' KV sits: newest (encoded before "
                                        "the next user turn) or front (after the system prompt, the rest "
                                        "re-rotated)."),
    notes_corrections: Optional[int] = typer.Option(None, "--notes-corrections", min=0,
                                                    help="+notes, +palace: the newest corrected values the notes' cap "
                                                    "left out, listed beyond it (default: ProfileConfig.corrections)."),
    model: str = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 where it is fast: CUDA, or a CPU with AMX "
                              "or AVX-512 BF16; else float32), float32, bfloat16 or float16."),
) -> None:
    """Run scripted dialogues under each cache policy and compare accuracy, memory and latency."""
    from contextlib import nullcontext

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.eval.dialogue import load_dialogues
    from agent.eval.harness import EvalConfig, evaluate
    from agent.model import load_model
    from agent.eval.report import plot, table
    from agent.eval.workers import ModelSpec, WorkerPool, default_workers
    from cache.policies import Budget
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    make_parents(json_path, plot_path)  # before the run, not after it
    dialogues = load_dialogues(files)[:limit]
    config = EvalConfig(policies=[p.strip() for p in policy.split(",")], budget=Budget.parse(budget),
                        kv_dtype=kv_dtype, mode=mode, map_dialogue=map_id,
                        memory=MemoryConfig(placement=memory_placement, unit=memory_unit, **{
                            name: value for name, value in (("share", memory_share), ("threshold", memory_threshold))
                            if value is not None}), notes=ProfileConfig(placement=notes_placement, **(
                                {} if notes_corrections is None else {"corrections": notes_corrections})))
    loaded = load_model(model, device, dtype)
    workers = workers or default_workers(loaded.device, len(dialogues))
    pool = WorkerPool(ModelSpec(model, device, dtype), workers) if workers > 1 else None
    columns = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bars = Progress(*columns, console=Console(stderr=True)) if sys.stderr.isatty() else nullcontext(LineProgress())
    with bars as progress:
        result = evaluate(loaded, dialogues, config, progress, pool)
    Console(width=None if sys.stdout.isatty() else 200).print(table(result))  # piped: no truncated columns
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            json.dump(result.to_json(), out, indent=1)
    if plot_path:
        plot(result, plot_path)


data_app = typer.Typer(no_args_is_help=True, help="Scripted dialogue files.")
app.add_typer(data_app, name="data")


@data_app.command("check")
def data_check(files: list[str] = typer.Argument(..., help="Dialogue files or directories.")) -> None:
    """Validate dialogue files: one line per file with its counts, or the first problem found."""
    from agent.eval.dialogue import DialogueError, load_dialogues

    try:
        for path in files:
            dialogues = load_dialogues([path])
            turns = [turn for d in dialogues for turn in d.turns]
            probes = sum(turn.probe is not None for turn in turns)
            typer.echo(f"{path}: ok · {len(dialogues)} dialogues · {len(turns)} turns · {probes} probes")
        load_dialogues(files)  # ids must also be unique across the files
    except DialogueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="Small sizes (histories 256 and 1024): a smoke run."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write every row as JSON here."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    parts: str = typer.Option("ab", "--parts", help="Letters of abc: a (engine speed), b (KV strategies), c (memory work per turn)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Part B: time every strategy this many times, "
                                         "interleaved, and report the median (default 3; 1 with --quick)."),
    soak: Optional[int] = typer.Option(None, "--soak", min=10, help="Instead: a soak of this many turns (1000 in the "
                                       "README) in one saved session with memory on: budget, RSS, archive disk and TTFT."),
    memory_dialogue: Optional[str] = typer.Option(None, "--memory-dialogue", help="Part C: the first dialogue of this "
                                                  "file (default: data/dialogues.jsonl)."),
    memory_dtype: str = typer.Option("float32", "--memory-dtype", help="Part C: the model's and the KV's dtype: "
                                     "float32, bfloat16, or auto (what `palace eval` picks on this machine)."),
    memory_count: Optional[int] = typer.Option(None, "--memory-count", help="Part C: the file's first this "
                                                   "many dialogues, the two runs alternated; percentiles over all their turns (default 1)."),
    model: str = ModelOpt,
) -> None:
    """Engine vs transformers generate() (float32, int8 and int4 weights), and KV strategies at 2K/8K of history."""
    from agent.bench.bench import BenchConfig, run_bench

    if soak is not None:
        run_soak_command(soak, model, threads, json_path)
        return
    if not parts or set(parts) - set("abc"):
        raise UserError(f"--parts takes letters of abc (a: engine, b: KV strategies, c: memory per turn), got {parts!r}")
    if memory_dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"--memory-dtype takes float32, bfloat16 or auto, got {memory_dtype!r}")
    if memory_count is not None and memory_count < 1:
        raise UserError(f"--memory-count takes a number of dialogues, 1 or more, got {memory_count}")
    config = BenchConfig.preset(quick, threads=threads, parts=parts, rounds=rounds, memory_dialogue=memory_dialogue,
                                memory_dtype=memory_dtype, memory_count=memory_count)
    if "c" in parts:
        from agent.bench.memory_part import DEFAULT_DIALOGUE, scripted_turns
        from agent.eval.dialogue import DialogueError

        try:
            scripted_turns(Path(memory_dialogue or DEFAULT_DIALOGUE), config.memory_turns, config.memory_count)
        except DialogueError as exc:
            raise UserError(f"part C: {exc}") from None
    make_parents(json_path)
    run_bench(config, model, json_path, typer.echo)


def run_soak_command(turns: int, model: str, threads: int | None, json_path: str | None) -> None:
    import torch

    from agent.bench.soak import SoakConfig, render_soak, run_soak
    from agent.model import load_model

    if threads:
        torch.set_num_threads(threads)
    make_parents(json_path)
    result = run_soak(load_model(model, "cpu"), SoakConfig(turns=turns), typer.echo)
    typer.echo("\n".join(render_soak(result)))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


@app.command()
def train(
    data: Optional[list[str]] = typer.Argument(None, help="Labelled dialogue files or folders (default: "
                                               "data/dialogues.jsonl, data/topics/ and data/dev/)."),
    out: Optional[str] = typer.Option(None, "--out", help="Model file (topics default: data/models/topics.json; "
                                      "persistence: saved only when given)."),
    test_share: float = typer.Option(0.25, "--test-share", min=0.05, max=0.9, help="Share of dialogues held out."),
    seed: int = typer.Option(0, help="Seed of the held-out split."),
    rounds: int = typer.Option(2, min=0, help="Rounds of training on the classifier's own online states (DAgger)."),
    what: str = typer.Option("topics", "--what", help="topics (the topic-boundary classifier) or persistence "
                             "(the persistence marker's clause model)."),
    evaluate: Optional[list[str]] = typer.Option(None, "--eval", help="persistence: annotated dialogues to print "
                                                 "precision and recall on (default: data/heldout/)."),
    weight: Optional[list[str]] = typer.Option(None, "--weight", help="topics: PATH=K, the dialogues loaded through "
                                               "PATH count K times (default: every dialogue once)."),
    refit: bool = typer.Option(False, "--refit", help="topics: after the held-out figures, fit again on every "
                               "dialogue and save that model."),
    cv: Optional[str] = typer.Option(None, "--cv", help="topics: instead of training, cross-validate the weight of "
                                     "this folder's dialogues (one of DATA) and print a row per weight."),
    cv_weights: str = typer.Option("0,1,3,6", "--cv-weights", help="topics, with --cv: the weights to compare."),
    folds: int = typer.Option(5, "--folds", min=2, help="topics, with --cv: the number of folds."),
) -> None:
    """Train the topic-boundary classifier (print Pk, WindowDiff, boundary F1 and return accuracy on a
    held-out split next to two baselines) or the persistence marker (print span precision and recall on
    held-out annotated dialogues); save the model."""
    make_parents(out)
    if what == "persistence":
        from classifiers.annotations import train_persistence
        from classifiers.train import ROOT

        train_persistence(data or [str(ROOT / "data" / "dialogues.jsonl"), str(ROOT / "data" / "dev")],
                          evaluate or [str(ROOT / "data" / "heldout")], out, typer.echo)
        return
    if what != "topics":
        raise UserError(f"--what takes topics or persistence, got {what!r}")
    from classifiers.train import train_command

    if cv is not None:
        from classifiers.train import DEFAULT_DATA, cross_validate

        try:
            grid = [float(w) for w in cv_weights.split(",")]
        except ValueError:
            raise UserError(f"--cv-weights takes numbers separated by commas, got {cv_weights!r}") from None
        cross_validate(data or DEFAULT_DATA, cv, grid, folds, seed, rounds, typer.echo)
        return
    train_command(data, out, test_share, seed, rounds=rounds, weights=parse_weights(weight), refit=refit,
                  echo=typer.echo)


def parse_weights(items: list[str] | None) -> dict[str, float] | None:
    """`--weight PATH=K` items as {PATH: K}; None when none are given (the defaults then apply)."""
    if not items:
        return None
    weights = {}
    for item in items:
        path, _, value = item.rpartition("=")
        try:
            weights[path] = float(value)
        except ValueError:
            weights[path] = -1.0  # not a number: refused below
        if not path or weights[path] < 0:
            raise UserError(f"--weight takes PATH=K with K a number >= 0, got {item!r}")
    return weights


@app.command()
def refs(
    files: list[str] = typer.Argument(..., help="Dialogue files or folders with `refs` annotations."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the table and every reference's resolution here."),
) -> None:
    """Resolve every annotated reference with the entity graph; print accuracy by reference type, and how its
    corrections stand at the superseded-tagged probes."""
    from classifiers.annotations import load_dialogues, score_corrections, score_references

    make_parents(json_path)
    dialogues = load_dialogues(files)
    report = {**score_references(dialogues, typer.echo), "corrections": score_corrections(dialogues, typer.echo)}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))


@app.command()
def topics(
    files: list[str] = typer.Argument(..., help="Dialogue files (.json/.jsonl) or folders of them."),
    model: Optional[str] = typer.Option(None, "--model", help="Topic model file (default: data/models/topics.json)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the figures and per-turn predictions here."),
    baselines: bool = typer.Option(False, "--baselines", help="Also score the TextTiling and every-turn baselines."),
    quiet: bool = typer.Option(False, "--quiet", help="Only the summary, not every turn."),
) -> None:
    """Classify every user turn (new / continue / return:<k>) next to the file's topic labels."""
    from classifiers.train import topics_command

    make_parents(json_path)
    topics_command(files, model, json_path, baselines, quiet, echo=typer.echo)


def main() -> None:
    """Entry point: every expected failure becomes one line on stderr, never a traceback."""
    from agent.allocator import keep_freed_memory
    from agent.model import ModelError
    from memory.files import ArchiveError

    keep_freed_memory()
    try:
        app()
    except (UserError, ModelError, ArchiveError, ValueError, FileNotFoundError) as exc:  # TopicModelError is a ValueError
        typer.echo(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
