"""The files: the only module that opens, locks, appends to or reads a team's files.

Layout of one team (``$RALPH_HOME/teams/<team>/``)::

    team.json                roster (written once, by create_team)
    mailbox/<agent>.jsonl    one append-only inbox per agent: inboxes and nothing else
    cursors/<agent>.cursor   the owner's read position (two checksummed slots, see Cursor)
    deadletters/<agent>.jsonl  lines set aside from that inbox, with the reason
    bases/<agent>.base       logical offset of the inbox's first byte, once gc has compacted it
    tmp/                     gc's copies of inboxes, renamed over them when whole

Locking. A sender takes ``flock(LOCK_EX)`` on the inbox itself, through a descriptor it
keeps open, around one append. The inbox is locked rather than a separate lock file so
that deleting or replacing a lock file can never split writers across two inodes: after
taking the lock a writer checks that the inode it locked is still linked, else it reopens.
flock is what filelock wraps on Linux; calling it directly costs 0.6 µs against filelock's
49 µs per acquire (MEASUREMENTS.md §2), which is what makes 100k+ sends/s possible.

Offsets. Every offset outside this module is *logical*: the physical file offset plus the
inbox's base. gc (which drops consumed messages from the front) raises the base, so a
cursor taken before a compaction stays valid after it.

Compaction (`FileStore.compact`). Under the old inbox's LOCK_EX: copy the lines from the
owner's committed floor into ``tmp/``, fsync, write the base file, rename the copy over the
inbox. The base file names the inode each base belongs to (``base inode`` for the new
inbox, then the same for the old one), so a gc killed between writing the base and the
rename leaves a base that still describes the inbox in place: no crash point shifts an
offset. Writers locked on the old inode see ``st_nlink == 0`` and reopen; readers take
the base under LOCK_SH and check the link count too, so a base never meets the wrong inode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import struct
import time
import weakref
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ralph_mail.errors import InvalidMessage, LockTimeout, StoreError
from ralph_mail.message import format_ts
from ralph_mail.settings import DIR_MODE, FILE_MODE, TAIL_CHUNK_BYTES

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_TS_VALUE = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
#: Stands for the ts while a line is encoded outside the lock: a wire ts is this wide.
_TS_PLACEHOLDER = "0000-00-00T00:00:00.000000Z"
#: A sender reads this much of the inbox's end to check for a torn line and find the last ts.
_TAIL_PROBE = 160
#: The largest slice of an inbox one read returns; the rest comes with the next read.
READ_MAX_BYTES = 16 * 1024 * 1024


def teams_dir(home: Path) -> Path:
    """Where the teams of a home live."""
    return home / "teams"


def ensure_dir(path: Path) -> None:
    """Create ``path`` and its parents as 0700, whatever the umask; refuse a symlink."""
    missing = []
    probe = path
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, DIR_MODE)
        os.chmod(directory, DIR_MODE, follow_symlinks=False)
    if path.is_symlink() or not path.is_dir():
        raise StoreError(f"{path} is not a directory (or is a symlink): remove it", path)


def open_private(path: Path, flags: int) -> int:
    """Open ``path`` with O_NOFOLLOW; a file this call creates is 0600 whatever the umask."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(
                f"{path} is a symlink: refusing to follow it; remove it", path
            ) from None
        raise
    if flags & os.O_CREAT:
        try:
            if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
        except OSError:
            os.close(fd)
            raise
    return fd


def write_all(fd: int, data: bytes) -> None:
    """One write loop: a regular file may accept part of a buffer (a full disk, a limit)."""
    written = os.write(fd, data)
    if written == len(data):
        return
    view = memoryview(data)[written:]
    while view:
        view = view[os.write(fd, view) :]


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a temp file beside it, fsync, then os.replace."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Cursor:
    """An owner's read position in its inbox.

    Attributes:
        floor: logical offset below which every line is consumed.
        acked: start offsets of lines above the floor consumed out of order
            (`MessageBus.wait_for_message` takes one type and leaves the rest).
    """

    floor: int = 0
    acked: set[int] = field(default_factory=set)


class _CursorFile:
    """A cursor persisted in place as two slots, so a commit costs one small pwrite.

    Each slot is ``seq, floor, count, count offsets, crc32``. A commit writes the slot the
    current state is *not* in, so a crash mid-write (kill, power loss) leaves the other slot
    whole: a reader takes the valid slot with the higher seq, old or new, never a mix. A slot
    is one page: a single-page pwrite is not split by a signal. Temp file + rename would cost
    0.94 ms per commit on ext4 (MEASUREMENTS.md §4); this costs about a microsecond. A cursor
    that outgrows its slot is rewritten once with bigger slots, through temp file + rename.
    """

    _HEAD = struct.Struct("<QqI")
    _CRC = struct.Struct("<I")
    _SLOT = 4096

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._seq = 0
        self._slot = self._SLOT

    def load(self) -> Cursor:
        try:
            fd = open_private(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return Cursor()
        try:
            data = os.pread(fd, 1 << 24, 0)
        finally:
            os.close(fd)
        self._slot = max(len(data) // 2, self._SLOT)
        best: tuple[int, Cursor] | None = None
        for start in (0, self._slot):
            found = self._decode(data[start : start + self._slot])
            if found and (best is None or found[0] > best[0]):
                best = found
        if best is None:
            if data.strip(b"\0"):
                raise StoreError(
                    f"cursor {self.path} is damaged: delete it to re-read from the start", self.path
                )
            return Cursor()
        self._seq = best[0]
        return best[1]

    def _decode(self, slot: bytes) -> tuple[int, Cursor] | None:
        if len(slot) < self._HEAD.size + self._CRC.size:
            return None
        seq, floor, count = self._HEAD.unpack_from(slot)
        end = self._HEAD.size + 8 * count
        if seq == 0 or end + self._CRC.size > len(slot):
            return None
        if self._CRC.unpack_from(slot, end)[0] != zlib.crc32(slot[:end]):
            return None
        acked = set(struct.unpack_from(f"<{count}q", slot, self._HEAD.size))
        return seq, Cursor(floor, acked)

    def save(self, cursor: Cursor) -> None:
        seq = self._seq + 1
        acked = sorted(cursor.acked)
        body = self._HEAD.pack(seq, cursor.floor, len(acked)) + struct.pack(
            f"<{len(acked)}q", *acked
        )
        body += self._CRC.pack(zlib.crc32(body))
        if len(body) > self._slot:
            self._grow(body)
        else:
            if self._fd < 0:
                self._fd = self._open()
            os.pwrite(self._fd, body, (seq % 2) * self._slot)
        self._seq = seq

    def _open(self) -> int:
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size < 2 * self._slot:
                # Both slots get their blocks now: a commit on a full disk must still work,
                # or an owner could not consume the mail that filled it.
                os.posix_fallocate(fd, 0, 2 * self._slot)
        except OSError:
            os.close(fd)
            raise
        return fd

    def _grow(self, body: bytes) -> None:
        slot = self._slot
        while slot < len(body):
            slot *= 2
        padded = body.ljust(slot, b"\0")
        write_file_atomic(self.path, padded + padded)
        self.close()
        self._slot = slot

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _BaseFile:
    """``bases/<agent>.base``: the inbox's base, in two checksummed slots written in place.

    A record is ``seq, base, inode, previous base, previous inode, crc32``: the base of the
    inbox inode gc is about to rename into place, and the base of the inode it replaces,
    which stays right if gc dies before its rename. Written in place like a cursor, into
    blocks allocated when the file is made, so gc still works on a full disk: that is when
    it is needed most.
    """

    _RECORD = struct.Struct("<QqQqQ")
    _CRC = struct.Struct("<I")
    _SLOT = 4096

    def __init__(self, path: Path) -> None:
        self.path = path

    def create(self) -> None:
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size < 2 * self._SLOT:
                os.posix_fallocate(fd, 0, 2 * self._SLOT)
        finally:
            os.close(fd)

    def load(self) -> tuple[int, int, int, int, int]:
        """The newest whole record (all zeros when there is none)."""
        try:
            fd = open_private(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return 0, 0, 0, 0, 0
        size = self._RECORD.size
        try:
            slots = [os.pread(fd, size + self._CRC.size, start) for start in (0, self._SLOT)]
        finally:
            os.close(fd)
        best = (0, 0, 0, 0, 0)
        for slot in slots:
            if len(slot) < size + self._CRC.size:
                continue
            record = self._RECORD.unpack_from(slot)
            if self._CRC.unpack_from(slot, size)[0] == zlib.crc32(slot[:size]) and record[0]:
                best = max(best, record)
        if best[0] == 0 and any(slot.strip(b"\0") for slot in slots):
            raise StoreError(
                f"base file {self.path} is damaged: the inbox's offsets are unknown; "
                "run 'ralph-mail doctor'",
                self.path,
            )
        return best

    def save(self, base: int, inode: int, previous: int, previous_inode: int) -> None:
        seq = self.load()[0] + 1
        self.create()
        body = self._RECORD.pack(seq, base, inode, previous, previous_inode)
        fd = open_private(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, body + self._CRC.pack(zlib.crc32(body)), (seq % 2) * self._SLOT)
            os.fsync(fd)
        finally:
            os.close(fd)


class _Writer:
    """A kept descriptor on one inbox for appending, with what the last append saw."""

    __slots__ = ("end", "fd", "last_ts", "pid")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.end = -1  # inbox size after our last append; -1: unknown, probe the tail
        self.last_ts = ""  # wire timestamps are fixed-width, so they compare as strings
        self.pid = os.getpid()


@dataclass(frozen=True, slots=True)
class Compaction:
    """What one compaction of one inbox did.

    Attributes:
        agent: whose inbox.
        removed: bytes of consumed lines dropped from its front (0: nothing to do).
        kept: bytes left: the unconsumed lines.
        base: the inbox's base afterwards (the logical offset of its first byte).
    """

    agent: str
    removed: int
    kept: int
    base: int


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


class _Reader:
    """A kept read-only descriptor on one inbox and the base that goes with its inode."""

    __slots__ = ("base", "fd")

    def __init__(self, fd: int, base: int) -> None:
        self.fd = fd
        self.base = base


class FileStore:
    """The files of one team: appends, reads, cursors and dead letters.

    Keeps descriptors open between calls (that is what makes a send cost microseconds);
    call `close` when done. Descriptors inherited through ``fork`` are never reused: a
    child shares the parent's open file description, and with it the parent's flock.

    Example:
        >>> store = FileStore(root)                                   # doctest: +SKIP
        >>> ts = store.append("lead", {"id": "...", ..., "ts": ""})   # doctest: +SKIP
    """

    def __init__(self, root: Path, *, durable: bool = False) -> None:
        self.root = root
        self.durable = durable
        self.mailbox = root / "mailbox"
        self._writers: dict[str, _Writer] = {}
        self._readers: dict[str, _Reader] = {}
        self._cursors: dict[str, _CursorFile] = {}
        # A store dropped without close() (a bus never closed) still gives its descriptors
        # back when it is collected, instead of holding them for the life of the process.
        weakref.finalize(self, _close_descriptors, self._writers, self._readers, self._cursors)

    # -- paths ---------------------------------------------------------------------------

    def inbox_path(self, agent: str) -> Path:
        return self.mailbox / f"{agent}.jsonl"

    def cursor_path(self, agent: str) -> Path:
        return self.root / "cursors" / f"{agent}.cursor"

    def deadletter_path(self, agent: str) -> Path:
        return self.root / "deadletters" / f"{agent}.jsonl"

    def base_path(self, agent: str) -> Path:
        return self.root / "bases" / f"{agent}.base"

    # -- appending -------------------------------------------------------------------------

    def _writer(self, agent: str) -> _Writer:
        writer = self._writers.get(agent)
        if writer is not None and writer.pid == os.getpid():
            return writer
        path = self.inbox_path(agent)
        try:
            fd = open_private(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            raise StoreError(
                f"inbox {path} is missing: recreate the team or run 'ralph-mail doctor'", path
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot open inbox {path}: {exc.strerror}", path) from None
        writer = _Writer(fd)
        self._writers[agent] = writer
        return writer

    def _lock(self, agent: str) -> tuple[_Writer, int]:
        """Lock a descriptor whose inode is still the linked inbox; return it and the size."""
        while True:
            writer = self._writer(agent)
            fcntl.flock(writer.fd, fcntl.LOCK_EX)
            status = os.fstat(writer.fd)
            if status.st_nlink:
                return writer, status.st_size
            # The inbox was replaced (gc compacted it) while we waited: lock the new one.
            fcntl.flock(writer.fd, fcntl.LOCK_UN)
            os.close(writer.fd)
            del self._writers[agent]

    def append(self, agent: str, envelope: dict[str, Any], max_bytes: int) -> str:
        """Append ``envelope`` to ``agent``'s inbox as one line; return the ts it was given.

        The ts is taken under the lock and never goes below the inbox's last one. If the
        write fails part-way, the inbox is cut back to where it was, so nothing a reader
        would deliver is left; what cannot be cut back is a torn tail that the next sender
        sets aside.
        """
        # Encode before locking, with a placeholder of the ts's fixed width: under the lock
        # only the ts is taken and spliced in, and the line written.
        envelope["ts"] = _TS_PLACEHOLDER
        try:
            line = orjson.dumps(envelope, option=orjson.OPT_APPEND_NEWLINE)
        except TypeError as exc:
            raise InvalidMessage(f"message cannot be encoded as UTF-8 JSON: {exc}") from None
        if len(line) > max_bytes:
            raise InvalidMessage(
                f"message of {len(line)} bytes is over the {max_bytes}-byte limit: "
                "send a shorter body or raise RALPH_MAX_MESSAGE_BYTES"
            )
        # The ts key is the last one but for reply_to (12 hex digits), and a quote inside a
        # string value is escaped, so the last '"ts":"' is the envelope's own.
        cut = line.rfind(b'"ts":"') + 6
        head, tail = line[:cut], line[cut + len(_TS_PLACEHOLDER) :]
        writer, size = self._lock(agent)
        fd = writer.fd
        try:
            if size != writer.end:  # another process wrote since our last append
                size = self._probe_tail(agent, writer, size)
            ts = format_ts(time.time_ns() // 1000)
            if ts < writer.last_ts:  # the wall clock stepped back: keep the inbox ordered
                ts = writer.last_ts
            try:
                write_all(fd, head + ts.encode() + tail)
                if self.durable:
                    os.fsync(fd)
            except OSError as exc:
                self._cut_back(agent, writer, size)
                raise StoreError(
                    f"cannot append to inbox {self.inbox_path(agent)}: {exc.strerror}; "
                    "nothing was delivered",
                    self.inbox_path(agent),
                ) from None
            writer.end = size + len(line)
            writer.last_ts = ts
            return ts
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _cut_back(self, agent: str, writer: _Writer, size: int) -> None:
        writer.end = -1
        with contextlib.suppress(OSError):  # else the torn tail stays for the next sender
            os.ftruncate(writer.fd, size)

    def _probe_tail(self, agent: str, writer: _Writer, size: int) -> int:
        """Under the lock: set aside a torn last line, learn the last ts; return the size."""
        if size == 0:
            writer.last_ts = ""
            return 0
        tail = os.pread(writer.fd, min(size, _TAIL_PROBE), size - min(size, _TAIL_PROBE))
        if not tail.endswith(b"\n"):
            size = self._quarantine_tail(agent, writer.fd, size)
            writer.last_ts = self._last_ts(writer.fd, size)
        else:
            stamp = _last_stamp(tail)
            writer.last_ts = stamp if stamp is not None else self._last_ts(writer.fd, size)
        return size

    def _last_ts(self, fd: int, size: int) -> str:
        """The ts of the last whole line ("" when there is none or it has no ts)."""
        return _last_stamp(_last_line(fd, size)[1]) or ""

    def _quarantine_tail(self, agent: str, fd: int, size: int) -> int:
        """Move a line left unfinished by a killed writer to the dead letters; cut it off."""
        start = _line_start(fd, size)
        torn = _pread_all(fd, size - start, start)
        base = self.read_base(agent, os.fstat(fd).st_ino)
        self.dead_letter(agent, base + start, torn, "torn write: a sender stopped mid-append")
        os.ftruncate(fd, start)
        if self.durable:
            os.fsync(fd)
        return start

    # -- reading ---------------------------------------------------------------------------

    def read_base(self, agent: str, inode: int | None = None) -> int:
        """The logical offset of the inbox's first byte (0 until gc compacts it).

        ``inode`` is the inbox inode the caller has open: the base file also keeps the
        previous inode's base, which is the right one when gc stopped before its rename.
        Any other inode (a team copied elsewhere) gets the newest base.
        """
        _, base, _, previous, previous_inode = _BaseFile(self.base_path(agent)).load()
        if inode is not None and previous_inode and inode == previous_inode:
            return previous
        return base

    def _reader(self, agent: str, *, replaced_too: bool = False) -> _Reader:
        """The kept read descriptor, on the linked inbox unless ``replaced_too``."""
        reader = self._readers.get(agent)
        if reader is not None:
            if replaced_too or os.fstat(reader.fd).st_nlink:
                return reader
            self._drop_reader(agent)  # gc replaced the inbox: follow it to the new inode
        path = self.inbox_path(agent)
        while True:
            try:
                fd = open_private(path, os.O_RDONLY)
            except FileNotFoundError:
                raise StoreError(
                    f"inbox {path} is missing: recreate the team or run 'ralph-mail doctor'", path
                ) from None
            # The base must belong to the inode we opened: read it under a shared lock, which
            # gc's exclusive lock (held across compaction, base update and rename) excludes,
            # and only while that inode is still the inbox (else gc replaced it meanwhile).
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                status = os.fstat(fd)
                if status.st_nlink:
                    base = self.read_base(agent, status.st_ino)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            if status.st_nlink:
                break
            os.close(fd)
        reader = _Reader(fd, base)
        self._readers[agent] = reader
        return reader

    def _drop_reader(self, agent: str) -> None:
        os.close(self._readers.pop(agent).fd)

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        """The whole lines of ``agent``'s inbox from logical ``offset``, and that offset.

        A last line without its newline is left for a later read. A read returns at most
        about `READ_MAX_BYTES` (more only to finish one long line); call again for the rest.
        An ``offset`` below the inbox start (gc collected it) is an error, unless
        ``skip_collected`` (a viewer that consumes nothing), which moves it to the start.

        An inbox replaced by gc is read to its end before the new one: it holds every line
        up to the compaction, so a reader behind the owner (``tail -f``) skips nothing.
        """
        while True:
            reader = self._reader(agent, replaced_too=True)
            position = offset - reader.base
            if position < 0 and skip_collected:
                offset, position = reader.base, 0
            if position < 0:
                raise StoreError(
                    f"cursor offset {offset} of {agent!r} is below the inbox start "
                    f"{reader.base}: those messages were collected; delete the cursor "
                    f"{self.cursor_path(agent)} to re-read from the start",
                    self.cursor_path(agent),
                )
            status = os.fstat(reader.fd)
            available = status.st_size - position
            if available <= 0:
                if status.st_nlink:
                    return b"", offset
                self._drop_reader(agent)  # all of the replaced inode is read: on to the new
                continue
            # Ask for what is there, not for a fixed maximum: pread allocates what it is asked.
            data = os.pread(reader.fd, min(available, READ_MAX_BYTES), position)
            end = data.rfind(b"\n") + 1
            while not end and len(data) < available:  # one line longer than a read
                more = os.pread(
                    reader.fd, min(available - len(data), READ_MAX_BYTES), position + len(data)
                )
                if not more:
                    break
                data += more
                end = data.rfind(b"\n") + 1
            if not end and not status.st_nlink:  # a replaced inode never gets its line's end
                self._drop_reader(agent)
                continue
            return data[:end], offset

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        """The last ``lines`` whole lines of the inbox, and the logical offset after them.

        Reads backwards from the end in chunks, so the cost depends on ``lines``, not on
        the size of the inbox.
        """
        reader = self._reader(agent)
        position = os.fstat(reader.fd).st_size
        data = b""
        while position > 0 and data.count(b"\n") <= lines:
            step = min(TAIL_CHUNK_BYTES, position)
            position -= step
            data = os.pread(reader.fd, step, position) + data
        cut = data.rfind(b"\n") + 1
        parts = data[:cut].split(b"\n")[:-1]
        if position > 0:  # the chunk began inside a line
            parts = parts[1:]
        return (parts[-lines:] if lines > 0 else []), reader.base + position + cut

    def size(self, agent: str) -> int:
        """The logical offset of the inbox's end."""
        reader = self._reader(agent)
        return reader.base + os.fstat(reader.fd).st_size

    def collectable(self, agent: str, floor: int) -> int:
        """Bytes below ``floor`` still in the inbox (0 until the inbox was read): a cheap
        test of whether a compaction is worth it."""
        reader = self._readers.get(agent)
        return floor - reader.base if reader is not None else 0

    # -- compaction (gc) -------------------------------------------------------------------

    def _lock_inbox(self, agent: str, operation: int) -> int:
        """A new descriptor on the linked inbox, locked with ``operation``."""
        path = self.inbox_path(agent)
        while True:
            try:
                fd = open_private(path, os.O_RDWR)
            except FileNotFoundError:
                raise StoreError(
                    f"inbox {path} is missing: recreate the team or run 'ralph-mail doctor'", path
                ) from None
            try:
                fcntl.flock(fd, operation)
                if os.fstat(fd).st_nlink:
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # replaced by a concurrent gc while we waited: lock the new one

    def compact(self, agent: str, min_bytes: int = 1) -> Compaction:
        """Drop the lines ``agent`` has consumed from the front of its inbox.

        Cuts at the owner's committed cursor floor, so nothing unread (nor anything read out
        of order above the floor) is dropped, and every logical offset stays valid. Senders
        wait on the inbox lock while the unconsumed part is copied, then follow the new
        inode. Does nothing when fewer than ``min_bytes`` are consumed. A torn tail left by
        a killed sender is set aside first, as a sender would.

        Example:
            >>> FileStore(team.root).compact("lead")          # doctest: +SKIP
            Compaction(agent='lead', removed=5120, kept=310, base=5120)
        """
        fd = self._lock_inbox(agent, fcntl.LOCK_EX)
        try:
            return self._compact_locked(agent, fd, min_bytes)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(
                f"cannot compact inbox {self.inbox_path(agent)}: {exc.strerror}; it is unchanged",
                self.inbox_path(agent),
            ) from None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _compact_locked(self, agent: str, fd: int, min_bytes: int) -> Compaction:
        path = self.inbox_path(agent)
        tmp: Path | None = None
        try:
            status = os.fstat(fd)
            size = status.st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                size = self._quarantine_tail(agent, fd, size)
            base = self.read_base(agent, status.st_ino)
            floor = self._cursor_file(agent).load().floor
            cut = floor - base
            if cut > size:
                raise StoreError(
                    f"cursor of {agent!r} ({floor}) is past the end of its inbox "
                    f"({base + size}): the inbox was cut or replaced by hand; delete the cursor "
                    f"{self.cursor_path(agent)} to re-read it",
                    self.cursor_path(agent),
                )
            if cut < max(min_bytes, 1):
                return Compaction(agent, 0, size, base)
            if os.pread(fd, 1, cut - 1) != b"\n":
                raise StoreError(
                    f"cursor of {agent!r} ({floor}) is not at a line start: delete the cursor "
                    f"{self.cursor_path(agent)} to re-read the inbox",
                    self.cursor_path(agent),
                )
            ensure_dir(self.root / "tmp")
            tmp = self.root / "tmp" / f".{agent}.jsonl.{os.getpid()}.gc"
            out = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                _copy_range(fd, out, cut, size - cut)
                os.fsync(out)
                new_inode = os.fstat(out).st_ino
            finally:
                os.close(out)
            # The base first, naming both inodes: a crash before the rename leaves the old
            # inbox with its old base, one after it the new inbox with the new base.
            ensure_dir(self.root / "bases")
            _BaseFile(self.base_path(agent)).save(base + cut, new_inode, base, status.st_ino)
            fsync_dir(self.root / "bases")
            os.rename(tmp, path)
            tmp = None
            fsync_dir(self.mailbox)
            reader = self._readers.pop(agent, None)
            if reader is not None:  # it would find the old inode unlinked: move on now
                os.close(reader.fd)
            return Compaction(agent, cut, size - cut, base + cut)
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()

    @contextlib.contextmanager
    def maintenance_lock(self, timeout: float) -> Iterator[None]:
        """Hold the team's ``gc.lock`` (filelock) for a maintenance run; `LockTimeout` after
        ``timeout`` seconds.

        filelock is right here and not on the send path: it costs 49 µs per acquire against
        0.6 µs for a raw flock, which only matters per message. The lock file is never
        unlinked: unlinking a locked file would split waiters across two inodes.
        """
        from filelock import FileLock, Timeout

        path = self.root / "gc.lock"
        lock = FileLock(path, timeout=timeout, mode=FILE_MODE, preserve_lock_file=True)
        try:
            lock.acquire()
        except Timeout:
            raise LockTimeout(
                f"another gc of this team holds {path} (waited {timeout:g} s): "
                "let it finish, or find it with 'ralph-mail doctor'",
                path,
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                message = f"{path} is a symlink: refusing to follow it; remove it"
                raise StoreError(message, path) from None
            raise StoreError(f"cannot take the gc lock {path}: {exc.strerror}", path) from None
        try:
            yield
        finally:
            lock.release()

    def stale_temp_files(self) -> list[Path]:
        """Temp files (``.NAME.PID.gc`` or ``.tmp``) whose writer died before its rename."""
        stale = []
        for sub in ("tmp", "bases", "cursors"):
            try:
                names = sorted(os.listdir(self.root / sub))
            except FileNotFoundError:
                continue
            for name in names:
                parts = name.rsplit(".", 2)
                if not name.startswith(".") or len(parts) < 3 or parts[2] not in ("gc", "tmp"):
                    continue
                if not (parts[1].isdigit() and pid_alive(int(parts[1]))):
                    stale.append(self.root / sub / name)
        return stale

    def inbox_state(self, agent: str) -> InboxState:
        """Size, base, and whether the inbox is locked now or ends in a torn line."""
        path = self.inbox_path(agent)
        fd = open_private(path, os.O_RDONLY)
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
            base = self.read_base(agent, status.st_ino)
            return InboxState(agent, size, base, status.st_ino, locked, torn)
        finally:
            os.close(fd)

    # -- cursors and dead letters ----------------------------------------------------------

    def _cursor_file(self, agent: str) -> _CursorFile:
        cursor_file = self._cursors.get(agent)
        if cursor_file is None:
            ensure_dir(self.root / "cursors")
            cursor_file = self._cursors[agent] = _CursorFile(self.cursor_path(agent))
        return cursor_file

    def load_cursor(self, agent: str) -> Cursor:
        """The owner's persisted cursor (the inbox start when it never committed)."""
        cursor = self._cursor_file(agent).load()
        base = self.read_base(agent)
        if cursor.floor < base:  # no cursor (deleted to re-read): start at what gc kept
            cursor = Cursor(base, {start for start in cursor.acked if start >= base})
        return cursor

    def save_cursor(self, agent: str, cursor: Cursor) -> None:
        """Persist ``cursor``: afterwards a crash leaves the old cursor or this one.

        A failed write raises `StoreError` and leaves the old cursor in force.
        """
        try:
            self._cursor_file(agent).save(cursor)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(
                f"cannot save the cursor {self.cursor_path(agent)}: {exc.strerror}; "
                "nothing was consumed",
                self.cursor_path(agent),
            ) from None

    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        """Record a line of ``agent``'s inbox that was set aside, and why."""
        ensure_dir(self.root / "deadletters")
        record = {
            "ts": format_ts(time.time_ns() // 1000),
            "inbox": agent,
            "offset": offset,
            "reason": reason,
            "line": line.decode("utf-8", "backslashreplace"),
        }
        data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        fd = open_private(self.deadletter_path(agent), os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # a record torn by a kill: end it, keep this one whole
            write_all(fd, data)
        finally:
            os.close(fd)

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        """Every dead letter recorded for ``agent``'s inbox, oldest first."""
        try:
            fd = open_private(self.deadletter_path(agent), os.O_RDONLY)
        except FileNotFoundError:
            return []
        try:
            data = _pread_all(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
        records = []
        for line in data.splitlines():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                if line.strip():  # a record torn by a kill: keep what it says
                    text = line.decode("utf-8", "backslashreplace")
                    records.append({"reason": "damaged dead-letter record", "line": text})
        return records

    def close(self) -> None:
        """Close every kept descriptor (those inherited through fork are left alone)."""
        _close_descriptors(self._writers, self._readers, self._cursors)


def _close_descriptors(
    writers: dict[str, _Writer], readers: dict[str, _Reader], cursors: dict[str, _CursorFile]
) -> None:
    # Takes the dicts, not the store, so that it can also run as the store's finalizer.
    pid = os.getpid()
    for writer in writers.values():
        if writer.pid == pid:
            os.close(writer.fd)
    for reader in readers.values():
        os.close(reader.fd)
    for cursor_file in cursors.values():
        cursor_file.close()
    writers.clear()
    readers.clear()
    cursors.clear()


def _last_stamp(data: bytes) -> str | None:
    """The last wire timestamp in ``data`` (the ts key comes last but for reply_to).

    Runs under the inbox lock on every contended send, so it is an rfind, not a scan.
    """
    start = data.rfind(b'"ts":"') + 6
    stamp = data[start : start + len(_TS_PLACEHOLDER)]
    return stamp.decode() if start > 5 and _TS_VALUE.fullmatch(stamp) else None


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a temp file's writer, a lock holder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _copy_range(source: int, target: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes of ``source`` from ``offset`` to the start of ``target``."""
    written = 0
    try:
        while written < length:
            copied = os.copy_file_range(source, target, length - written, offset + written)
            if not copied:
                break
            written += copied
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while written < length:  # a file system without copy_file_range: copy by hand
            chunk = os.pread(source, min(length - written, READ_MAX_BYTES), offset + written)
            if not chunk:
                break
            os.lseek(target, written, os.SEEK_SET)
            write_all(target, chunk)
            written += len(chunk)
    if written != length:
        raise StoreError(f"inbox shrank while it was copied ({written} of {length} bytes)")


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


def _last_line(fd: int, size: int) -> tuple[int, bytes]:
    """The last whole line before ``size`` (which ends just after a newline)."""
    if size == 0:
        return 0, b""
    start = _line_start(fd, size - 1)
    return start, _pread_all(fd, size - start, start)


# -- teams on disk ---------------------------------------------------------------------------


def create_team_files(home: Path, name: str, agents: Iterable[str], roster: bytes) -> Path:
    """Create a team's directory with its roster and an empty inbox for every agent.

    The team is built in a hidden temporary directory and renamed into place, so it
    appears whole or not at all, and of two concurrent creators exactly one wins.
    """
    agents = list(agents)
    parent = teams_dir(home)
    ensure_dir(parent)
    target = parent / name
    if target.exists() or target.is_symlink():
        raise FileExistsError(target)
    staging = parent / f".{name}.{os.getpid()}.{time.time_ns()}.new"
    ensure_dir(staging / "mailbox")
    try:
        for agent in agents:
            os.close(
                open_private(
                    staging / "mailbox" / f"{agent}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL
                )
            )
        for sub in ("cursors", "deadletters", "bases", "tmp"):
            ensure_dir(staging / sub)
        for agent in agents:  # gc writes bases in place: their blocks exist before a disk fills
            _BaseFile(staging / "bases" / f"{agent}.base").create()
        fd = open_private(staging / "team.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, roster)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(target) from None
            raise
        fsync_dir(parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def read_roster(home: Path, name: str) -> bytes:
    """The bytes of a team's ``team.json``; FileNotFoundError when there is no such team."""
    fd = open_private(teams_dir(home) / name / "team.json", os.O_RDONLY)
    try:
        return _pread_all(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def team_names(home: Path) -> list[str]:
    """The names of the teams under ``home`` that have a roster, sorted."""
    try:
        entries = sorted(os.listdir(teams_dir(home)))
    except FileNotFoundError:
        return []
    return [
        e
        for e in entries
        if not e.startswith(".") and (teams_dir(home) / e / "team.json").is_file()
    ]


def remove_team_files(home: Path, name: str) -> None:
    """Delete a team's directory: renamed aside first, so it disappears at once and whole."""
    target = teams_dir(home) / name
    doomed = teams_dir(home) / f".{name}.{os.getpid()}.{time.time_ns()}.deleted"
    os.rename(target, doomed)
    shutil.rmtree(doomed)
