"""The inbox log of the file backend: appends under flock, reads by logical offset,
tails, and compaction.

Locking. A sender takes ``flock(LOCK_EX)`` on the inbox itself, through a descriptor it
keeps open, around one append. The inbox is locked rather than a separate lock file so
that deleting or replacing a lock file can never split writers across two inodes: after
taking the lock a writer checks that the inode it locked is still linked, else it reopens.
flock is what filelock wraps on Linux; calling it directly costs 0.6 µs against
filelock's 49 µs per acquire (MEASUREMENTS.md §2). Readers take no lock at all, so a
stopped process holding the lock (SIGSTOP, Ctrl-Z) never blocks a reader; gc waits for
the lock with a bound.

Offsets and bases. Offsets are *logical*: the file offset plus the inbox's base. gc drops
consumed lines from the front and raises the base, so a cursor stays valid across it. The
base file (a slot file) records ``base, inode, previous base, previous inode``: the base
of the inode gc renames into place and the base of the inode it replaces, then the ts
of the last line the inbox had when gc made that inode: a writer that finds the inbox
empty stamps no earlier than that, so ts never decreases across gc. A reader finds
the base of the inode it opened in that record without a lock: gc writes the record
before its rename, so either inode finds its own base. An inode the record does not
name is an inbox made or replaced by something else than gc (the team re-created, a file
put in place by hand): its offsets start again at 0, and a reader that followed the old
inode continues at the new one's start. A sender reads the record once per inode it
writes to, after its first line there is written and its waiters rung (only the offset a
send returns needs it; an empty inode's last ts is read first), still under the lock, so
no gc can change it meanwhile. A sender that closes an inbox keeps what it knew (`Left`):
back at an inode as it left it, it reads neither the tail nor the record.

Compaction. Under the old inbox's LOCK_EX: copy the lines from the owner's committed
floor into ``tmp/``, fsync, write the base record, rename the copy over the inbox. A gc
killed between writing the base and the rename leaves a record that still describes the
inbox in place. Writers locked on the old inode see ``st_nlink == 0`` and reopen.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ralph_mail.errors import LockTimeout, StoreError
from ralph_mail.message import format_ts, last_ts
from ralph_mail.settings import TAIL_CHUNK_BYTES
from ralph_mail.store.base import Compaction
from ralph_mail.store.files.archive import Archive
from ralph_mail.store.files.bells import ring
from ralph_mail.store.files.layout import TeamDirs, log_place
from ralph_mail.store.files.posix import (
    copy_range,
    my_pid,
    open_file,
    pread_all,
    store_error,
    unlinked,
    write_all,
)
from ralph_mail.store.files.slots import SlotFile

#: A sender reads this much of the inbox's end to check for a torn line and find the last ts.
_TAIL_PROBE = 160
#: The largest slice of an inbox one read returns; the rest comes with the next read.
READ_MAX_BYTES = 16 * 1024 * 1024
#: What a read asks for first, without learning the size: a slice that is not full ends
#: at the end of the inbox (asking for more than is there costs a pread nothing).
_FIRST_READ = 64 * 1024
_BASE = struct.Struct("<qQqQ")
_LEGACY_BASE = struct.Struct("<QqQqQI")

DeadLetter = Callable[[int, bytes, str], None]


def _legacy_base(slot: bytes) -> tuple[int, bytes] | None:
    # The base record as the first release wrote it: seq, the four values, crc32.
    import zlib

    if len(slot) < _LEGACY_BASE.size:
        return None
    *record, crc = _LEGACY_BASE.unpack_from(slot)
    if not record[0] or crc != zlib.crc32(slot[: _LEGACY_BASE.size - 4]):
        return None
    return record[0], _BASE.pack(*record[1:])


@dataclass(frozen=True, slots=True)
class InboxState:
    """An inbox as `FileStore.inbox_state` found it.

    Attributes:
        agent: whose inbox.
        size: its size in bytes.
        base: the logical offset of its first byte.
        inode: its inode number (to find a lock holder in /proc/locks).
        locked: a sender or gc holds its exclusive lock right now.
        torn: it ends in a line without its newline and nobody is writing it.
    """

    agent: str
    size: int
    base: int
    inode: int
    locked: bool
    torn: bool


class Left(NamedTuple):
    """What a writer knew of its inbox when its log was closed (`InboxLog.leave`)."""

    status: tuple[int, int, int, int]  # inode, size, mtime, ctime (ns) after its append
    last_ts: str
    base: int
    base_ts: str


class _Open:
    """A kept descriptor on one inode of the inbox, with that inode's base, and where the
    last read of it found its end (-1: it did not)."""

    __slots__ = ("base", "end", "fd", "inode")

    def __init__(self, fd: int, inode: int, base: int) -> None:
        self.fd, self.inode, self.base, self.end = fd, inode, base, -1


class InboxLog:
    """One agent's inbox: the file ``mailbox/<agent>.jsonl`` and its base record."""

    def __init__(
        self, dirs: TeamDirs, agent: str, dead_letter: DeadLetter, left: Left | None = None
    ) -> None:
        self.dirs = dirs
        self.agent = agent
        self.where, self.name = log_place(agent)
        self._dead_letter = dead_letter
        self._pid = my_pid()
        self._writer = -1
        self._writer_inode = 0  # the inode the writer locked last
        self._writer_base = -1  # the base of that inode (-1: not read yet, `_writer_read`)
        self._writer_ts = ""  # the inbox's last ts when gc made that inode
        self._end = -1  # inbox size after our last append; -1: unknown, probe the tail
        self._last_ts = ""  # wire timestamps are fixed-width, so they compare as strings
        self._left = left  # what a writer before knew, checked at the first lock
        self._reader: _Open | None = None
        # flock excludes other processes, not the threads of this one: they share the
        # writer's open file description, so one thread's LOCK_UN would free another's.
        self._appending = threading.Lock()

    @property
    def path(self) -> Path:
        """The inbox's path, for messages (made when asked: a broadcast to a thousand
        members opens a log each and joins no path)."""
        return self.dirs.path(self.where, self.name)

    # -- opening -------------------------------------------------------------------------

    def _open(self, flags: int) -> int:
        try:
            return open_file(self.name, flags, self.dirs.get(self.where, create=False))
        except FileNotFoundError:
            if self.dirs.replaced():  # deleted, and maybe made again: look at its path now
                self.dirs.reopen()
                try:
                    return open_file(self.name, flags, self.dirs.get(self.where, create=False))
                except FileNotFoundError:
                    raise self.dirs.gone() from None
            raise StoreError(
                f"inbox {self.path} is missing: recreate the team or run 'ralph-mail doctor'",
                self.path,
            ) from None
        except OSError as exc:
            raise store_error(exc, f"inbox {self.path}", "open") from None

    def _bases(self) -> SlotFile:
        return SlotFile(
            lambda: self.dirs.get("bases"),
            f"{self.agent}.base",
            f"base file of {self.agent!r}",
            _legacy_base,
        )

    def base_record(self) -> tuple[int, int, int, int]:
        """``(base, inode, previous base, previous inode)``; zeros before any compaction."""
        payload = self._bases().load()
        return _BASE.unpack_from(payload) if payload is not None else (0, 0, 0, 0)

    def _writer_record(self, inode: int) -> tuple[int, str]:
        """The base of inbox inode ``inode``, and the ts of the last line the inbox had
        when gc made that inode ("" for an inode gc did not make, or a record from before
        the ts was kept)."""
        payload = self._bases().load()
        if payload is None:
            return 0, ""
        base, current, previous, previous_inode = _BASE.unpack_from(payload)
        if inode == current:
            return base, payload[_BASE.size :].decode("ascii", "replace")
        return (previous, "") if inode == previous_inode else (0, "")

    def base_of(self, inode: int) -> int:
        """The base of inbox inode ``inode``: 0 for an inode gc did not make."""
        base, current, previous, previous_inode = self.base_record()
        return base if inode == current else previous if inode == previous_inode else 0

    def follows(self, old: int, new: int) -> bool:
        """Whether inode ``new`` continues ``old``'s offsets (gc replaced one by the other)."""
        if old == new or old == 0:
            return True
        _, current, _, previous_inode = self.base_record()
        return new == current and old == previous_inode

    def current(self) -> tuple[int, int]:
        """The inode the reader is on (the inbox in place when nothing was read yet) and
        its base."""
        if self._reader is None:
            self._reader = self._open_reader()
        return self._reader.inode, self._reader.base

    def current_inode(self) -> int:
        return self.current()[0]

    def _open_reader(self) -> _Open:
        while True:
            fd = self._open(os.O_RDONLY)
            try:
                inode = os.fstat(fd).st_ino
                base, current, previous, previous_inode = self.base_record()
                if inode == current:
                    return _Open(fd, inode, base)
                if inode == previous_inode:
                    return _Open(fd, inode, previous)
                if not current or not unlinked(fd):
                    return _Open(fd, inode, 0)  # an inbox gc never replaced, or a new one
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # gc replaced it twice while we opened it: open the new one

    # -- appending -----------------------------------------------------------------------

    def _lock(self) -> int:
        """Lock a descriptor whose inode is still the linked inbox; return the size."""
        while True:
            if self._writer < 0 or self._pid != my_pid():
                self._writer = self._open(os.O_RDWR | os.O_APPEND)
                self._pid, self._end, self._writer_base = my_pid(), -1, -1
            fcntl.flock(self._writer, fcntl.LOCK_EX)
            status = os.fstat(self._writer)
            if status.st_nlink:
                self._writer_inode = status.st_ino
                if self._left is not None:  # what a writer knew, checked once
                    left, self._left = self._left, None
                    if left.status == _seen(status):  # the inode is as it left it
                        self._end, self._last_ts = status.st_size, left.last_ts
                        self._writer_base, self._writer_ts = left.base, left.base_ts
                return status.st_size
            # The inbox was replaced (gc compacted it) while we waited: lock the new one.
            fcntl.flock(self._writer, fcntl.LOCK_UN)
            os.close(self._writer)
            self._writer = -1

    def append(self, head: bytes, tail: bytes, durable: bool) -> tuple[str, int]:
        """Append ``head + ts + tail``; return the ts and the line's logical offset.
        One thread at a time: see ``_appending``."""
        if self._pid != my_pid():  # forked while another thread held it: a new one
            self._appending = threading.Lock()
        with self._appending:
            return self._append(head, tail, durable)

    def _append(self, head: bytes, tail: bytes, durable: bool) -> tuple[str, int]:
        size = self._lock()
        fd = self._writer
        try:
            if size != self._end:  # another process wrote since our last append
                size = self._probe_tail(fd, size, durable)
            ts = format_ts(time.time_ns() // 1000)
            if ts < self._last_ts:  # the wall clock stepped back: keep the inbox ordered
                ts = self._last_ts
            line = head + ts.encode() + tail
            try:
                write_all(fd, line)
                if durable:
                    os.fsync(fd)
            except OSError as exc:
                self._end = -1
                with contextlib.suppress(OSError):  # else the torn tail stays for the next sender
                    os.ftruncate(fd, size)
                raise store_error(
                    exc, f"inbox {self.path}", "append to", "nothing was delivered"
                ) from None
            self._end = size + len(line)
            self._last_ts = ts
            ring(self.dirs, self.agent)  # its waiters wake now: what follows is the sender's
            if self._writer_base < 0:
                self._writer_read()
            return ts, self._writer_base + size
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _writer_read(self) -> None:
        """Read the record of the writer's inode, under the lock, once: gc makes new inodes."""
        self._writer_base, self._writer_ts = self._writer_record(self._writer_inode)

    def _probe_tail(self, fd: int, size: int, durable: bool) -> int:
        """Under the lock: set aside a torn last line, learn the last ts; return the size."""
        stamp = None
        if size:
            probe = os.pread(fd, min(size, _TAIL_PROBE), size - min(size, _TAIL_PROBE))
            if not probe.endswith(b"\n"):
                size = self._quarantine_tail(fd, size, durable)
                stamp = last_ts(_last_line(fd, size)) if size else None
            else:
                stamp = last_ts(probe) or last_ts(_last_line(fd, size))
        if stamp is None:  # empty (gc emptied it: what it had still counts), or unreadable
            if self._writer_base < 0:
                self._writer_read()
            stamp = self._writer_ts
        # Else the last line's ts is the inbox's: ts never decrease, and gc keeps the last
        # line (the ts its record keeps is that line's, for a non-empty inode).
        self._last_ts = stamp
        return size

    def _quarantine_tail(self, fd: int, size: int, durable: bool) -> int:
        """Move a line left unfinished by a killed writer to the dead letters; cut it off.

        When the dead letter cannot be written (a full disk), the torn line is ended with a
        newline instead and stays in the inbox, where readers set it aside: sends go on and
        nothing is lost.
        """
        start = _line_start(fd, size)
        torn = pread_all(fd, size - start, start)
        try:
            self._dead_letter(
                self.base_of(os.fstat(fd).st_ino) + start,
                torn,
                "torn write: a sender stopped mid-append",
            )
        except (OSError, StoreError) as exc:
            warnings.warn(
                f"{exc}; the torn line stays in {self.path}", RuntimeWarning, stacklevel=2
            )
            write_all(fd, b"\n")
            return size + 1
        os.ftruncate(fd, start)
        if durable:
            os.fsync(fd)
        return start

    # -- reading -------------------------------------------------------------------------

    def read(self, offset: int, skip_collected: bool) -> tuple[bytes, int]:
        """Whole lines from logical ``offset`` (see `TeamStore.read`).

        A read makes as few system calls as it can: a process woken after a long sleep
        pays tens of µs for each, its kernel state cold. So the read of the mail that
        woke it is one pread (a first slice that is not full ends at the end: no size
        asked), and a read on from there (is there more?) one fstat, the size and the
        link count at once, until a wait comes (`before_wait`).
        """
        while True:
            if self._reader is None:
                self._reader = self._open_reader()
            reader = self._reader
            position = offset - reader.base
            if position < 0 and skip_collected:
                offset, position = reader.base, 0
            if position < 0:
                raise StoreError(
                    f"cursor offset {offset} of {self.agent!r} is below the inbox start "
                    f"{reader.base}: those messages were collected; delete the cursor "
                    f"{self.dirs.path('cursors', self.agent + '.cursor')} to re-read from the start"
                )
            if position == reader.end:  # read on from the end found: did any come?
                status = os.fstat(reader.fd)
                if status.st_size <= position:
                    if status.st_nlink:
                        return b"", offset
                    offset = self._follow(reader)  # replaced: its size is final
                    continue
                reader.end = -1
            data = os.pread(reader.fd, _FIRST_READ, position)
            available = len(data)
            if available == _FIRST_READ:  # maybe more: the size, then up to the most a read takes
                available = os.lseek(reader.fd, 0, os.SEEK_END) - position
                if available > len(data):
                    # Ask for what is there, not for a fixed maximum: pread allocates it.
                    data += pread_all(reader.fd, min(available, READ_MAX_BYTES) - len(data),
                                      position + len(data))  # fmt: skip
            if not data:
                status = os.fstat(reader.fd)  # the size and the link count, at one time
                if status.st_size > position:
                    continue  # it grew since the pread
                if status.st_nlink:
                    return b"", offset
                offset = self._follow(reader)
                continue
            end = data.rfind(b"\n") + 1
            while not end and len(data) < available:  # one line longer than a read
                more = os.pread(
                    reader.fd, min(available - len(data), READ_MAX_BYTES), position + len(data)
                )
                if not more:
                    break
                data += more
                end = data.rfind(b"\n") + 1
            if not end:
                status = os.fstat(reader.fd)
                if not status.st_nlink:  # replaced, so its size is final
                    if status.st_size > position + len(data):
                        continue  # it grew before it was replaced: read on
                    offset = self._follow(reader)  # its last line never gets its end
                    continue
            if end == available:  # whole lines to the end, as it was when read
                reader.end = position + end
            return data[:end], offset

    def before_wait(self) -> None:
        """A wait comes next: the read of its wake-up starts with the pread (see `read`)."""
        if (reader := self._reader) is not None:
            reader.end = -1

    def _follow(self, old: _Open) -> int:
        """The old inode is read to its end and replaced: move to the inbox in place now.

        Returns the logical offset to go on from: the old end when gc replaced it, else
        the start of the new inbox (a team re-created, a file put in place by hand).
        """
        end = old.base + os.fstat(old.fd).st_size
        self.drop_reader()
        if self.dirs.replaced():
            self.dirs.reopen()
        new = self._reader = self._open_reader()
        # gc made the new inode from this one when the record says so, or (a later gc may
        # have rewritten the record already, before its own rename) when its offsets go
        # on from here: gc's base is never 0, and lies between the old base and end.
        if self.follows(old.inode, new.inode) or (new.base > 0 and old.base <= new.base <= end):
            return end
        if new.base > end:  # a viewer more than one compaction behind: on at the new start
            return new.base
        warnings.warn(
            f"inbox {self.path} was replaced by a new file: reading it from its start",
            RuntimeWarning,
            stacklevel=4,
        )
        return new.base

    def drop_reader(self) -> None:
        if self._reader is not None:
            os.close(self._reader.fd)
            self._reader = None

    def read_tail(self, lines: int) -> tuple[list[bytes], int]:
        """The last ``lines`` whole lines and the offset after them: O(lines) bytes read."""
        if self._reader is None or unlinked(self._reader.fd):
            self.drop_reader()
            self._reader = self._open_reader()
        reader = self._reader
        position = os.fstat(reader.fd).st_size
        chunks: list[bytes] = []
        newlines = 0
        while position > 0 and newlines <= lines:
            step = min(TAIL_CHUNK_BYTES, position)
            position -= step
            chunk = os.pread(reader.fd, step, position)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
        data = b"".join(reversed(chunks))
        cut = data.rfind(b"\n") + 1
        parts = data[:cut].split(b"\n")[:-1]
        if position > 0:  # the chunk began inside a line
            parts = parts[1:]
        return (parts[-lines:] if lines > 0 else []), reader.base + position + cut

    def read_line(self, offset: int, length: int) -> bytes | None:
        """The line of ``length`` bytes at logical ``offset`` (None: gc collected it)."""
        if self._reader is None or unlinked(self._reader.fd):
            self.drop_reader()
            self._reader = self._open_reader()
        position = offset - self._reader.base
        if position < 0:
            return None
        line = pread_all(self._reader.fd, length, position)
        return line if len(line) == length and line.endswith(b"\n") else None

    def size(self) -> int:
        if self._reader is None or unlinked(self._reader.fd):
            self.drop_reader()
            self._reader = self._open_reader()
        return self._reader.base + os.lseek(self._reader.fd, 0, os.SEEK_END)

    def collectable(self, floor: int) -> int:
        return floor - self._reader.base if self._reader is not None else 0

    def purge_archive(self, before: str, timeout: float) -> int:
        """Drop archived messages older than ``before`` (under the inbox lock, which
        compaction appends under); return where the archive starts now."""
        fd = self._lock_bounded(timeout)
        try:
            return Archive(self.dirs, self.agent).purge_before(before)
        except OSError as exc:
            raise store_error(exc, f"archive of {self.agent!r}", "purge") from None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- compaction ----------------------------------------------------------------------

    def _lock_bounded(self, timeout: float) -> int:
        """A new descriptor on the linked inbox under LOCK_EX, waited for at most
        ``timeout`` seconds: a stopped sender must not hang gc for ever."""
        deadline = time.monotonic() + timeout
        pause = 0.001
        while True:
            fd = self._open(os.O_RDWR)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockTimeout(
                                f"inbox {self.path} stayed locked for {timeout:g} s (a sender "
                                "stopped or stuck?): find it with 'ralph-mail doctor'",
                                self.path,
                            ) from None
                        time.sleep(pause)  # flock has no timeout: retry with a backoff
                        pause = min(pause * 2, 0.05)
                if os.fstat(fd).st_nlink:
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # replaced by a concurrent gc while we waited: lock the new one

    def compact(
        self,
        floor_of: Callable[[int], int | None],
        min_bytes: int,
        timeout: float,
        durable: bool,
        drop_before: str | None = None,
    ) -> Compaction:
        """Drop the lines below the owner's floor (``floor_of(inode)``; None: the cursor
        belongs to another inbox, keep everything), archiving them (but those older than
        ``drop_before``)."""
        fd = self._lock_bounded(timeout)
        try:
            return self._compact_locked(fd, floor_of, min_bytes, durable, drop_before)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.path}", "compact", "it is unchanged") from None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _compact_locked(
        self,
        fd: int,
        floor_of: Callable[[int], int | None],
        min_bytes: int,
        durable: bool,
        drop_before: str | None,
    ) -> Compaction:
        status = os.fstat(fd)
        size = status.st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size = self._quarantine_tail(fd, size, durable)
        base = self.base_of(status.st_ino)
        floor = floor_of(status.st_ino)
        cut = 0 if floor is None else floor - base
        if cut > size:
            raise StoreError(
                f"cursor of {self.agent!r} ({floor}) is past the end of its inbox "
                f"({base + size}): the inbox was cut by hand; delete the cursor "
                f"{self.dirs.path('cursors', self.agent + '.cursor')} to re-read it"
            )
        if cut < max(min_bytes, 1):
            return Compaction(self.agent, 0, size, base)
        if os.pread(fd, 1, cut - 1) != b"\n":
            raise StoreError(
                f"cursor of {self.agent!r} ({floor}) is not at a line start: delete the cursor "
                f"{self.dirs.path('cursors', self.agent + '.cursor')} to re-read the inbox"
            )
        dropped = _count_lines(fd, cut)
        # The ts the inbox has reached, kept with the base for when gc leaves it empty.
        reached = max(last_ts(_last_line(fd, size)) or "", self._writer_record(status.st_ino)[1])
        # The audit trail first: what is dropped is archived (durably) before it goes.
        Archive(self.dirs, self.agent).append(fd, base, cut, drop_before)
        tmp_dir = self.dirs.get("tmp")
        tmp = f".{self.name}.{os.getpid()}.gc"
        mailbox = self.dirs.get(self.where, create=False)
        try:
            out = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, tmp_dir)
            try:
                copy_range(fd, out, cut, size - cut)
                os.fsync(out)
                new_inode = os.fstat(out).st_ino
            finally:
                os.close(out)
            # The base first, naming both inodes: a crash before the rename leaves the old
            # inbox with its old base, one after it the new inbox with the new base.
            record = _BASE.pack(base + cut, new_inode, base, status.st_ino) + reached.encode()
            self._bases().save(record, sync=True)
            os.rename(tmp, self.name, src_dir_fd=tmp_dir, dst_dir_fd=mailbox)
            tmp = ""
            os.fsync(mailbox)
        finally:
            if tmp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=tmp_dir)
        if self._reader is not None and self._reader.inode == status.st_ino:
            self.drop_reader()  # it would find the old inode unlinked: move on now
        return Compaction(self.agent, cut, size - cut, base + cut, dropped)

    def state(self) -> InboxState:
        """Size, base, and whether the inbox is locked now or ends in a torn line."""
        fd = self._open(os.O_RDONLY)
        try:
            status = os.fstat(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                locked = True
            else:
                locked = False
            size = os.fstat(fd).st_size
            torn = not locked and size > 0 and os.pread(fd, 1, size - 1) != b"\n"
            return InboxState(
                self.agent, size, self.base_of(status.st_ino), status.st_ino, locked, torn
            )
        finally:
            os.close(fd)

    def leave(self) -> Left | None:
        """`close`; return what the writer knew of its inode, if nobody wrote there since."""
        left = None
        with self._appending:
            if self._pid == my_pid() and min(self._writer, self._end, self._writer_base) >= 0:
                with contextlib.suppress(OSError):
                    status = os.fstat(self._writer)
                    if status.st_size == self._end and status.st_nlink:
                        left = Left(
                            _seen(status), self._last_ts, self._writer_base, self._writer_ts
                        )
        self.close()
        return left

    def close(self) -> None:
        """Close the kept descriptors (after an append under way in another thread)."""
        if self._pid != my_pid():  # inherited through fork: not ours to close
            self._writer, self._reader = -1, None
            return
        with self._appending:
            if self._writer >= 0:
                os.close(self._writer)
            self._writer = -1
            self.drop_reader()


def _seen(status: os.stat_result) -> tuple[int, int, int, int]:
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _count_lines(fd: int, length: int) -> int:
    count, position = 0, 0
    while position < length:
        chunk = os.pread(fd, min(READ_MAX_BYTES, length - position), position)
        if not chunk:
            break
        count += chunk.count(b"\n")
        position += len(chunk)
    return count


def _line_start(fd: int, size: int) -> int:
    """The offset just after the last newline before ``size`` (0 when there is none)."""
    position = size
    while position > 0:
        step = min(TAIL_CHUNK_BYTES, position)
        position -= step
        newline = os.pread(fd, step, position).rfind(b"\n")
        if newline >= 0:
            return position + newline + 1
    return 0


def _last_line(fd: int, size: int) -> bytes:
    """The last whole line before ``size`` (which ends just after a newline)."""
    if size == 0:
        return b""
    start = _line_start(fd, size - 1)
    return pread_all(fd, size - start, start)
