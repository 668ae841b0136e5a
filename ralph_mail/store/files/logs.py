"""A team store's logs: inboxes, channels and team logs, read and written; the cursors
of their readers; compaction as the cursors allow it; and search through them.

The inbox log itself is `InboxLog` (inbox.py); this is the part of `FileStore` that
turns its errors into `StoreError` and ties it to cursors, the archive and the index.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import zlib
from typing import TYPE_CHECKING

from ralph_mail.errors import StoreError
from ralph_mail.message import check_name
from ralph_mail.settings import FILE_MODE, spin_seconds
from ralph_mail.store.base import Compaction, Cursor, check_key
from ralph_mail.store.files.archive import Archive
from ralph_mail.store.files.bells import Bell, PollingNote, Waiting, ring, survey
from ralph_mail.store.files.inbox import READ_MAX_BYTES, InboxState
from ralph_mail.store.files.layout import log_place
from ralph_mail.store.files.posix import open_file, read_file, store_error, write_all
from ralph_mail.store.files.slots import SlotFile
from ralph_mail.store.files.team import LOGS_KEPT, TeamFiles
from ralph_mail.store.files.watch import Watcher

if TYPE_CHECKING:
    from ralph_mail.store.search import Query, SearchIndex

#: A cursor's slot: floor, inode of the inbox it belongs to, count, then the offsets
#: acknowledged above the floor.
_CURSOR = struct.Struct("<qQI")
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


class Logs(TeamFiles):
    """Inboxes, channels, team logs and cursors (mixed into `FileStore`)."""

    # -- inboxes ---------------------------------------------------------------------------

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        try:  # (the log rings its waiters once the line is written)
            return self._log(agent).append(head, tail, self.durable)
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "append to") from None
        finally:
            if len(self._logs) > LOGS_KEPT:  # a log closed for this one: after the ring
                self.trim()

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

    def read_tails(self, agents: list[str], lines: int) -> list[tuple[list[bytes], int]]:
        """`read_tail` of each: a few reads from each end, nothing to gain at once."""
        return [self.read_tail(agent, lines) for agent in agents]

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

    def size(self, agent: str) -> int:
        try:
            return self._log(agent).size()
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def inbox_state(self, agent: str) -> InboxState:
        """Size, base, and whether the inbox is locked now or ends in a torn line."""
        try:
            return self._log(agent).state()
        except OSError as exc:
            raise store_error(exc, f"inbox {self.inbox_path(agent)}", "read") from None

    def create_log(self, key: str) -> None:
        try:
            where, name = log_place(key)
            os.close(open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.dirs.get(where)))
        except FileExistsError:
            raise
        except OSError as exc:
            raise store_error(exc, str(self.inbox_path(key)), "create") from None
        ring(self.dirs, key)

    def waiter(self, agents: list[str]) -> Watcher:
        """A watcher woken by changes to these inboxes, channels (``#NAME``), team logs
        (``log:NAME``) and owners' commits (``commits:AGENT``), and by their replacement:
        by their senders' doorbell (bells.py), or file events, or polling (watch.py)."""
        self.dirs.get("mailbox", create=False)  # a missing or deleted team: a clear error now
        places: dict[str, list[str]] = {"mailbox": []}
        for key in agents:
            if key.startswith("commits:"):
                where, name = "cursors", f"{key[8:]}.commits"
            elif key.startswith("log:"):
                where, name = "logs", f"{key[4:]}.jsonl"
            else:
                where, name = log_place(key)
            places.setdefault(where, []).append(name)
            self.dirs.get(where)
        mailbox = places.pop("mailbox")
        more = {self.dirs.path(where): names for where, names in places.items()}
        dirs, spin = self.dirs, spin_seconds()  # a bad RALPH_SPIN_US: refused here, whole
        logs, cursors = self._logs, self._cursors  # (dicts for the store's life: `_kept`)

        def look() -> None:  # before blocking, so that the wake-up need not: the read
            for agent in agents:  # after it starts with its pread, the save does not look
                log = logs.get(agent)
                if log is not None:
                    log.before_wait()
                slots = cursors.get(agent)
                if slots is not None:
                    slots.look()

        return Watcher(
            self.dirs.path("mailbox"),
            mailbox,
            more,
            bell=lambda: Bell(dirs, agents, spin),
            note=lambda reason: PollingNote(dirs, reason),
            before=look,
        )

    def waiting(self) -> Waiting:
        """How many processes wait on the team now, on doorbells or polling, and why
        (for doctor)."""
        return survey(self.dirs)

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        """Drop ``agent``'s archived messages older than ``before`` (a ts); return where
        its audit trail starts now (the inbox's base when nothing is archived)."""
        check_name(agent, "agent name")
        start = self._log(agent).purge_archive(before, timeout)
        return start if start else self.inbox_state(agent).base

    # -- compaction ------------------------------------------------------------------------

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

    # -- cursors ---------------------------------------------------------------------------

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

    def consumed(self, agent: str, offset: int) -> bool:
        """Whether the owner's cursor passed the line at ``offset`` (saved before its
        commit time is recorded)."""
        return self.load_cursor(agent).passed(offset)

    def settle_cursor(self, agent: str) -> None:
        """Nothing to wait for: `save_cursor` returns once it is written."""

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

    # -- team logs -------------------------------------------------------------------------

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
        ring(self.dirs, f"log:{name}")

    def log_read(self, name: str) -> bytes:
        check_key(name, "log name")
        try:
            data = read_file(f"{name}.jsonl", self.dirs.get("logs"))
        except FileNotFoundError:
            return b""
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("logs", f"{name}.jsonl")), "read") from None
        return data[: data.rfind(b"\n") + 1]

    # -- search ----------------------------------------------------------------------------

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


_SEARCH_DB = "search.sqlite3"
_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
