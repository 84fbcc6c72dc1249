"""Scripted dialogues for evaluation (format: docs/dialogue-format.md).

The files are a contract with people who write dialogues by hand, so loading is strict:
a malformed probe would otherwise skew accuracy silently. Every problem raises a
DialogueError whose one-line message names the file, the dialogue and the turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

PROBE_KINDS = ("recall", "coreference", "preference", "topic-return", "summary")


class DialogueError(ValueError):
    """A dialogue file is missing, unreadable or breaks the format."""


@dataclass
class Probe:
    kind: str
    choices: list[str]
    answer: int
    expect: list[str] = field(default_factory=list)
    forbid: list[str] = field(default_factory=list)
    evidence: list[int] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)


@dataclass
class ScriptedTurn:
    user: str
    assistant: str | None = None
    topic: str | None = None
    probe: Probe | None = None


@dataclass
class Dialogue:
    id: str
    system: str | None
    turns: list[ScriptedTurn]


def load_dialogues(paths: list[str | Path]) -> list[Dialogue]:
    """Load and validate every dialogue in `paths` (.json/.jsonl files or directories of them)."""
    dialogues: list[Dialogue] = []
    first_seen: dict[str, Path] = {}
    for file in dialogue_files(paths):
        for where, raw in _records(file):
            dialogue = _dialogue(raw, f"{file}: {where}", file)
            if dialogue.id in first_seen:
                raise DialogueError(
                    f"{file}: dialogue {dialogue.id}: duplicate id (already in {first_seen[dialogue.id]})"
                )
            first_seen[dialogue.id] = file
            dialogues.append(dialogue)
    return dialogues


def dialogue_files(paths: list[str | Path]) -> list[Path]:
    if not paths:
        raise DialogueError("no dialogue files given")
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
            if not found:
                raise DialogueError(f"{path}: directory holds no .json or .jsonl dialogue files")
            files += found
        elif not path.is_file():
            raise DialogueError(f"{path}: no such file or directory")
        elif path.suffix not in (".json", ".jsonl"):
            raise DialogueError(f"{path}: not a .json or .jsonl file")
        else:
            files.append(path)
    return files


def _records(file: Path) -> Iterator[tuple[str, Any]]:
    """Yield (location, parsed JSON) for each dialogue record in `file`."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DialogueError(f"{file}: cannot read: {e}") from None
    if file.suffix == ".jsonl":
        records = [(f"line {n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        records = [("document", text)]
    if not records:
        raise DialogueError(f"{file}: holds no dialogues")
    for where, source in records:
        try:
            value = json.loads(source)
        except json.JSONDecodeError as e:
            raise DialogueError(f"{file}: {where}: invalid JSON: {e}") from None
        if file.suffix == ".json" and isinstance(value, list):
            if not value:
                raise DialogueError(f"{file}: holds no dialogues")
            yield from ((f"dialogue #{i}", item) for i, item in enumerate(value))
        else:
            yield where, value


def _dialogue(raw: Any, where: str, file: Path) -> Dialogue:
    _check(isinstance(raw, dict), where, "a dialogue must be a JSON object")
    _check("id" in raw, where, "missing required key 'id'")
    _check(isinstance(raw["id"], str) and raw["id"].strip() != "", where, "'id' must be a non-empty string")
    where = f"{file}: dialogue {raw['id'] if raw['id'].isprintable() else json.dumps(raw['id'])}"
    system = raw.get("system")
    _check(system is None or isinstance(system, str), where, "'system' must be a string")
    turns = raw.get("turns")
    _check(isinstance(turns, list) and len(turns) > 0, where, "'turns' must be a non-empty list")
    return Dialogue(raw["id"], system, [_turn(t, i, f"{where}, turn {i}") for i, t in enumerate(turns)])


def _turn(raw: Any, index: int, where: str) -> ScriptedTurn:
    _check(isinstance(raw, dict), where, "a turn must be a JSON object")
    user = raw.get("user")
    _check(isinstance(user, str) and user.strip() != "", where, "'user' must be a non-empty string")
    for key in ("assistant", "topic"):
        _check(raw.get(key) is None or isinstance(raw[key], str), where, f"'{key}' must be a string")
    probe = raw.get("probe")
    return ScriptedTurn(user, raw.get("assistant"), raw.get("topic"), None if probe is None else _probe(probe, index, where))


def _probe(raw: Any, index: int, where: str) -> Probe:
    _check(isinstance(raw, dict), where, "'probe' must be a JSON object")
    kind = raw.get("kind")
    _check(kind in PROBE_KINDS, where, f"probe.kind {json.dumps(kind)} is not one of {', '.join(PROBE_KINDS)}")
    choices = raw.get("choices")
    _check(
        isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices),
        where,
        "probe.choices must be a list of 2 or more non-empty strings",
    )
    answer = raw.get("answer")
    _check(_is_int(answer), where, "probe.answer must be an integer")
    _check(0 <= answer < len(choices), where, f"probe.answer {answer} is out of range for {len(choices)} choices")
    lists = {key: raw.get(key, []) for key in ("expect", "forbid", "tags")}
    for key, value in lists.items():
        _check(isinstance(value, list) and all(isinstance(s, str) for s in value), where, f"probe.{key} must be a list of strings")
    evidence = raw.get("evidence", [])
    _check(isinstance(evidence, list) and all(map(_is_int, evidence)), where, "probe.evidence must be a list of integers")
    for e in evidence:
        _check(0 <= e < index, where, f"probe.evidence {e} is not an earlier turn than {index}")
    return Probe(kind, choices, answer, lists["expect"], lists["forbid"], evidence, lists["tags"])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise DialogueError(f"{where}: {message}")
