"""Where archived KV payloads live: in memory up to a byte cap, then one file per segment on disk.

- Memory tier: payloads in insertion order; past `memory_cap` bytes the oldest are spilled to their files
  and dropped from memory, so the bytes held never exceed the cap. A spill is an atomic write (temporary
  file, rename) whose fsyncs are batched into the next `flush`, which the caller runs before committing
  metadata that names the files: a spill costs a copy into the page cache, not a disk flush per turn,
  and a crash before the commit leaves only unreferenced files, deleted as strays on reopen. A spilled payload
  read back by `get` is not promoted back: the caller splices it into its live cache, and a second copy
  here would only push out newer ones.
- Disk tier: past `disk_cap` bytes of files, the oldest segments held only on disk are evicted: the caller
  deletes them (row and vector) and their files go at the next `commit()`. Files are deleted only after
  the caller's metadata commit, so a crash in between never leaves a committed row without its file.
  Until then they still occupy disk (disk_bytes counts them); the cap governs the live files. Files
  that `flush` writes for payloads still in memory count toward the cap but are not evicted while the
  payload is in memory, so right after a save the live files may exceed the cap until the next spill.

File format: MAGIC, the CRC32 of the rest (4 bytes, little-endian), then safetensors bytes (no pickle,
so a tampered file cannot run code). Reading checks magic and CRC before parsing."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from memory.codec import Payload, nbytes
from memory.files import TEMP_SUFFIX, ArchiveError, atomic_write, fsync_dir, fsync_file, read_file

MAGIC = b"MPALACE-KV1\n"
SUFFIX = ".kv"


class KVTiers:
    """Payloads by segment id. `files` (id -> size) are the files a reopened archive's metadata says
    exist; they are checked here by size, so a truncated file is reported on open, not mid-dialogue."""

    def __init__(self, directory: Path, memory_cap: int, disk_cap: int | None = None,
                 files: dict[int, int] | None = None):
        self.directory, self.memory_cap, self.disk_cap = directory, memory_cap, disk_cap
        self._memory: OrderedDict[int, Payload] = OrderedDict()
        self._memory_bytes = 0
        self._files: dict[int, int] = {}  # live files, oldest first
        self._doomed: list[int] = []  # files to delete at commit()
        self._unsynced: list[int] = []  # files written since the last flush()
        directory.mkdir(parents=True, exist_ok=True)
        for segment_id, size in sorted((files or {}).items()):
            path = self.path(segment_id)
            actual = path.stat().st_size if path.exists() else None
            if actual != size:
                raise ArchiveError(path, "KV file is missing" if actual is None
                                   else f"KV file is {actual} bytes, expected {size} (truncated or replaced)")
            self._files[segment_id] = size

    def path(self, segment_id: int) -> Path:
        return self.directory / f"{segment_id}{SUFFIX}"

    def __contains__(self, segment_id: int) -> bool:
        return segment_id in self._memory or segment_id in self._files

    def put(self, segment_id: int, payload: Payload) -> tuple[dict[int, int], list[int]]:
        """Hold a new payload; returns the files written by the spill it caused (id -> size) and the ids
        evicted for the disk cap (already gone from here; the caller deletes their metadata)."""
        if segment_id in self:
            raise ValueError(f"segment {segment_id} already has a payload")
        self._memory[segment_id] = payload
        self._memory_bytes += nbytes(payload)
        written: dict[int, int] = {}
        while self._memory_bytes > self.memory_cap:
            oldest, spilled = next(iter(self._memory.items()))
            if oldest not in self._files:  # written before it leaves memory: a failed write loses nothing
                written[oldest] = self._write(oldest, spilled)
            del self._memory[oldest]
            self._memory_bytes -= nbytes(spilled)
        return written, self._evict()

    def get(self, segment_id: int) -> tuple[Payload, bool]:
        """The payload and whether it is shared (the memory tier's own tensors, not to be modified)."""
        if segment_id in self._memory:
            return self._memory[segment_id], True
        if segment_id in self._files:
            return self._read(segment_id), False
        raise KeyError(segment_id)

    def remove(self, segment_id: int) -> None:
        payload = self._memory.pop(segment_id, None)
        if payload is not None:
            self._memory_bytes -= nbytes(payload)
        if self._files.pop(segment_id, None) is not None:
            self._doomed.append(segment_id)

    def flush(self) -> dict[int, int]:
        """Write a file for every payload held only in memory (they stay in memory too), then make every
        file written since the last flush durable; returns the files written now (id -> size)."""
        written = {segment_id: self._write(segment_id, payload)
                   for segment_id, payload in self._memory.items() if segment_id not in self._files}
        for segment_id in self._unsynced:
            if segment_id in self._files:
                fsync_file(self.path(segment_id))
        if self._unsynced:
            fsync_dir(self.directory)
        self._unsynced.clear()
        return written

    def commit(self) -> None:
        """Delete the files of removed and evicted segments, once the caller has committed their deletion."""
        for segment_id in self._doomed:
            self.path(segment_id).unlink(missing_ok=True)
        if self._doomed:
            fsync_dir(self.directory)
        self._doomed.clear()

    def remove_strays(self) -> None:
        """Delete files no metadata refers to: temporaries and spills of a session that crashed before
        committing them."""
        for path in (entry for entry in self.directory.iterdir() if entry.is_file()):
            stem = path.name.removesuffix(TEMP_SUFFIX).removesuffix(SUFFIX)
            if path.name.endswith(TEMP_SUFFIX) or not stem.isdigit() or int(stem) not in self._files:
                path.unlink()

    def nbytes(self) -> int:
        """Bytes of the payloads held in memory (tensor storage, scales included)."""
        return self._memory_bytes

    def disk_bytes(self) -> int:
        """Bytes of every file in the directory, including those awaiting deletion."""
        return sum(path.stat().st_size for path in self.directory.iterdir() if path.is_file())

    def _evict(self) -> list[int]:
        """Remove the oldest disk-only segments until the live files fit the disk cap; returns their ids."""
        if self.disk_cap is None:
            return []
        live = sum(self._files.values())
        evicted = []
        for segment_id, size in list(self._files.items()):
            if live <= self.disk_cap:
                break
            if segment_id not in self._memory:
                live -= size
                self.remove(segment_id)
                evicted.append(segment_id)
        return evicted

    def _write(self, segment_id: int, payload: Payload) -> int:
        body = save_tensors(payload)
        data = MAGIC + zlib.crc32(body).to_bytes(4, "little") + body
        atomic_write(self.path(segment_id), data, sync=False)
        self._files[segment_id] = len(data)
        self._unsynced.append(segment_id)
        return len(data)

    def _read(self, segment_id: int) -> Payload:
        path = self.path(segment_id)
        data = read_file(path)
        start = len(MAGIC) + 4
        if not data.startswith(MAGIC):
            raise ArchiveError(path, "not a KV file of this format version (bad magic)")
        body = data[start:]
        if len(data) != self._files[segment_id] or zlib.crc32(body) != int.from_bytes(data[len(MAGIC):start], "little"):
            raise ArchiveError(path, "KV file is corrupt or truncated (size or CRC mismatch)")
        try:
            return load_tensors(body)
        except SafetensorError as error:
            raise ArchiveError(path, f"KV file does not parse ({error})") from error
