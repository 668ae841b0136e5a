"""The indexes of the file backend: where the lines of a conversation or a thread are.

An index is a file of fixed-width, checksummed entries, each appended with one O_APPEND
write and no lock: the kernel puts each write whole at the end (an entry costs about a
microsecond, against four with a flock around it). A write cut short (a full disk)
leaves a fragment that readers step over by the checksum.

Two kinds of file, so that neither the files of a team nor the descriptors of a process
grow with the number of threads:

- ``index/<key>.idx``: one per conversation (``pair+A+B``) and per agent's
  acknowledgements (``acks+A``, ``acked+A``): as many as the team has pairs. An entry is
  the inbox's agent, the line's offset and length: `index_tail` reads the last ``count``.
- ``index/threads.<xx>.idx``: the threads, `THREAD_BUCKETS` files shared by hash of
  the thread's id; an entry also names its thread. A thread whose first message had a
  fresh id starts with a *start mark* (`IndexFiles.start`), written before that message,
  so before any entry of the thread: a look at the thread reads the bucket backwards
  from its end, and stops at the mark (or once it has what it was asked for). The cost of
  a look is what the bucket took since the thread began, not the team's history.

A thread begun before threads shared files has a file of its own, ``index/thread+ID.idx``:
a look at a thread that meets no start mark reads that file too, when there is one.

Descriptors are kept open for the next entry, `KEPT` of them at most (the least recently
used is closed first), so a process that lives through a million threads holds a few.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from typing import Final

from ralph_mail.errors import StoreError
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import my_pid, open_file, pread_all, store_error, write_all

#: How many index files one store keeps open at once (least recently used closed first).
KEPT: Final = 8
#: How many files the threads of a team share.
THREAD_BUCKETS: Final = 256

_MAGIC = b"\xa5\x5a"
_CRC = struct.Struct("<I")
#: A conversation's entry: a magic, the inbox's agent name (NUL-padded), the line's offset
#: and length, then a crc32 of those: 84 bytes.
_ENTRY = struct.Struct("<2s64sqI")
_RECORD = _ENTRY.size + _CRC.size
#: A thread's entry: a magic, the thread's id, then as a conversation's: 96 bytes. A start
#: mark has offset -1 and no agent.
_THREAD_ENTRY = struct.Struct("<2s16s64sqI")
_THREAD_RECORD = _THREAD_ENTRY.size + _CRC.size
_THREAD_ID = 16
_POSITION = struct.Struct("<qI")  # an entry's end: the line's offset and length
#: How many (index, inbox) heads `IndexFiles.add` keeps packed before it starts again.
_HEADS_KEPT = 256
_INDEX_KEY = re.compile(r"[a-z]+\+[A-Za-z0-9_.+-]{1,140}")
#: Entries a backward look at a thread reads first; each further read takes four times more.
_FIRST_LOOK = 32

Entry = tuple[str, int, int]
_Found = tuple[bytes, str, int, int]  # an entry as read: its thread (b"" in a conversation) first


class IndexFiles:
    """The index files of one team (see the module docstring), for one process."""

    def __init__(self, dirs: TeamDirs) -> None:
        self.dirs = dirs
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._heads: dict[tuple[str, str], tuple[str, bytes]] = {}  # (key, inbox): file, head
        self._generation = dirs.generation
        self._pid = my_pid()
        # A descriptor is used and closed under this lock: a thread never writes to a
        # descriptor another thread closed (or that was reused for another file).
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------

    def add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Append one entry to index ``key``: the line at ``offset`` of ``agent``'s inbox."""
        self._write(*self._record(key, agent, offset, length))

    def extend(self, key: str, entries: list[tuple[str, int, int]]) -> None:
        """Append ``entries`` to index ``key`` in one write (a broadcast's copies): a write
        cut short leaves whole entries and one fragment, which readers step over."""
        records = [self._record(key, *entry) for entry in entries]
        if records:
            self._write(records[0][0], b"".join(record for _, record in records))

    def _record(self, key: str, agent: str, offset: int, length: int) -> tuple[str, bytes]:
        """The file of index ``key``, and its entry for that line of ``agent``'s inbox."""
        where = self._heads.get((key, agent))
        if where is None:  # checked and packed once per index and inbox: a send is hot
            name, thread = _file_of(key)
            if thread is None:
                head = _ENTRY.pack(_MAGIC, agent.encode(), 0, 0)[: -_POSITION.size]
            else:
                head = _THREAD_ENTRY.pack(_MAGIC, thread, agent.encode(), 0, 0)
                head = head[: -_POSITION.size]
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            where = self._heads[key, agent] = (name, head)
        body = where[1] + _POSITION.pack(offset, length)
        return where[0], body + _CRC.pack(zlib.crc32(body))

    def start(self, key: str) -> None:
        """Mark the start of thread ``key`` (``thread+ID``, an id never used before): a
        look at it stops here. Other keys have nothing to mark."""
        name, thread = _file_of(key)
        if thread is not None:
            body = _THREAD_ENTRY.pack(_MAGIC, thread, b"", -1, 0)
            self._write(name, body + _CRC.pack(zlib.crc32(body)))

    def _write(self, name: str, record: bytes) -> None:
        try:
            with self._lock:
                write_all(self._fd(name), record)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("index", name)), "write") from None

    # -- reading ---------------------------------------------------------------------------

    def tail(self, key: str, count: int) -> list[Entry]:
        """The last ``count`` entries of index ``key``, oldest first: O(count) for a
        conversation; for a thread, what its bucket took since the thread began at most."""
        name, thread = _file_of(key)
        if count <= 0:
            return []
        try:
            with self._lock:
                fd = self._fd(name, create=False)  # a look makes no file: an entry does
                if thread is None:
                    return _tail(fd, count) if fd >= 0 else []
                found, marked = _thread_tail(fd, thread, count) if fd >= 0 else ([], False)
            if not marked and len(found) < count:  # begun before threads shared files?
                found = self._legacy(f"{key}.idx", count - len(found)) + found
            return found
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("index", name)), "read") from None

    def _legacy(self, name: str, count: int) -> list[Entry]:
        """The last ``count`` entries of ``index/NAME``, a thread's own file as releases
        before the shared files made one (a team made then keeps its threads)."""
        try:
            fd = open_file(name, os.O_RDONLY, self.dirs.get("index"))
        except FileNotFoundError:
            return []
        try:
            return _tail(fd, count)
        finally:
            os.close(fd)

    # -- descriptors -----------------------------------------------------------------------

    def _fd(self, name: str, *, create: bool = True) -> int:
        """A kept descriptor on ``index/NAME`` (under ``_lock``), opened when missing;
        -1 when there is no such file and not ``create``."""
        if self._generation != self.dirs.generation or self._pid != my_pid():
            self._forget()
        fd = self._fds.get(name)
        if fd is not None:
            self._fds.move_to_end(name)
            return fd
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd = open_file(name, flags, self.dirs.get("index"))
        except FileNotFoundError:
            if create:
                raise
            return -1
        self._fds[name] = fd
        while len(self._fds) > KEPT:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _forget(self) -> None:
        """Drop descriptors of an older team (or inherited through fork: not ours to close)."""
        if self._pid == my_pid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds.clear()
        self._generation, self._pid = self.dirs.generation, my_pid()

    def kept(self) -> int:
        """How many descriptors are open now (at most `KEPT`)."""
        return len(self._fds)

    def close(self) -> None:
        with self._lock:
            if self._pid == my_pid():
                for fd in self._fds.values():
                    os.close(fd)
            self._fds.clear()


@functools.lru_cache(maxsize=256)
def _file_of(key: str) -> tuple[str, bytes | None]:
    """The file index ``key`` is kept in, and the thread id its entries carry (None: a
    file of its own). Kept for the last keys: a thread's is asked for at its start, at
    each entry and at each look."""
    if not _INDEX_KEY.fullmatch(key):
        raise StoreError(f"invalid index key {key!r}")
    kind, _, rest = key.partition("+")
    if kind != "thread":
        return f"{key}.idx", None
    thread = rest.encode()
    if len(thread) > _THREAD_ID:
        raise StoreError(f"invalid index key {key!r}: a thread id has at most {_THREAD_ID} bytes")
    return f"threads.{zlib.crc32(thread) % THREAD_BUCKETS:02x}.idx", thread


def _tail(fd: int, count: int) -> list[Entry]:
    size = os.lseek(fd, 0, os.SEEK_END)  # not fstat: no stat result to build
    if size % _RECORD:  # a fragment somewhere: read it all and step over it
        data = pread_all(fd, size, 0)
    else:
        want = min(size, count * _RECORD)
        data = pread_all(fd, want, size - want)
    entries = [(agent, offset, length) for _, agent, offset, length in _valid(data, _ENTRY)]
    return entries[-count:]


def _thread_tail(fd: int, thread: bytes, count: int) -> tuple[list[Entry], bool]:
    """The last ``count`` entries of ``thread`` in its bucket, read backwards from the end
    in growing steps until the thread's start mark, the bucket's start, or ``count``;
    and whether the mark was met."""
    size = os.lseek(fd, 0, os.SEEK_END)  # not fstat: no stat result to build
    if size % _THREAD_RECORD:  # a fragment somewhere: read it all and step over it
        whole = _valid(pread_all(fd, size, 0), _THREAD_ENTRY)
        return _after_mark([e for e in whole if e[0] == thread], count)
    # The bare id is looked for: the whole field, NUL-padded, is found 6x slower (its
    # NULs meet the padding of every entry). Where it is, the field and the entry's
    # start are checked.
    field = _MAGIC + thread.ljust(_THREAD_ID, b"\0")
    found: list[_Found] = []
    end, step = size, _FIRST_LOOK * _THREAD_RECORD
    while end > 0:
        start = max(0, end - step)
        data = pread_all(fd, end - start, start)
        chunk = []
        at = data.find(thread)
        while at >= 0:
            first = at - len(_MAGIC)
            if first % _THREAD_RECORD == 0 and data.startswith(field, first):
                chunk += _valid(data[first : first + _THREAD_RECORD], _THREAD_ENTRY)
            at = data.find(thread, at + 1)
        found[:0] = chunk
        if any(offset < 0 for _, _, offset, _ in chunk):
            break
        if sum(1 for _, _, offset, _ in found if offset >= 0) >= count:
            break
        end, step = start, step * 4
    return _after_mark(found, count)


def _after_mark(found: list[_Found], count: int) -> tuple[list[Entry], bool]:
    """The last ``count`` entries after the last start mark (the thread's), without the
    mark, and whether there was one."""
    marks = [i for i, (_, _, offset, _) in enumerate(found) if offset < 0]
    kept = found[marks[-1] + 1 :] if marks else found
    return [(agent, offset, length) for _, agent, offset, length in kept][-count:], bool(marks)


def _valid(data: bytes, entry: struct.Struct) -> list[_Found]:
    """The whole, valid entries (of layout ``entry``) in ``data``, in order, stepping over
    fragments; each as ``(thread, agent, offset, length)``, thread b"" in a conversation."""
    found = []
    record = entry.size + _CRC.size
    position = 0
    while position + record <= len(data):
        body = data[position : position + entry.size]
        crc = _CRC.unpack_from(data, position + entry.size)[0]
        if body[:2] == _MAGIC and crc == zlib.crc32(body):
            *thread, agent, offset, length = entry.unpack(body)[1:]
            key = thread[0].rstrip(b"\0") if thread else b""
            found.append((key, agent.rstrip(b"\0").decode(), offset, length))
            position += record
        else:  # a fragment of a write cut short: find the next entry
            at = data.find(_MAGIC, position + 1)
            position = at if at >= 0 else len(data)
    return found
