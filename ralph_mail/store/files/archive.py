"""The archive of one inbox: what gc compacted out of it, kept for the audit trail.

An inbox's messages live at logical offsets that only grow (`ralph_mail.store.files.inbox`).
When gc drops the consumed front of an inbox, the bytes it drops are first appended to
``archive/<agent>.jsonl``, and made durable, so the inbox and its archive together hold
every message ever delivered to that agent, at the same logical offsets: the archive's
byte ``HEAD + i`` is logical offset ``start + i``. ``start`` is in a fixed-width first
line (``{"archive":1,"start":00000000000000000000}``), rewritten in place.

Crash safety: compaction appends under the inbox lock before it renames the new inbox
into place; an archive that is longer than the inbox's base (a compaction killed after
archiving, before the rename) is cut back to it before the next append, so nothing is
archived twice. Only `purge_before`, asked for by a person, removes archived messages.
"""

from __future__ import annotations

import os
import re
from typing import Final

from ralph_mail.errors import StoreError
from ralph_mail.message import last_ts
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import open_file, pread_all, replace_file, write_all

HEAD: Final = 43  # len(b'{"archive":1,"start":' + 20 digits + b'}\n')
_HEAD = re.compile(rb'\{"archive":1,"start":(\d{20})\}\n')
_COPY: Final = 1 << 24


def older(data: bytes, ts: str) -> int:
    """How many bytes at the front of ``data`` are whole lines older than ``ts``."""
    cut = 0
    for line in data.splitlines(keepends=True):
        stamp = last_ts(line)
        if stamp is not None and stamp >= ts:
            break
        cut += len(line)
    return cut


def _head(start: int) -> bytes:
    return b'{"archive":1,"start":%020d}\n' % start


class Archive:
    """The archive file of one inbox (opened on each use: archives are touched rarely)."""

    def __init__(self, dirs: TeamDirs, agent: str) -> None:
        self.dirs = dirs
        self.agent = agent
        self.name = f"{agent}.jsonl"

    @property
    def path(self) -> str:
        return str(self.dirs.path("archive", self.name))

    def _start(self, fd: int) -> tuple[int, int] | None:
        """(start, logical end) of an open archive, or None when it is empty."""
        size = os.fstat(fd).st_size
        if size < HEAD:
            return None
        found = _HEAD.fullmatch(pread_all(fd, HEAD, 0))
        if found is None:
            raise StoreError(f"archive {self.path} has no header: it was edited by hand")
        start = int(found.group(1))
        return start, start + size - HEAD

    def append(self, source: int, base: int, cut: int, drop_before: str | None = None) -> None:
        """Archive the ``cut`` bytes at the front of the inbox ``source`` (logical offsets
        ``base`` to ``base + cut``), durably. Run under the inbox lock.

        With ``drop_before`` (a ts; ``gc --purge-before``), the lines older than it are
        not archived: a person asked for them to go (a full disk can be freed so).
        """
        if drop_before is not None:
            self.purge_before(drop_before)
            skip = older(pread_all(source, cut, 0), drop_before)
            if skip and self._empty():  # nothing archived before them: drop them
                base, cut = base + skip, cut - skip
                if not cut:
                    return
                source_offset = skip
            else:
                source_offset = 0
        else:
            source_offset = 0
        fd = open_file(self.name, os.O_RDWR | os.O_CREAT, self.dirs.get("archive"))
        try:
            span = self._start(fd)
            if span is None:  # new: it starts where this compaction does
                os.ftruncate(fd, 0)
                os.pwrite(fd, _head(base), 0)
                start = base
            else:
                start, end = span
                if end < base:  # a gap (compacted before archives existed): relabel
                    start = base - (end - start)
                    os.pwrite(fd, _head(start), 0)
            os.ftruncate(fd, HEAD + base - start)  # cut back what a killed run archived
            os.lseek(fd, 0, os.SEEK_END)
            copied = 0
            while copied < cut:
                chunk = os.pread(source, min(cut - copied, _COPY), source_offset + copied)
                if not chunk:
                    raise StoreError(f"inbox of {self.agent!r} shrank while it was archived")
                write_all(fd, chunk)
                copied += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, offset: int, limit: int) -> tuple[bytes, int]:
        """Whole lines from logical ``offset`` (moved up to the archive's start when it
        is below), at most about ``limit`` bytes; ``(b"", offset)`` past the end."""
        try:
            fd = open_file(self.name, os.O_RDONLY, self.dirs.get("archive"))
        except FileNotFoundError:
            return b"", offset
        try:
            span = self._start(fd)
            if span is None:
                return b"", offset
            start, end = span
            offset = max(offset, start)
            if offset >= end:
                return b"", offset
            data = pread_all(fd, min(end - offset, limit), HEAD + offset - start)
            whole = data[: data.rfind(b"\n") + 1]
            if not whole and len(data) < end - offset:  # one line longer than the limit
                data = pread_all(fd, end - offset, HEAD + offset - start)
                whole = data[: data.rfind(b"\n") + 1]
            return whole, offset
        finally:
            os.close(fd)

    def read_line(self, offset: int, length: int) -> bytes | None:
        """The archived line of ``length`` bytes at logical ``offset``, or None."""
        data, start = self.read(offset, length)
        if start != offset or len(data) < length:
            return None
        line = data[:length]
        return line if line.endswith(b"\n") else None

    def _empty(self) -> bool:
        try:
            fd = open_file(self.name, os.O_RDONLY, self.dirs.get("archive"))
        except FileNotFoundError:
            return True
        try:
            span = self._start(fd)
            return span is None or span[0] == span[1]
        finally:
            os.close(fd)

    def purge_before(self, ts: str) -> int:
        """Drop the archived lines at the front whose ``ts`` is before ``ts``; return the
        logical offset the archive starts at afterwards. Run under the inbox lock."""
        try:
            fd = open_file(self.name, os.O_RDONLY, self.dirs.get("archive"))
        except FileNotFoundError:
            return 0  # nothing was ever archived
        try:
            span = self._start(fd)
            if span is None:
                return 0
            start, end = span
            body = pread_all(fd, end - start, HEAD)
        finally:
            os.close(fd)
        cut = older(body, ts)
        if cut:
            replace_file(self.name, _head(start + cut) + body[cut:], self.dirs.get("archive"))
        return start + cut
