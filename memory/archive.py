"""The long-term archive: segments' text and metadata in SQLite, their embeddings in a scoped FAISS index,
their KV in memory up to a cap and in files past it (memory/tiers.py), exact or int8 (memory/codec.py).

A session directory holds:
    archive.sqlite   metadata, text, token ids, per-token positions/importance/surprisal, embeddings,
                     the format version, the config and the save generation
    index.faiss      the vector index (memory/index.py), stamped with the generation it was saved at
    kv/<id>.kv       one KV file per segment (spilled, or flushed by save())

Durability is per save(): the SQLite transaction stays open between saves, and save() writes every KV
still only in memory, the index, then commits. A crash loses what was added since the last save and
nothing else: uncommitted spill files are deleted on open as strays, files of removed segments are
deleted only after the commit, and an index whose stamp is not the db's generation (a crash between the
index write and the commit) is rebuilt from the embeddings in the db. Single-threaded.

Disk cap (`disk_cap_bytes`): when the KV files of segments held only on disk pass it, the oldest such
segments are removed entirely (metadata, vector and file): an evicted memory is forgotten, not degraded.
Their files are unlinked at the next save(), after the commit that deletes their rows (an in-memory
archive, which has no durability to keep, unlinks them at once)."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from cache.meta import NOT_RECALLED, ROLES, TokenMeta
from cache.span import KVSpan
from memory import codec
from memory.files import ArchiveError, fsync_dir, fsync_file
from memory.index import IndexConfig, VectorIndex
from memory.segment import Record, Segment
from memory.tiers import KVTiers

FORMAT_VERSION = 2  # 2: per-token serials
DB_NAME, INDEX_NAME, KV_DIR = "archive.sqlite", "index.faiss", "kv"

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE segments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused, so an evicted id cannot alias a new segment
    user_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    role TEXT NOT NULL,
    turn INTEGER NOT NULL,
    topic INTEGER NOT NULL,
    text TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    tokens BLOB NOT NULL,       -- int64 little-endian
    positions BLOB NOT NULL,    -- int64
    importance BLOB NOT NULL,   -- float32
    surprisal BLOB NOT NULL,    -- float32
    serials BLOB NOT NULL,      -- int64: each token's index in the conversation stream
    dtype TEXT NOT NULL,        -- KV dtype as added: what get() returns by default
    codec TEXT NOT NULL,        -- how the KV is stored: float | int8
    embedding BLOB NOT NULL,    -- float32, to rebuild the index
    kv_file_bytes INTEGER       -- size of kv/<id>.kv, NULL while the KV is only in memory
);
CREATE INDEX segments_by_scope ON segments (user_id, session_id, topic, turn);
"""
METADATA_COLUMNS = "user_id, session_id, kind, role, turn, topic, text, n_tokens"
RECORD_COLUMNS = f"id, {METADATA_COLUMNS}"  # the fields of Record, in order
SQL_CHUNK = 500  # ids a query names at most (SQLite limits the parameters of one statement)


@dataclass(frozen=True)
class ArchiveConfig:
    index: IndexConfig = field(default_factory=IndexConfig)
    kv_codec: str = "float"  # "float": exact, in the dtype added; "int8": 0.27 of float32 bytes
    memory_cap_bytes: int = 256 * 2**20  # KV payload bytes held in memory
    disk_cap_bytes: int | None = None  # KV file bytes of segments held only on disk; None: unbounded

    def __post_init__(self) -> None:
        if self.kv_codec not in codec.CODECS:
            raise ValueError(f"kv_codec {self.kv_codec!r}: expected one of {', '.join(codec.CODECS)}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ArchiveConfig":
        fields = json.loads(text)
        return cls(index=IndexConfig(**fields.pop("index")), **fields)


class Archive:
    """Build with create() (a new archive, in a directory or in memory) or open() (a saved directory)."""

    def __init__(self, db: sqlite3.Connection, config: ArchiveConfig, index: VectorIndex, tiers: KVTiers,
                 directory: Path | None, scratch: tempfile.TemporaryDirectory | None, generation: int):
        self._db, self.config, self._index, self._tiers = db, config, index, tiers
        self.directory, self._scratch, self._generation = directory, scratch, generation
        db.create_function("casefold", 1, str.casefold, deterministic=True)

    @classmethod
    def create(cls, directory: str | Path | None = None, config: ArchiveConfig = ArchiveConfig()) -> "Archive":
        """A new, empty archive. Without a directory, SQLite runs in memory and spilled KV goes to a
        temporary directory removed by close()."""
        scratch = None
        if directory is None:
            scratch = tempfile.TemporaryDirectory(prefix="memory-archive-")
            db, kv_dir = sqlite3.connect(":memory:"), Path(scratch.name) / KV_DIR
        else:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            if (directory / DB_NAME).exists():
                raise ArchiveError(directory / DB_NAME, "an archive already exists here; use Archive.open")
            db, kv_dir = sqlite3.connect(directory / DB_NAME), directory / KV_DIR
        db.executescript(SCHEMA)
        db.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("format_version", str(FORMAT_VERSION)), ("generation", "0"), ("config", config.to_json())])
        db.commit()
        index = VectorIndex(config.index)
        if directory is not None:
            index.save(directory / INDEX_NAME, stamp=0)
        tiers = KVTiers(kv_dir, config.memory_cap_bytes, config.disk_cap_bytes)
        return cls(db, config, index, tiers, directory, scratch, generation=0)

    @classmethod
    def open(cls, directory: str | Path, config: ArchiveConfig | None = None) -> "Archive":
        """Reopen a saved archive; `config` replaces the stored one (caps, codec for new segments, index
        kind: a different index config rebuilds the index from the stored embeddings). A missing, corrupt
        or truncated file, or another format version, raises ArchiveError naming the file."""
        directory = Path(directory)
        db, generation, stored, files = _open_db(directory / DB_NAME)
        try:
            config = config or stored
            tiers = KVTiers(directory / KV_DIR, config.memory_cap_bytes, config.disk_cap_bytes, files)
            tiers.remove_strays()
            index, stamp = VectorIndex.load(directory / INDEX_NAME)
            if stamp != generation or index.config != config.index or index.ids() != set(files):
                index = VectorIndex(config.index)
                for segment_id, user_id, session_id, embedding in db.execute(
                        "SELECT id, user_id, session_id, embedding FROM segments ORDER BY id"):
                    index.add([segment_id], np.frombuffer(embedding, dtype="<f4"), user_id, session_id)
        except BaseException:
            db.close()
            raise
        return cls(db, config, index, tiers, directory, None, generation)

    def add(self, segment: Segment, embedding: np.ndarray) -> int:
        """Archive a copy of `segment` (its own id is ignored) under its embedding (a unit vector from
        the Embedder); returns the new segment id. May spill older KV to disk and, past the disk cap,
        remove the oldest disk-only segments (this very one, if its file alone exceeds the cap)."""
        vector = np.asarray(embedding, dtype=np.float32).reshape(-1)
        payload = codec.encode(segment.keys, segment.values, self.config.kv_codec)
        cursor = self._db.execute(
            f"INSERT INTO segments ({METADATA_COLUMNS}, tokens, positions, importance, surprisal, serials, dtype, codec,"
            " embedding) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (segment.user_id, segment.session_id, segment.kind, segment.role, segment.turn, segment.topic,
             segment.text, segment.n_tokens, _blob(segment.tokens, "<i8"), _blob(segment.positions, "<i8"),
             _blob(segment.importance, "<f4"), _blob(segment.surprisal, "<f4"), _blob(segment.serials, "<i8"),
             str(segment.keys.dtype).removeprefix("torch."), self.config.kv_codec, vector.astype("<f4").tobytes()))
        segment_id = cursor.lastrowid
        try:
            self._index.add([segment_id], vector, segment.user_id, segment.session_id)
        except ValueError:
            self._db.execute("DELETE FROM segments WHERE id = ?", (segment_id,))
            raise
        written, evicted = self._tiers.put(segment_id, payload)
        self._record_files(written)
        for old in evicted:
            self._forget(old)
        if evicted and self.directory is None:  # nothing here outlives the process: free their files now
            self._db.commit()
            self._tiers.commit()
        return segment_id

    def get(self, segment_id: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
            copy: bool = True) -> Segment:
        """The segment with its KV in `dtype` (default: the dtype it was added in; int8 is dequantized),
        every tensor on `device`. `copy=False` may hand out the archive's own KV tensors, to be read and
        never modified (a caller that gathers from them copies once instead of twice). KeyError if there is
        no such segment."""
        row = self._db.execute(
            f"SELECT {RECORD_COLUMNS}, tokens, positions, importance, surprisal, serials, dtype, codec FROM segments"
            " WHERE id = ?",
            (segment_id,)).fetchone()
        if row is None:
            raise KeyError(segment_id)
        payload, shared = self._tiers.get(segment_id)
        try:
            keys, values = codec.decode(payload, row[15], dtype or getattr(torch, row[14]), device, copy=shared and copy)
        except KeyError as error:
            raise ArchiveError(self._tiers.path(segment_id), f"holds no {error} tensor for {row[15]} KV") from error
        return Segment(
            user_id=row[1], session_id=row[2], kind=row[3], role=row[4], turn=row[5], topic=row[6], text=row[7],
            tokens=np.frombuffer(row[9], dtype="<i8").tolist(), positions=_tensor(row[10], "<i8", device),
            keys=keys, values=values, importance=_tensor(row[11], "<f4", device),
            surprisal=_tensor(row[12], "<f4", device), serials=_tensor(row[13], "<i8", device), id=row[0])

    def spans(self, segment_ids: list[int]) -> list[KVSpan]:
        """These segments as spans to splice (`Segment.to_span`), in the order given, their KV on the CPU in
        the dtype each was added in, possibly the archive's own tensors (to be read, never modified): one
        query for them all, each metadata column built once and cut into views. A recall reads dozens of
        small segments (a message the policy evicted piecemeal is archived in pieces), and one `get` each cost
        more in queries and objects than the KV bytes did (15-23 ms for 43-72 segments on a 2-core EPYC).
        KeyError for an id that is not here."""
        rows: dict[int, tuple] = {}
        for first in range(0, len(segment_ids), SQL_CHUNK):
            chunk = segment_ids[first:first + SQL_CHUNK]
            rows.update((row[0], row) for row in self._db.execute(
                "SELECT id, role, turn, topic, tokens, positions, importance, surprisal, serials, dtype, codec"
                f" FROM segments WHERE id IN ({', '.join('?' * len(chunk))})", chunk))
        missing = [segment_id for segment_id in segment_ids if segment_id not in rows]
        if missing:
            raise KeyError(missing[0])
        ordered = [rows[segment_id] for segment_id in segment_ids]
        column = lambda k, dtype: np.concatenate([np.frombuffer(row[k], dtype=dtype) for row in ordered])  # noqa: E731
        tokens = column(4, "<i8")
        lengths = [len(row[4]) // 8 for row in ordered]
        each = lambda values: torch.from_numpy(np.repeat(np.array(values, dtype=np.int64), lengths))  # noqa: E731
        count = len(tokens)
        columns = TokenMeta(torch.from_numpy(tokens), each([row[3] for row in ordered]), each([row[2] for row in ordered]),
                            each([ROLES[row[1]] for row in ordered]), torch.from_numpy(column(5, "<i8")),
                            torch.zeros(count, dtype=torch.bool), torch.from_numpy(column(6, "<f4")),
                            torch.from_numpy(column(7, "<f4")), torch.from_numpy(column(8, "<i8")),
                            torch.full((count,), NOT_RECALLED, dtype=torch.long))
        metas = [TokenMeta(*parts) for parts in zip(*(torch.split(getattr(columns, f.name), lengths)
                                                       for f in fields(TokenMeta)))]
        spans = []
        for row, meta in zip(ordered, metas):
            payload, _ = self._tiers.get(row[0])
            keys, values = codec.decode(payload, row[10], getattr(torch, row[9]), "cpu", copy=False)
            spans.append(KVSpan(meta, keys, values))
        return spans

    def record(self, segment_id: int) -> Record:
        """A segment's metadata without reading its KV; KeyError if there is no such segment."""
        row = self._db.execute(f"SELECT {RECORD_COLUMNS} FROM segments WHERE id = ?", (segment_id,)).fetchone()
        if row is None:
            raise KeyError(segment_id)
        return Record(*row)

    def search(self, query_embedding: np.ndarray, user_id: str, session_id: str, k: int = 5,
               threshold: float | None = None) -> list[tuple[int, float]]:
        """(segment_id, cosine score) of this user's and session's closest segments, best first."""
        return self._index.search(query_embedding, user_id, session_id, k, threshold)

    def segments_for(self, user_id: str, session_id: str, *, topic: int | None = None, turns: range | None = None,
                     contains: str | None = None, kind: str | None = None) -> list[Record]:
        """Metadata of this scope's segments, in dialogue order, filtered by topic segment, turn range
        (turns.start <= turn < turns.stop) and text containing `contains` (Unicode case-insensitive: an
        entity's name as written anywhere in the segment)."""
        clauses, params = ["user_id = ?", "session_id = ?"], [user_id, session_id]
        if topic is not None:
            clauses.append("topic = ?")
            params.append(topic)
        if turns is not None:
            if turns.step != 1:
                raise ValueError("turns must be a range with step 1")
            clauses.append("turn >= ? AND turn < ?")
            params += [turns.start, turns.stop]
        if contains is not None:
            clauses.append("instr(casefold(text), ?) > 0")
            params.append(contains.casefold())
        if kind is not None:
            clauses.append("kind = ?")
            params.append(kind)
        rows = self._db.execute(
            f"SELECT {RECORD_COLUMNS} FROM segments WHERE {' AND '.join(clauses)} ORDER BY turn, id", params)
        return [Record(*row) for row in rows]

    def remove(self, segment_id: int) -> None:
        """Delete a segment everywhere (its file goes at the next save()); KeyError if there is none."""
        if self._db.execute("SELECT 1 FROM segments WHERE id = ?", (segment_id,)).fetchone() is None:
            raise KeyError(segment_id)
        self._tiers.remove(segment_id)
        self._forget(segment_id)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._index

    def nbytes(self) -> int:
        """KV bytes held in memory (codes and scales; the tensors are the archive's own compact copies),
        which memory_cap_bytes bounds. Not counted: metadata in SQLite and the FAISS index (about 1.5 KB
        a segment plus its text)."""
        return self._tiers.nbytes()

    def disk_bytes(self) -> int:
        """Bytes of every file the archive has on disk: db, index and KV files (an in-memory archive:
        its spilled KV files)."""
        own = sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file()) if self.directory else 0
        return own + self._tiers.disk_bytes()

    def save(self) -> None:
        """Make everything added so far durable: KV files, then the index, then the commit, then the
        deletion of removed segments' files. An in-memory archive only commits."""
        if self.directory is not None:
            self._record_files(self._tiers.flush())
            generation = self._generation + 1
            self._db.execute("UPDATE meta SET value = ? WHERE key = 'generation'", (str(generation),))
            self._index.save(self.directory / INDEX_NAME, stamp=generation)
            self._db.commit()
            self._generation = generation
        else:
            self._db.commit()
        self._tiers.commit()

    def copy_to(self, directory: str | Path) -> None:
        """Write a saved copy of this archive, same segment ids, into `directory` (new or empty): an
        in-memory archive becomes a session's files. The copy's KV all goes to files; its metadata
        commit comes last, so a crash midway leaves a directory that Archive.open refuses."""
        directory = Path(directory)
        if (directory / DB_NAME).exists():
            raise ArchiveError(directory / DB_NAME, "an archive already exists here; copy into a new directory")
        self._db.commit()
        tiers = KVTiers(directory / KV_DIR, memory_cap=0)
        target = sqlite3.connect(directory / DB_NAME)
        try:
            self._db.backup(target)
            sizes: dict[int, int] = {}
            for (segment_id,) in target.execute("SELECT id FROM segments ORDER BY id"):
                sizes.update(tiers.put(segment_id, self._tiers.get(segment_id)[0])[0])
            tiers.flush()
            target.executemany("UPDATE segments SET kv_file_bytes = ? WHERE id = ?",
                               [(size, segment_id) for segment_id, size in sizes.items()])
            target.execute("UPDATE meta SET value = '1' WHERE key = 'generation'")
            self._index.save(directory / INDEX_NAME, stamp=1)
            target.commit()
        finally:
            target.close()
        fsync_file(directory / DB_NAME)
        fsync_dir(directory)

    def token_serials(self) -> dict[int, tuple[int, torch.Tensor]]:
        """Every segment's turn and token serials, by id: what a memory needs to tell archived tokens
        the cache holds from those it lost, without reading any KV."""
        return {segment_id: (turn, _tensor(serials, "<i8", "cpu"))
                for segment_id, turn, serials in self._db.execute("SELECT id, turn, serials FROM segments ORDER BY id")}

    def last_id(self) -> int:
        """The newest segment id ever given (0 for none), removed segments included."""
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'segments'").fetchone()
        return int(row[0]) if row else 0

    def remove_after(self, segment_id: int) -> int:
        """Remove the segments newer than `segment_id` and save: a session rolled back to a save made
        when that was the newest (their tokens are live again in its cache). Returns how many."""
        newer = [row[0] for row in self._db.execute("SELECT id FROM segments WHERE id > ?", (segment_id,))]
        for newer_id in newer:
            self.remove(newer_id)
        if newer:
            self.save()
        return len(newer)

    def close(self) -> None:
        """save(), then release the database (and an in-memory archive's temporary directory)."""
        self.save()
        self._db.close()
        if self._scratch is not None:
            self._scratch.cleanup()

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _forget(self, segment_id: int) -> None:
        self._db.execute("DELETE FROM segments WHERE id = ?", (segment_id,))
        self._index.remove([segment_id])

    def _record_files(self, written: dict[int, int]) -> None:
        self._db.executemany("UPDATE segments SET kv_file_bytes = ? WHERE id = ?",
                             [(size, segment_id) for segment_id, size in written.items()])


def _open_db(path: Path) -> tuple[sqlite3.Connection, int, ArchiveConfig, dict[int, int]]:
    """The checked database: its connection, save generation, stored config and KV file sizes."""
    if not path.is_file():
        raise ArchiveError(path, "no archive here (file missing)")
    db = sqlite3.connect(path)
    try:
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(check)
        meta = dict(db.execute("SELECT key, value FROM meta"))
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise ArchiveError(path, f"archive format version {meta.get('format_version')}; "
                                     f"this code reads version {FORMAT_VERSION}")
        generation, config = int(meta["generation"]), ArchiveConfig.from_json(meta["config"])
        files = dict(db.execute("SELECT id, kv_file_bytes FROM segments ORDER BY id"))
        unwritten = [segment_id for segment_id, size in files.items() if size is None]
        if unwritten:
            raise ArchiveError(path, f"segments {unwritten[:5]} have no KV file recorded")
        return db, generation, config, files
    except BaseException as error:
        db.close()
        if isinstance(error, (sqlite3.Error, KeyError, TypeError, ValueError)):
            raise ArchiveError(path, f"not a readable archive database ({type(error).__name__}: {error})") from error
        raise


def _blob(values: list[int] | torch.Tensor, dtype: str) -> bytes:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy() if dtype == "<f4" else values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype).tobytes()


def _tensor(blob: bytes, dtype: str, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(blob, dtype=dtype).copy()).to(device)
