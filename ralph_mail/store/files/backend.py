"""The file backend: `FileBackend` (a home of teams) and `FileStore` (one team's files).

The inbox log is in inbox.py, the slot file in slots.py, the layout in layout.py and the
POSIX helpers in posix.py; this module puts them together behind `TeamStore`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import struct
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from ralph_mail.errors import InboxBusy, LockTimeout, StoreError
from ralph_mail.message import check_name, format_ts
from ralph_mail.settings import FILE_MODE
from ralph_mail.store.base import Compaction, Cursor, Finding, check_key
from ralph_mail.store.files.archive import Archive
from ralph_mail.store.files.inbox import READ_MAX_BYTES, InboxLog, InboxState
from ralph_mail.store.files.layout import (
    TeamDirs,
    create_team_files,
    log_place,
    read_roster,
    remove_team_files,
    team_names,
)
from ralph_mail.store.files.posix import (
    open_file,
    pid_alive,
    pread_all,
    read_file,
    replace_file,
    store_error,
    write_all,
)
from ralph_mail.store.files.slots import SlotFile
from ralph_mail.store.files.watch import Watcher

if TYPE_CHECKING:
    from ralph_mail.store.base import Query
    from ralph_mail.store.search import SearchIndex

_CURSOR = struct.Struct("<qQI")
#: One index entry: a magic, the inbox's agent name (NUL-padded), the line's offset and
#: length, then a crc32 of those: 84 bytes.
_ENTRY = struct.Struct("<2s64sqI")
_CRC = struct.Struct("<I")
_RECORD = _ENTRY.size + _CRC.size
_MAGIC = b"\xa5\x5a"
_INDEX_KEY = re.compile(r"[a-z]+\+[A-Za-z0-9_.+-]{1,140}")
_LEGACY_CURSOR = struct.Struct("<QqI")


def _legacy_cursor(slot: bytes) -> tuple[int, bytes] | None:
    # The cursor as the first release wrote it: seq, floor, count, offsets, crc32.
    if len(slot) < _LEGACY_CURSOR.size + 4:
        return None
    seq, floor, count = _LEGACY_CURSOR.unpack_from(slot)
    end = _LEGACY_CURSOR.size + 8 * count
    if (
        not seq
        or end + 4 > len(slot)
        or struct.unpack_from("<I", slot, end)[0] != zlib.crc32(slot[:end])
    ):
        return None
    return seq, _CURSOR.pack(floor, 0, count) + slot[_LEGACY_CURSOR.size : end]


#: This process's claims: (team directory inode, agent) -> (pid, lock descriptor, users).
_claims: dict[tuple[int, int, str], list[int]] = {}


class FileStore:
    """The files of one team (see layout.py for where each lives).

    Keeps descriptors open between calls (that is what makes a send cost microseconds);
    call `close` when done. Descriptors inherited through ``fork`` are never reused: a
    child shares the parent's open file description, and with it the parent's flock.

    Example:
        >>> store = FileBackend(Path("/tmp/mail")).team_store("demo")   # doctest: +SKIP
        >>> store.size("lead")                                           # doctest: +SKIP
        0
    """

    def __init__(self, home: Path, team: str, *, durable: bool = False) -> None:
        self.team = team
        self.durable = durable
        self.dirs = TeamDirs(home, team)
        self._logs: dict[str, InboxLog] = {}
        self._cursors: dict[str, SlotFile] = {}
        self._claimed: dict[str, tuple[int, int, str]] = {}
        self._indexes: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}  # state files shared through mmap
        self._versions: dict[str, tuple[int, float, tuple[int, ...] | None]] = {}
        self._search: SearchIndex | None = None
        self._presence: dict[str, SlotFile] = {}
        self._generation = 0
        # A store dropped without close() still gives its descriptors back when collected.
        weakref.finalize(
            self,
            _close_all,
            self._logs,
            {"cursors": self._cursors, "presence": self._presence},
            self._claimed,
            self._indexes,
            self._maps,
            self.dirs,
        )

    # -- paths (for messages and doctor) ---------------------------------------------------

    @property
    def root(self) -> Path:
        """The team's directory (this backend's own business: doctor, tests)."""
        return self.dirs.root

    def inbox_path(self, agent: str) -> Path:
        return self.dirs.path(*log_place(agent))

    def cursor_path(self, agent: str) -> Path:
        return self.dirs.path("cursors", f"{agent}.cursor")

    def deadletter_path(self, agent: str) -> Path:
        return self.dirs.path("deadletters", f"{agent}.jsonl")

    def roster(self) -> bytes:
        try:
            return read_file("team.json", self.dirs.root_fd())
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("team.json")), "read") from None

    def update_roster(self, change: Callable[[bytes], bytes]) -> None:
        """Rewrite ``team.json`` as ``change(old)``, under ``roster.lock`` (never unlinked),
        atomically: a reader sees the old roster or the new one."""
        where = str(self.dirs.path("team.json"))
        try:
            root = self.dirs.root_fd()
            lock = open_file("roster.lock", os.O_RDWR | os.O_CREAT, root)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                replace_file("team.json", change(read_file("team.json", root)), root)
            finally:
                os.close(lock)
        except OSError as exc:
            raise store_error(exc, where, "rewrite") from None

    # -- presence --------------------------------------------------------------------------

    def save_presence(self, agent: str, record: bytes) -> None:
        """Keep ``record`` as ``agent``'s presence (a slot file: no fsync, a pwrite)."""
        dirs = self.dirs
        slots = self._presence.get(agent)
        if slots is None:
            slots = self._presence[agent] = SlotFile(
                lambda: dirs.get("presence"), f"{agent}.slot", f"presence of {agent!r}"
            )
        slots.save(record)

    def load_presence(self, agent: str) -> bytes | None:
        """The last presence record saved for ``agent`` (None: never)."""
        dirs = self.dirs
        return SlotFile(
            lambda: dirs.get("presence"), f"{agent}.slot", f"presence of {agent!r}"
        ).load()

    # -- inboxes ---------------------------------------------------------------------------

    def _log(self, agent: str) -> InboxLog:
        log = self._logs.get(agent)
        if log is None:
            log = self._logs[agent] = InboxLog(self.dirs, agent, _DeadLetters(self.dirs, agent))
        return log

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        try:
            return self._log(agent).append(head, tail, self.durable)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "append to") from None

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        try:
            return self._log(agent).read(offset, skip_collected)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        try:
            return self._log(agent).read_tail(lines)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def read_line(self, agent: str, offset: int, length: int) -> bytes | None:
        """The line at ``offset``, from the inbox or, once gc collected it, its archive."""
        try:
            line = self._log(agent).read_line(offset, length)
            if line is None:
                line = Archive(self.dirs, agent).read_line(offset, length)
            return line
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def read_audit(self, agent: str, offset: int) -> tuple[bytes, int]:
        """Whole lines from logical ``offset`` of the agent's audit trail: its archive
        below the inbox's base, the inbox above it (see `TeamStore.read_audit`)."""
        data, start = self.read(agent, offset, skip_collected=True)
        if start == offset:
            return data, start
        try:  # below the inbox's base: gc archived it
            archived, at = Archive(self.dirs, agent).read(offset, READ_MAX_BYTES)
        except OSError as exc:
            raise store_error(exc, f"archive of {agent!r}", "read") from None
        if archived and at < start:
            return archived[: start - at] if at + len(archived) > start else archived, at
        return data, start

    def search(self, query: Query) -> list[bytes]:
        """Through the FTS5 index ``index/search.sqlite3`` (see `ralph_mail.store.search`)."""
        import sqlite3  # here: the command line must not pay for it on every start

        try:
            found = self._search_index().search(query)
        except sqlite3.Error as exc:
            raise StoreError(
                f"the search index {self.dirs.path('index', _SEARCH_DB)} failed ({exc}): "
                "delete it, and the next search rebuilds it"
            ) from None
        lines = (self.read_line(inbox, offset, length) for inbox, offset, length in found)
        return [line for line in lines if line is not None]  # purged since: not shown

    def forget_archived(self, agent: str, offset: int) -> None:
        import sqlite3

        try:
            self._search_index().forget_before(agent, offset)
        except sqlite3.Error as exc:
            raise StoreError(f"the search index failed ({exc}): delete it to rebuild it") from None

    def _search_index(self) -> SearchIndex:
        import sqlite3

        from ralph_mail.store.search import SearchIndex

        if self._search is None or self.dirs.generation != self._generation:
            self._fresh()
            path = self.dirs.path("index", _SEARCH_DB)
            self.dirs.get("index")
            if path.is_symlink():
                raise StoreError(f"{path} is a symlink: refusing to follow it; remove it", path)

            def connect() -> sqlite3.Connection:
                db = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
                os.chmod(path, FILE_MODE)
                return db

            self._search = SearchIndex(connect, self.read_audit, self._members)
        return self._search

    def _members(self) -> list[str]:
        """Every inbox of the team (a former member's too), by name, then every channel."""
        names = sorted(n[:-6] for n in os.listdir(self.dirs.get("mailbox")) if n.endswith(".jsonl"))
        channels = sorted(n[:-6] for n in os.listdir(self.dirs.get("channels"))
                          if n.endswith(".jsonl"))  # fmt: skip
        return [name for name in names if _NAME_OK.fullmatch(name)] + [
            f"#{name}" for name in channels if _NAME_OK.fullmatch(name)
        ]

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        """Drop ``agent``'s archived messages older than ``before`` (a ts); return where
        its audit trail starts now (the inbox's base when nothing is archived)."""
        check_name(agent, "agent name")
        start = self._log(agent).purge_archive(before, timeout)
        return start if start else self.inbox_state(agent).base

    def _index_fd(self, key: str) -> int:
        if not _INDEX_KEY.fullmatch(key):
            raise StoreError(f"invalid index key {key!r}")
        fd = self._indexes.get(key)
        if fd is None or self.dirs.generation != self._generation:
            self._fresh()
            fd = open_file(
                f"{key}.idx", os.O_RDWR | os.O_APPEND | os.O_CREAT, self.dirs.get("index")
            )
            self._indexes[key] = fd
        return fd

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Append one entry (the inbox, offset, length) to ``index/KEY.idx``.

        An entry is one fixed-width, checksummed record written with a single O_APPEND
        write and no lock: the kernel puts each write whole at the end (an entry costs
        about a microsecond, against four with a flock around it). A write cut short (a
        full disk) leaves a fragment that readers step over by the checksum.
        """
        body = _ENTRY.pack(_MAGIC, agent.encode(), offset, length)
        record = body + _CRC.pack(zlib.crc32(body))
        try:
            os.write(self._index_fd(key), record)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("index", f"{key}.idx")), "write") from None

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        try:
            fd = self._index_fd(key)
            size = os.fstat(fd).st_size
            if size % _RECORD:  # a fragment somewhere: read it all and step over it
                data = pread_all(fd, size, 0)
            else:
                want = min(size, count * _RECORD)
                data = pread_all(fd, want, size - want)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("index", f"{key}.idx")), "read") from None
        entries = _entries(data)
        return entries[-count:] if count > 0 else []

    def size(self, agent: str) -> int:
        try:
            return self._log(agent).size()
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def collectable(self, agent: str, floor: int) -> int:
        log = self._logs.get(agent)
        return log.collectable(floor) if log is not None else 0

    def compact(
        self,
        agent: str,
        min_bytes: int = 1,
        *,
        timeout: float = 0.0,
        drop_before: str | None = None,
    ) -> Compaction:
        """Drop the lines ``agent`` has consumed from the front of its inbox.

        Cuts at the owner's committed cursor floor, so nothing unread (nor anything read out
        of order above the floor) is dropped, and every logical offset stays valid. Senders
        wait on the inbox lock while the unconsumed part is copied, then follow the new
        inode. Does nothing when fewer than ``min_bytes`` are consumed. A torn tail left by
        a killed sender is set aside first, as a sender would.

        Example:
            >>> store.compact("lead")          # doctest: +SKIP
            Compaction(agent='lead', removed=5120, kept=310, base=5120, messages=16)
        """
        log = self._log(agent)

        def floor_of(inode: int) -> int | None:
            floors = []
            for reader in self._readers(agent):
                floor, cursor_inode, _ = self._load_cursor(reader)
                if not log.follows(cursor_inode, inode):
                    return None
                floors.append(floor)
            return min(floors, default=None)

        try:
            return log.compact(floor_of, min_bytes, timeout, self.durable, drop_before)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "compact") from None

    def _readers(self, key: str) -> list[str]:
        """Whose cursors in log ``key`` hold what may be dropped: its owner (an inbox), or
        every member with a cursor in it (a channel)."""
        if not key.startswith("#"):
            return [key]
        prefix = f"{key}@"
        return [n[:-7] for n in os.listdir(self.dirs.get("cursors"))
                if n.startswith(prefix) and n.endswith(".cursor")]  # fmt: skip

    def drop_cursor(self, key: str) -> None:
        slots = self._cursors.pop(key, None)
        if slots is not None:
            slots.close()
        try:
            os.unlink(f"{key}.cursor", dir_fd=self.dirs.get("cursors"))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise store_error(exc, str(self.cursor_path(key)), "remove") from None

    def inbox_state(self, agent: str) -> InboxState:
        """Size, base, and whether the inbox is locked now or ends in a torn line."""
        try:
            return self._log(agent).state()
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def waiter(self, agents: list[str]) -> Watcher:
        """A watcher woken by changes to these inboxes, channels (``#NAME``) and team logs
        (``log:NAME``), and by their replacement."""
        self.dirs.get("mailbox", create=False)  # a missing or deleted team: a clear error now
        places: dict[str, list[str]] = {"mailbox": []}
        for key in agents:
            where, name = ("logs", f"{key[4:]}.jsonl") if key.startswith("log:") else log_place(key)
            places.setdefault(where, []).append(name)
            self.dirs.get(where)
        mailbox = places.pop("mailbox")
        more = {self.dirs.path(where): names for where, names in places.items()}
        return Watcher(self.dirs.path("mailbox"), mailbox, more)

    def create_log(self, key: str) -> None:
        try:
            where, name = log_place(key)
            os.close(open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.dirs.get(where)))
        except FileExistsError:
            raise
        except OSError as exc:
            raise store_error(exc, str(self.inbox_path(key)), "create") from None

    # -- cursors ---------------------------------------------------------------------------

    def _fresh(self) -> None:
        """After the team was deleted and made again, forget what belonged to the old one:
        kept cursor descriptors, and claims (taken again on the new team's lock)."""
        if self._generation == self.dirs.generation:
            return
        self._generation = self.dirs.generation
        for slots in self._cursors.values():
            slots.close()
        self._cursors.clear()
        _close_indexes(self._indexes, self._maps)
        self._versions.clear()
        for slots in self._presence.values():
            slots.close()
        self._presence.clear()
        agents = list(self._claimed)
        for agent in agents:
            self.release(agent)
        for agent in agents:
            self.claim(agent)

    def _cursor_file(self, agent: str) -> SlotFile:
        self._fresh()
        slots = self._cursors.get(agent)
        if slots is None:
            dirs = self.dirs  # not self: the finalizer holds the slot files, not the store
            slots = self._cursors[agent] = SlotFile(
                lambda: dirs.get("cursors"),
                f"{agent}.cursor",
                f"cursor {self.cursor_path(agent)}",
                _legacy_cursor,
            )
        return slots

    def _load_cursor(self, agent: str) -> tuple[int, int, set[int]]:
        payload = self._cursor_file(agent).load()
        if payload is None:
            return 0, 0, set()
        floor, inode, count = _CURSOR.unpack_from(payload)
        acked = set(struct.unpack_from(f"<{count}q", payload, _CURSOR.size))
        return floor, inode, acked

    def load_cursor(self, agent: str) -> Cursor:
        """The owner's persisted cursor (the inbox start when it never committed, or when
        the cursor belongs to an inbox that was since replaced)."""
        try:
            floor, inode, acked = self._load_cursor(agent)
            log = self._log(agent.partition("@")[0])
            current, base = log.current()
            # The cursor belongs to this inbox when gc's record links the two, or when the
            # inbox's offsets go on from it (a gc under way may have rewritten the record).
            related = inode == current or log.follows(inode, current) or 0 < base <= floor
            if not related:
                import warnings

                warnings.warn(
                    f"the cursor of {agent!r} belongs to an inbox that was replaced: "
                    "reading the new inbox from its start",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return Cursor(base)
        except OSError as exc:
            raise store_error(exc, f"cursor {self.cursor_path(agent)}", "read") from None
        if floor < base:  # no cursor (deleted to re-read): start at what gc kept
            return Cursor(base, {start for start in acked if start >= base})
        return Cursor(floor, acked)

    def save_cursor(self, agent: str, cursor: Cursor) -> None:
        """Persist ``cursor``: afterwards a crash leaves the old cursor or this one.

        A failed write raises `StoreError` and leaves the old cursor in force.
        """
        acked = sorted(cursor.acked)
        try:
            inode = self._log(agent.partition("@")[0]).current_inode()
            payload = _CURSOR.pack(cursor.floor, inode, len(acked)) + struct.pack(
                f"<{len(acked)}q", *acked
            )
            self._cursor_file(agent).save(payload)
        except OSError as exc:
            if self.dirs.replaced():  # the team was deleted under this process: say so
                raise self.dirs.gone() from None
            raise store_error(
                exc, f"cursor {self.cursor_path(agent)}", "save", "nothing was consumed"
            ) from None

    # -- one consumer per inbox --------------------------------------------------------------

    def claim(self, agent: str) -> None:
        """Become the one consumer of ``agent``'s inbox for this process (see `TeamStore`).

        The claim is an flock on ``consumers/<agent>.lock``: the kernel drops it when the
        process dies, so a killed consumer never keeps an inbox. The pid written in the
        file only names the holder in the error; the lock is what counts.
        """
        self._fresh()
        if agent in self._claimed:
            return
        try:
            key = (*_dir_key(self.dirs.root_fd()), agent)
            held = _claims.get(key)
            if held is not None and held[0] == os.getpid():
                held[2] += 1
            else:
                fd = open_file(f"{agent}.lock", os.O_RDWR | os.O_CREAT, self.dirs.get("consumers"))
                try:
                    _lock_claim(fd)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                    os.close(fd)
                    raise InboxBusy(
                        f"the inbox of {agent!r} in team {self.team!r} is being consumed by "
                        f"process {holder}: one consumer per inbox; stop that one first, or "
                        "look without consuming with 'ralph-mail tail' or 'read --peek'",
                        int(holder) if holder.isdigit() else None,
                    ) from None
                except BaseException:
                    os.close(fd)
                    raise
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _claims[key] = [os.getpid(), fd, 1]
        except OSError as exc:
            raise store_error(
                exc, str(self.dirs.path("consumers", f"{agent}.lock")), "claim"
            ) from None
        self._claimed[agent] = key

    def release(self, agent: str) -> None:
        key = self._claimed.pop(agent, None)
        if key is not None:
            _release(key)

    def consumer(self, agent: str) -> int | None:
        """The pid of the process consuming ``agent``'s inbox now, or None."""
        try:
            fd = open_file(f"{agent}.lock", os.O_RDONLY, self.dirs.get("consumers"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(
                exc, str(self.dirs.path("consumers", f"{agent}.lock")), "read"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(holder) if holder.isdigit() else -1
        finally:
            os.close(fd)
        return None

    # -- dead letters ----------------------------------------------------------------------

    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        """Record a line of ``agent``'s inbox that was set aside, and why."""
        _DeadLetters(self.dirs, agent)(offset, line, reason)

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        """Every dead letter recorded for ``agent``'s inbox, oldest first."""
        try:
            data = read_file(f"{agent}.jsonl", self.dirs.get("deadletters"))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise store_error(exc, f"dead letters {self.deadletter_path(agent)}", "read") from None
        records = []
        for line in data.splitlines():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                if line.strip():  # a record torn by a kill: keep what it says
                    text = line.decode("utf-8", "backslashreplace")
                    records.append({"reason": "damaged dead-letter record", "line": text})
        return records

    # -- team logs ------------------------------------------------------------------------

    def log_append(self, name: str, record: bytes) -> None:
        """Append ``record`` to ``logs/NAME.jsonl`` under an flock, in one write loop.

        A write cut short is cut back, so readers only ever see whole records.
        """
        check_key(name, "log name")
        where = str(self.dirs.path("logs", f"{name}.jsonl"))
        try:
            fd = open_file(f"{name}.jsonl", os.O_RDWR | os.O_APPEND | os.O_CREAT,
                           self.dirs.get("logs"))  # fmt: skip
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                size = os.fstat(fd).st_size
                try:
                    write_all(fd, record)
                    if self.durable:
                        os.fsync(fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                    raise
            finally:
                os.close(fd)
        except OSError as exc:
            raise store_error(exc, where, "append to", "nothing was recorded") from None

    def log_read(self, name: str) -> bytes:
        check_key(name, "log name")
        try:
            data = read_file(f"{name}.jsonl", self.dirs.get("logs"))
        except FileNotFoundError:
            return b""
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("logs", f"{name}.jsonl")), "read") from None
        return data[: data.rfind(b"\n") + 1]

    # -- small keyed state -----------------------------------------------------------------

    def load_state(self, key: str) -> bytes | None:
        """The bytes last saved under ``key`` (a name), or None when nothing was."""
        check_key(key, "state key")
        try:
            return read_file(f"{key}.json", self.dirs.get("state"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", f"{key}.json")), "read") from None

    def save_state(self, key: str, data: bytes) -> None:
        """Replace what is saved under ``key`` with ``data``, atomically and durably."""
        check_key(key, "state key")
        with self._saving():
            self._replace_state(key, data)

    def update_state(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Read, change and save ``key``, all under the flock of ``state/control``."""
        check_key(key, "state key")
        with self._saving():
            self._replace_state(key, change(self.load_state(key)))

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """Hold the flock of ``state/control`` for a save, and count the save there once
        it is done, so every process sees it at its next look (`state_version`)."""
        shared = self._mapped("control", 8)
        fd = self._indexes["control"]
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
            _COUNTER.pack_into(shared, 0, _COUNTER.unpack_from(shared, 0)[0] + 1)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _replace_state(self, key: str, data: bytes) -> None:
        try:
            replace_file(f"{key}.json", data, self.dirs.get("state"))
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", f"{key}.json")), "save") from None

    def state_version(self, key: str) -> tuple[int, ...] | None:
        """(inode, mtime in ns, size, mode) of the state file, or None when there is none.

        A save bumps a counter in ``state/control``, shared by every process through
        mmap: while it stays put, the answer comes from memory (0.2 µs, not a 2 µs stat
        per send), and is checked on disk again at least once a second, so a file edited
        by hand is noticed too.
        """
        cached = self._versions.get(key)
        shared = self._maps.get("control")
        now = time.monotonic()
        if (
            cached is not None
            and shared is not None
            and cached[0] == _COUNTER.unpack_from(shared, 0)[0]
            and now - cached[1] < 1.0
        ):
            return cached[2]  # the fast path: no save since, and looked at within 1 s
        if key not in _CHECKED:
            _CHECKED.add(check_key(key, "state key"))
        counter = self._control()
        try:
            found = os.stat(f"{key}.json", dir_fd=self.dirs.get("state"), follow_symlinks=False)
            version: tuple[int, ...] | None = (found.st_ino, found.st_mtime_ns, found.st_size,
                                               found.st_mode)  # fmt: skip
        except FileNotFoundError:
            version = None
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", f"{key}.json")), "read") from None
        self._versions[key] = (counter, now, version)
        return version

    def _control(self) -> int:
        """The counter of state saves in ``state/control``; -1 when a team made before it
        has none yet (a look never creates it: a save does)."""
        if "control" not in self._maps:
            try:
                os.stat("control", dir_fd=self.dirs.get("state"), follow_symlinks=False)
            except FileNotFoundError:
                return -1
            except OSError as exc:
                raise store_error(exc, str(self.dirs.path("state", "control")), "read") from None
        value: int = _COUNTER.unpack_from(self._mapped("control", 8), 0)[0]
        return value

    def _mapped(self, name: str, size: int) -> mmap.mmap:
        """``state/NAME`` mapped shared, at least ``size`` bytes (kept open)."""
        shared = self._maps.get(name)
        if shared is not None and len(shared) >= size and self.dirs.generation == self._generation:
            return shared
        self._fresh()
        try:
            fd = self._indexes.get(name)
            if fd is None:
                fd = open_file(name, os.O_RDWR | os.O_CREAT, self.dirs.get("state"))
                self._indexes[name] = fd
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: a counter at 0, an empty ring
            if shared is not None:
                shared.close()
            shared = self._maps[name] = mmap.mmap(fd, size)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", name)), "map") from None
        return shared

    def state_where(self, key: str) -> str:
        return str(self.dirs.path("state", f"{check_key(key, 'state key')}.json"))

    def take(self, key: str, limit: int, window: float) -> float:
        """A ring of ``limit`` event times in ``state/KEY.rate``, the oldest at its head,
        mapped shared and changed under an flock of that file, so concurrent processes
        count each event once; a take costs the lock and a few bytes of memory."""
        name = f"{key}.rate"
        try:
            ring = self._maps.get(name)
            if ring is None or len(ring) < _RING_HEAD.size + 8 * limit:
                if key not in _CHECKED:
                    _CHECKED.add(check_key(key, "rate key"))
                ring = self._mapped(name, _RING_HEAD.size + 8 * limit)
            fd = self._indexes[name]
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                return _take(ring, limit, window, time.time())
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", name)), "count") from None

    # -- maintenance -----------------------------------------------------------------------

    @contextlib.contextmanager
    def maintenance_lock(self, timeout: float) -> Iterator[None]:
        """Hold the team's ``gc.lock`` (filelock) for a maintenance run; `LockTimeout` after
        ``timeout`` seconds.

        filelock is right here and not on the send path: it costs 49 µs per acquire against
        0.6 µs for a raw flock, which only matters per message. The lock file is never
        unlinked: unlinking a locked file would split waiters across two inodes.
        """
        from filelock import FileLock, Timeout

        path = self.dirs.path("gc.lock")
        self.dirs.root_fd()  # the team exists and is no symlink
        if path.is_symlink():
            raise StoreError(f"{path} is a symlink: refusing to follow it; remove it", path)
        lock = FileLock(path, timeout=timeout, mode=0o600, preserve_lock_file=True)
        try:
            lock.acquire()
        except Timeout:
            raise LockTimeout(
                f"another gc of this team holds {path} (waited {timeout:g} s): "
                "let it finish, or find it with 'ralph-mail doctor'",
                path,
            ) from None
        except OSError as exc:
            raise store_error(exc, str(path), "take the gc lock") from None
        try:
            yield
        finally:
            lock.release()

    def collect(
        self, logs: list[str], min_bytes: int, drop_before: str | None, timeout: float
    ) -> tuple[tuple[Compaction, ...], tuple[Path, ...]]:
        """gc under the team's ``gc.lock``: the temp files of killed runs go, then each
        log is compacted (each under its own lock, waited for briefly)."""
        from ralph_mail import settings

        removed: list[Path] = []
        with self.maintenance_lock(timeout):
            for path in self.stale_temp_files():
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path)
            wait = settings.GC_INBOX_LOCK_WAIT_S
            compactions = tuple(
                self.compact(log, min_bytes, timeout=wait, drop_before=drop_before) for log in logs
            )
        return compactions, tuple(removed)

    def stale_temp_files(self) -> list[Path]:
        """Temp files (``.NAME.PID.gc`` or ``.tmp``) whose writer died before its rename."""
        stale = []
        for sub in ("tmp", "bases", "cursors", "state"):
            try:
                names = sorted(os.listdir(self.dirs.path(sub)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise store_error(exc, str(self.dirs.path(sub)), "list") from None
            for name in names:
                parts = name.rsplit(".", 2)
                if not name.startswith(".") or len(parts) < 3 or parts[2] not in ("gc", "tmp"):
                    continue
                if not (parts[1].isdigit() and pid_alive(int(parts[1]))):
                    stale.append(self.dirs.path(sub, name))
        return stale

    def close(self) -> None:
        """Close every kept descriptor and give up claims (those inherited through fork
        are left alone)."""
        if self._search is not None:
            self._search.close()
            self._search = None
        _close_all(
            self._logs,
            {"cursors": self._cursors, "presence": self._presence},
            self._claimed,
            self._indexes,
            self._maps,
            self.dirs,
        )


class _DeadLetters:
    """Writes the dead letters of one inbox (a callable, handed to the inbox log)."""

    def __init__(self, dirs: TeamDirs, agent: str) -> None:
        self._dirs = dirs
        self._agent = agent

    def __call__(self, offset: int, line: bytes, reason: str) -> None:
        agent = self._agent
        record = {
            "ts": format_ts(time.time_ns() // 1000),
            "inbox": agent,
            "offset": offset,
            "reason": reason,
            "line": line.decode("utf-8", "backslashreplace"),
        }
        data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        try:
            fd = open_file(
                f"{agent}.jsonl",
                os.O_RDWR | os.O_APPEND | os.O_CREAT,
                self._dirs.get("deadletters"),
            )
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # a record torn by a kill: end it, keep this one whole
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            where = self._dirs.path("deadletters", f"{agent}.jsonl")
            raise store_error(exc, f"dead letters {where}", "write") from None


def _entries(data: bytes) -> list[tuple[str, int, int]]:
    """The whole, valid index entries in ``data``, in order, stepping over fragments."""
    entries = []
    position = 0
    while position + _RECORD <= len(data):
        body = data[position : position + _ENTRY.size]
        crc = _CRC.unpack_from(data, position + _ENTRY.size)[0]
        if body[:2] == _MAGIC and crc == zlib.crc32(body):
            _, agent, offset, length = _ENTRY.unpack(body)
            entries.append((agent.rstrip(b"\0").decode(), offset, length))
            position += _RECORD
        else:  # a fragment of a write cut short: find the next entry
            found = data.find(_MAGIC, position + 1)
            position = found if found >= 0 else len(data)
    return entries


def _dir_key(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


#: How long a claim keeps trying when the lock is taken (s): `consumer` probes with a
#: shared lock held for microseconds, and a claim meeting one must not fail; a consumer
#: holds it for as long as it runs.
_CLAIM_PATIENCE_S: Final = 0.05


def _lock_claim(fd: int) -> None:
    """The claim's exclusive flock; `BlockingIOError` when another consumer holds it."""
    deadline = time.monotonic() + _CLAIM_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def _release(key: tuple[int, int, str]) -> None:
    held = _claims.get(key)
    if held is None or held[0] != os.getpid():
        return  # inherited through fork: the parent's claim, not ours to drop
    held[2] -= 1
    if held[2] <= 0:
        os.close(held[1])
        del _claims[key]


def _close_all(
    logs: dict[str, InboxLog],
    slot_files: dict[str, dict[str, SlotFile]],
    claimed: dict[str, tuple[int, int, str]],
    indexes: dict[str, int],
    maps: dict[str, mmap.mmap],
    dirs: TeamDirs,
) -> None:
    # Takes the parts, not the store, so that it can also run as the store's finalizer.
    for key in claimed.values():
        _release(key)
    claimed.clear()
    for log in logs.values():
        log.close()
    logs.clear()
    for kept in slot_files.values():
        for slots in kept.values():
            slots.close()
        kept.clear()
    _close_indexes(indexes, maps)
    dirs.close()


_SEARCH_DB = "search.sqlite3"
_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_COUNTER = struct.Struct("<Q")
#: State and rate keys already checked: the checks stay off the send path.
_CHECKED: set[str] = set()
_RING_HEAD = struct.Struct("<QQ")  # limit, head: the slot of the oldest time
_RING_SLOT = struct.Struct("<d")


def _take(ring: mmap.mmap, limit: int, window: float, now: float) -> float:
    """One take on a mapped rate ring (see `FileStore.take`), under its lock."""
    size, oldest = _RING_HEAD.unpack_from(ring, 0)
    if size != limit:  # new, or the limit changed: keep the newest times that still fit
        count = min(size, (len(ring) - _RING_HEAD.size) // 8)
        times = list(struct.unpack_from(f"<{count}d", ring, _RING_HEAD.size))
        kept = (times[oldest:] + times[:oldest])[-limit:] if count else []
        times = [0.0] * (limit - len(kept)) + kept
        struct.pack_into(f"<{limit}d", ring, _RING_HEAD.size, *times)
        size, oldest = limit, 0
    slot = _RING_HEAD.size + 8 * oldest
    first: float = _RING_SLOT.unpack_from(ring, slot)[0]
    if first > now - window:
        _RING_HEAD.pack_into(ring, 0, limit, oldest)
        return first + window - now
    _RING_SLOT.pack_into(ring, slot, now)
    _RING_HEAD.pack_into(ring, 0, limit, (oldest + 1) % limit)
    return 0.0


def _close_indexes(indexes: dict[str, int], maps: dict[str, mmap.mmap]) -> None:
    for shared in maps.values():
        with contextlib.suppress(BufferError, ValueError):
            shared.close()
    maps.clear()
    for fd in indexes.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    indexes.clear()


class FileBackend:
    """Teams as directories under a home (``$RALPH_HOME/teams``).

    Example:
        >>> backend = FileBackend(Path("/tmp/mail"))   # doctest: +SKIP
        >>> backend.team_names()                        # doctest: +SKIP
        ['demo']
    """

    def __init__(self, home: Path) -> None:
        self.home = home

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        """File system, inotify, permissions, inboxes, cursors, dead letters, locks and
        leftovers of killed processes (`ralph_mail.store.files.doctor`)."""
        from ralph_mail.store.files import doctor

        return doctor.check(self.home, team, lock_wait)

    def where(self) -> str:
        return str(self.home)

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        try:
            create_team_files(self.home, name, agents, roster)
        except FileExistsError:
            raise
        except OSError as exc:
            raise store_error(exc, f"team {name!r} in {self.home}", "create") from None

    def read_roster(self, name: str) -> bytes:
        try:
            return read_roster(self.home, name)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise FileNotFoundError(name) from None
            raise store_error(exc, f"team {name!r} in {self.home}", "read") from None

    def team_names(self) -> list[str]:
        return team_names(self.home)

    def remove_team(self, name: str) -> None:
        try:
            remove_team_files(self.home, name)
        except OSError as exc:
            raise store_error(exc, f"team {name!r} in {self.home}", "delete") from None

    def team_store(self, name: str, *, durable: bool = False) -> FileStore:
        return FileStore(self.home, name, durable=durable)
