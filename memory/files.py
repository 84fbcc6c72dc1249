"""The archive's file I/O: durable atomic writes, and the one error every unreadable stored file raises.

A write goes to a temporary file in the same directory, is fsynced, renamed over the target and the
directory fsynced: a crash leaves either the old file or the new one, never a torn mix, and the rename
is not persisted before the data it names (ext4's delayed allocation would otherwise allow a zero-length
file after a crash). `sync=False` leaves both fsyncs to the caller, who batches them (fsync_file for each
file, then fsync_dir once) before committing anything that refers to the files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

TEMP_SUFFIX = ".tmp"


class ArchiveError(Exception):
    """A stored file is missing, corrupt, truncated or of another format version. One line, naming the
    file, so a user can tell which file of a session directory to look at."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = Path(path)
        super().__init__(" ".join(f"{self.path}: {reason}".split()))


def atomic_write(path: Path, data: bytes | memoryview | Callable[[BinaryIO], None], sync: bool = True) -> None:
    """`data`: the bytes, or a function that writes them to the handle it is given (streamed: a large
    file is never held in memory whole)."""
    temp = path.with_name(path.name + TEMP_SUFFIX)
    with open(temp, "wb") as handle:
        data(handle) if callable(data) else handle.write(data)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(temp, path)
    if sync:
        fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    """Persist a file's contents, or (for a directory) the renames and unlinks in it."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


fsync_dir = fsync_file


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ArchiveError(path, f"cannot be read ({error.strerror or error})") from error
