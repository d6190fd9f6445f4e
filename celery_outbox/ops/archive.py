"""The archive a group purge writes before it deletes: an append-only JSON-lines file on a real disk.

The rule is the one in docs/operations.md ("Dead letters"): nothing is deleted that is not written to the
archive and flushed to disk first, whatever the file already holds and in whatever order groups are purged
into it. So the archive is checked before anything is deleted (a regular file or a new one in an existing
directory, not on ``/proc`` or ``/sys``, not ``-`` (stdout, by the command-line convention), and, when it
already holds something, holding only archive lines), a row is skipped only when its exact line is already in
the file (a purge resumed after a crash does not write a row twice; any other row is written, whatever ids the
file holds), and each batch is written and ``fsync``-ed before its delete is sent. A write or sync that fails
(a full disk) stops the purge before that batch is deleted. Every refusal is an ``ArchiveError`` naming the
file and the problem in one line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from typing import Any

from celery_outbox.errors import ArchiveError

_PSEUDO = ("/proc", "/sys")  # kernel views: writing there is never keeping a copy (and may change the kernel)
_CHUNK = 1 << 20
STDOUT = "-"  # what a command line means by this file name; a purge never archives to it (use ./- for a file)


def _digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=16).digest()


def encode(record: dict[str, Any]) -> bytes:
    """One archive line (without its newline): sorted keys, ASCII, so the same row is the same bytes."""
    return json.dumps(record, sort_keys=True, default=str).encode("ascii")


def _why(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "the disk is full"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "it cannot be written (permission denied or a read-only file system)"
    if e.errno == errno.ENOENT:
        return "its directory does not exist"
    if e.errno == errno.EISDIR:
        return "it is a directory"
    if e.errno == errno.ENOTDIR:
        return "a part of its path is not a directory"
    return e.strerror or e.__class__.__name__


class Archive:
    """An opened, checked archive file. ``open`` refuses a bad one; ``write`` appends lines and syncs them."""

    def __init__(self, *, path: str, fd: int, kept: set[bytes], cut: bool) -> None:
        self.path, self._fd, self._kept, self._cut = path, fd, kept, cut

    @classmethod
    def open(cls, raw: str | os.PathLike[str]) -> Archive:
        path = os.fspath(raw)
        if not path.strip():
            raise ArchiveError("--archive: the path is empty; name a JSON-lines file; nothing was deleted")
        if path == STDOUT:  # the command-line convention for stdout: a stream cannot be read back nor synced
            raise ArchiveError("--archive -: the archive is a file on a disk (read back to resume a purge, synced "
                               "before each delete), not stdout; name a JSON-lines file; nothing was deleted")
        real = os.path.realpath(path)
        if any(real == top or real.startswith(top + "/") for top in _PSEUDO):
            raise ArchiveError(f"archive {path}: {real.split('/')[1]} is a kernel view, not a disk; "
                               "name a file on a disk; nothing was deleted")
        try:
            st: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise ArchiveError(f"archive {path}: {_why(e)}; nothing was deleted") from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, a pipe or a socket, not a file"
            raise ArchiveError(f"archive {path}: it is {kind}; name a JSON-lines file; nothing was deleted")
        try:  # O_NONBLOCK: a pipe put there since the check fails here instead of waiting for a reader
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ArchiveError(f"archive {path}: {_why(e)}; nothing was deleted") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ArchiveError(f"archive {path}: it is not a regular file; nothing was deleted")
            kept, cut = _read(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path=path, fd=fd, kept=kept, cut=cut)

    def holds(self, line: bytes) -> bool:
        """This exact line is already in the file (written by an earlier run that did not finish)."""
        return _digest(line) in self._kept

    def write(self, lines: list[bytes]) -> None:
        """Append the lines and sync them to disk; any failure is an ``ArchiveError`` (and nothing is deleted)."""
        data = b"".join(line + b"\n" for line in lines)
        if self._cut:  # a line cut short by a crash: end it, so the next line is whole
            data = b"\n" + data
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as e:
            raise ArchiveError(f"archive {self.path}: {_why(e)}; the batch being written was not deleted") from None
        self._cut = False
        self._kept.update(_digest(line) for line in lines)

    def close(self) -> None:
        os.close(self._fd)


def _read(fd: int, path: str) -> tuple[set[bytes], bool]:
    """The digests of the file's lines, and whether it ends in a line cut short. Every whole line must be
    an archive line (a JSON object with an ``id``); only the last may be cut short (it starts with ``{``)."""
    kept: set[bytes] = set()
    pending = b""
    number = 0
    offset = 0
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        if not chunk:
            break
        offset += len(chunk)
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            number += 1
            if not line.strip():
                continue
            if not _is_archive_line(line):
                raise ArchiveError(f"archive {path}: line {number} is not a dead-letter archive line; "
                                   "name a new file or an earlier archive; nothing was deleted")
            kept.add(_digest(line))
    if pending and not pending.startswith(b"{"):
        raise ArchiveError(f"archive {path}: it is not a dead-letter archive (not JSON lines); "
                           "name a new file or an earlier archive; nothing was deleted")
    return kept, bool(pending)


def _is_archive_line(line: bytes) -> bool:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return False
    return isinstance(data, dict) and isinstance(data.get("id"), str)
