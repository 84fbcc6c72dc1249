"""Sessions on disk: a conversation saved by `Agent.save(dir)` and continued by `Agent.load(dir)` without
re-encoding anything, the next reply token for token what the uninterrupted agent would have said.

A session directory holds:
    session.json     the manifest: format version, model identity, the agent's configuration, the
                     generation, the names of the current state file and archive, and the state
                     file's size and CRC32
    state-<g>.pt     the cache (KV and metadata, `KVStore.state`), the conversation, the topic tracker,
                     the entity graph, the running summary and the memory's message texts and vectors:
                     tensors and plain data only, read with torch.load(weights_only=True), so a tampered
                     file cannot run code
    archive-<n>/     the long-term archive (memory/archive.py: SQLite, FAISS index, KV files), when memory is on

A save is durable and atomic as a whole. The archive commits first (its own atomic point), then the
new state file is written (temporary file, fsync, rename), then the manifest that names both (the
commit point of the session), and only then are the previous state file and anything no manifest
names deleted. A crash at any moment leaves the previous manifest naming files that still exist; the
archive may then hold segments archived after that save, which `load` removes (the manifest records
the newest segment id the saved cache knows): their tokens are live again in the restored cache.
The first save of an agent whose archive is in memory copies it into a new `archive-<n>/` and
continues there, so later saves only add what is new.

Every unreadable file gives a SessionError (or the archive's ArchiveError): one line naming the file.
A directory is held by one agent at a time (an advisory lock on `lock`, taken by save and load and kept
while the agent is attached): two agents writing one archive would corrupt each other's turns."""

from __future__ import annotations

import dataclasses
import fcntl
import io
import os
import json
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memory.files import ArchiveError, atomic_write, fsync_dir, read_file

if TYPE_CHECKING:
    from agent.agent import Agent, AgentConfig
    from agent.model import LoadedModel

FORMAT_VERSION = 1
MANIFEST = "session.json"
LOCK = "lock"
KIND = "memory-palace session"


class SessionError(ArchiveError):
    """A session file is missing, corrupt, of another format version or for another model: one line."""


@dataclass(frozen=True)
class SessionInfo:
    """What `/sessions` lists: a directory and its manifest's summary, or why it cannot be read."""

    path: Path
    turns: int | None = None
    saved_at: str | None = None
    model: str | None = None
    policy: str | None = None
    problem: str | None = None


def model_identity(loaded: "LoadedModel") -> dict:
    """What a saved cache depends on: the model's name and KV geometry, and its dtype."""
    from agent.model import head_dim

    config = loaded.config
    return {"name": loaded.name, "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "head_dim": head_dim(config), "vocab": config.vocab_size, "dtype": str(loaded.dtype).removeprefix("torch.")}


def new_conversation_id() -> str:
    return uuid.uuid4().hex


class SessionLock:
    """The advisory lock an agent holds on its session directory (released by `release` or at exit)."""

    def __init__(self, directory: Path):
        self.directory = directory.resolve()
        self._fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise SessionError(directory, "is in use by another agent (this process or another one)") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _hold(agent: "Agent", directory: Path) -> None:
    """Make sure the agent holds `directory`'s lock (and no other)."""
    held = agent.session_lock
    if held is not None and held.directory == directory.resolve():
        return
    lock = SessionLock(directory)
    if held is not None:
        held.release()
    agent.session_lock = lock


# --- saving -------------------------------------------------------------------------------------------
def save(agent: "Agent", directory: str | Path, overwrite: bool = False) -> Path:
    """Save the agent's conversation into `directory` (see the module docstring). A directory holding
    another conversation's session is refused unless `overwrite`; the old one is replaced atomically."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SessionError(directory, f"cannot hold a session ({error.strerror or error})") from error
    _hold(agent, directory)
    old = None
    if (directory / MANIFEST).exists():
        try:
            old = _read_manifest(directory)
        except SessionError:
            if not overwrite:  # never write over a session that cannot even be read: it may be all there is
                raise
    if old is not None and old["conversation"] != agent.conversation_id and not overwrite:
        raise SessionError(directory, "holds another conversation's session: save into a new directory "
                                      "(or overwrite it, e.g. after /reset)")
    generation = (old["generation"] if old else 0) + 1
    archive = None
    if agent.memory is not None:
        agent.settle()
        name = old["archive"] if old and old["archive"] else None
        attached = name is not None and _same_dir(agent.memory.archive.directory, directory / name)
        if not attached:
            name = f"archive-{generation}"
            target = directory / name
            shutil.rmtree(target, ignore_errors=True)  # a copy a crashed save left unfinished
            agent.memory.archive.copy_to(target)
            from memory.archive import Archive

            agent.memory.attach(Archive.open(target, agent.memory.archive.config))
        else:
            agent.memory.archive.save()
        archive = {"name": name, "last_id": agent.memory.archive.last_id()}
    state_name, written = f"state-{generation}.pt", _Checksummed()
    atomic_write(directory / state_name, lambda handle: torch.save(_state(agent), written.over(handle)))
    manifest = {
        "kind": KIND, "format_version": FORMAT_VERSION, "generation": generation,
        "conversation": agent.conversation_id, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_identity(agent.loaded), "config": _config_dict(agent.config), "turns": agent.turn_index,
        "state": state_name, "state_bytes": written.size, "state_crc32": written.crc32,
        "archive": archive["name"] if archive else None, "archive_last_id": archive["last_id"] if archive else None,
    }
    atomic_write(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    _remove_unnamed(directory, manifest)
    return directory


class _Checksummed:
    """A file handle that counts and checksums what is written through it (the manifest records both)."""

    def __init__(self):
        self.handle, self.size, self.crc32 = None, 0, 0

    def over(self, handle) -> "_Checksummed":
        self.handle = handle
        return self

    def write(self, data) -> int:
        self.size += len(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """On the CPU, and not a view of a much larger buffer (torch.save writes a view's whole storage)."""
    tensor = tensor.detach().to("cpu")
    if tensor.untyped_storage().nbytes() > 1.25 * tensor.numel() * tensor.element_size():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _state(agent: "Agent") -> dict:
    from cache.store import _mapped

    return {
        "agent": {"turn_index": agent.turn_index, "notes": agent.notes,
                  "history": [{"index": t.index, "text": t.text, "segment": t.segment, "topic": t.topic,
                               "reply": t.reply} for t in agent.history]},
        "store": _mapped(agent.store.state(), _compact),
        "tracker": agent.tracker.state() if agent.tracker is not None else None,
        "graph": agent.graph.state() if agent.graph is not None else None,
        "summary": agent.summary.state() if agent.summary is not None else None,
        "memory": agent.memory.state() if agent.memory is not None else None,
    }


def _remove_unnamed(directory: Path, manifest: dict) -> None:
    """Delete state files and archives the manifest does not name (the previous save's, a crashed one's)."""
    keep = {manifest["state"], manifest["archive"], MANIFEST, LOCK}
    removed = False
    for path in directory.iterdir():
        if path.name in keep or not path.name.startswith(("state-", "archive-", MANIFEST)):
            continue
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed = True
    if removed:
        fsync_dir(directory)


def _same_dir(a: Path | None, b: Path) -> bool:
    return a is not None and Path(a).resolve() == b.resolve()


def _config_dict(config: "AgentConfig") -> dict:
    return json.loads(json.dumps(asdict(config)))


# --- loading ------------------------------------------------------------------------------------------
def load(directory: str | Path, loaded: "LoadedModel | None" = None, device: str | None = None) -> "Agent":
    """The agent a session directory holds, continuing where it was saved. `loaded`: a model already in
    memory (it must be the session's model); else the session's model is loaded, on `device` if given."""
    directory = Path(directory)
    manifest = _read_manifest(directory)
    lock = SessionLock(directory)
    try:
        agent = _load(directory, manifest, loaded, device)
    except BaseException:
        lock.release()
        raise
    agent.session_lock = lock
    return agent


def _load(directory: Path, manifest: dict, loaded: "LoadedModel | None", device: str | None) -> "Agent":
    from agent.agent import Agent

    config = config_from_dict(manifest["config"])
    if device is not None:
        config = dataclasses.replace(config, device=device)
    if loaded is None:
        from agent.model import load_model

        loaded = load_model(config.model, config.device, config.dtype, config.weights)
    identity = model_identity(loaded)
    if identity != manifest["model"]:
        differs = ", ".join(f"{key} {manifest['model'].get(key)!r} here {identity[key]!r}" for key in identity
                            if identity[key] != manifest["model"].get(key))
        raise SessionError(directory / MANIFEST, f"was saved for another model ({differs})")
    state = _read_state(directory / manifest["state"], manifest)
    agent = Agent(loaded, config)
    try:
        agent.restore(state, manifest["conversation"], device=loaded.device)
    except ValueError as error:  # a state this code cannot install (e.g. a quantized layer of an older layout)
        raise SessionError(directory / manifest["state"], str(error)) from error
    if agent.memory is not None:
        if not manifest["archive"]:
            raise SessionError(directory / MANIFEST, "names no archive, but the session's memory is on")
        from memory.archive import Archive

        archive = Archive.open(directory / manifest["archive"], agent.memory.archive.config)
        archive.remove_after(manifest["archive_last_id"])
        agent.memory.load_state(state["memory"], archive)
    return agent


def config_from_dict(data: dict) -> "AgentConfig":
    """An AgentConfig from its saved dict (nested configs rebuilt)."""
    from agent.agent import AgentConfig
    from agent.engine import SamplingConfig
    from cache.policies import HybridConfig
    from cache.storage import StorageConfig
    from memory.archive import ArchiveConfig
    from memory.profile import ProfileConfig
    from memory.recall import MemoryConfig

    memory = data.get("memory")
    if memory is not None:
        memory = MemoryConfig(**{**memory, "archive": ArchiveConfig.from_json(json.dumps(memory["archive"]))})
    profile = data.get("profile")
    return AgentConfig(**{**data, "storage": StorageConfig(**data["storage"]), "hybrid": HybridConfig(**data["hybrid"]),
                          "sampling": SamplingConfig(**data["sampling"]), "memory": memory,
                          "profile": ProfileConfig(**profile) if profile is not None else None})


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        raise SessionError(path, "no session here (file missing)")
    try:
        manifest = json.loads(read_file(path))
        kind, version = manifest.get("kind"), manifest.get("format_version")
    except (ValueError, AttributeError) as error:
        raise SessionError(path, f"not a readable session manifest ({type(error).__name__}: {error})") from error
    if kind != KIND:
        raise SessionError(path, "not a memory-palace session manifest")
    if version != FORMAT_VERSION:
        raise SessionError(path, f"session format version {version}; this code reads version {FORMAT_VERSION}")
    missing = [key for key in ("generation", "conversation", "model", "config", "state", "state_bytes", "state_crc32",
                               "archive", "archive_last_id", "turns") if key not in manifest]
    if missing:
        raise SessionError(path, f"session manifest lacks {', '.join(missing)}")
    return manifest


def _read_state(path: Path, manifest: dict) -> dict:
    data = read_file(path)
    if len(data) != manifest["state_bytes"] or zlib.crc32(data) != manifest["state_crc32"]:
        raise SessionError(path, f"session state is corrupt or truncated ({len(data)} bytes, "
                                 f"expected {manifest['state_bytes']} with CRC {manifest['state_crc32']})")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure is the file's
        raise SessionError(path, f"session state does not load ({type(error).__name__}: {error})") from error


def list_sessions(root: str | Path) -> list[SessionInfo]:
    """The session directories directly under `root`, newest first; a damaged one says why."""
    root = Path(root)
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).exists()) if root.is_dir() else []:
        try:
            manifest = _read_manifest(path)
            found.append(SessionInfo(path, manifest["turns"], manifest["saved_at"], manifest["model"]["name"],
                                     manifest["config"]["policy"]))
        except SessionError as error:
            found.append(SessionInfo(path, problem=str(error)))
    return sorted(found, key=lambda info: info.saved_at or "", reverse=True)
