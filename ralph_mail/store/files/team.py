"""What every part of one team's file store shares: its directories, the descriptors it
keeps open between calls, and their lifetime (closed, collected, renewed when the team is
made again).

`FileStore` (backend.py) is `TeamFiles` with its parts mixed in: logs.py (inboxes,
channels, team logs, cursors, search), records.py (presence, state, rates, indexes, dead
letters) and maintenance.py (gc); the claims of inboxes are in claims.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ralph_mail.store.files.claims import Claims
from ralph_mail.store.files.deadletters import DeadLetters
from ralph_mail.store.files.inbox import InboxLog, Left
from ralph_mail.store.files.indexes import IndexFiles
from ralph_mail.store.files.layout import TeamDirs, log_place
from ralph_mail.store.files.posix import (
    my_pid,
    open_file,
    read_file,
    replace_file,
    store_error,
)
from ralph_mail.store.files.slots import SlotFile

if TYPE_CHECKING:
    from ralph_mail.store.search import SearchIndex

#: How many inbox and channel logs one store keeps open (two descriptors each at most);
#: the least recently used is closed first, so a lead of many agents holds a few dozen.
LOGS_KEPT: Final = 16
#: How many closed inbox logs a store remembers what their writer knew (`Left`) for.
LEFT_KEPT: Final = 4096


class TeamFiles:
    """The files of one team, and the descriptors kept open on them.

    Descriptors inherited through ``fork`` are never reused: a child shares the parent's
    open file description, and with it the parent's flock.
    """

    def __init__(self, home: Path, team: str, *, durable: bool = False) -> None:
        self.team = team
        self.durable = durable
        self.dirs = TeamDirs(home, team)
        self._logs: OrderedDict[str, InboxLog] = OrderedDict()  # the last used, last
        self._logs_lock = threading.Lock()
        self._left: dict[str, Left] = {}  # of logs closed, the oldest first
        self._cursors: dict[str, SlotFile] = {}
        self._claims = Claims(self.dirs, team)
        self._state_fds: dict[str, int] = {}  # small files kept: state (control, rates), commits
        self._index_files = IndexFiles(self.dirs)
        self._maps: dict[str, mmap.mmap] = {}  # state files shared through mmap
        self._versions: dict[str, tuple[int, float, tuple[int, ...] | None]] = {}
        self._search: SearchIndex | None = None
        self._presence: OrderedDict[str, SlotFile] = OrderedDict()  # the last used, last
        self._presence_lock = threading.Lock()
        # Per inbox owner: the last floor and time in its commits file, records appended.
        self._commit_state: dict[str, list[int]] = {}
        self._generation = 0
        # Held around each flock taken on a descriptor this store shares between threads
        # (the state's control file, rate rings): flock excludes other processes only.
        self._threads, self._threads_pid = threading.Lock(), my_pid()
        # A store dropped without close() still gives its descriptors back when collected.
        weakref.finalize(self, _close_all, *self._kept())

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

    def _log(self, agent: str) -> InboxLog:
        """The log of ``agent``'s inbox (or ``#NAME``), its descriptors kept open for the
        next call: `LOGS_KEPT` logs (one more until `trim`), the least recently used
        closed first."""
        log = self._logs.get(agent)
        if log is not None:
            try:
                self._logs.move_to_end(agent)  # atomic, as the get: no lock on this path
                return log
            except KeyError:  # another thread closed it just now: open it again below
                pass
        with self._logs_lock:
            log = self._logs.get(agent)  # another thread may have opened it meanwhile
            if log is not None:
                return log
            log = self._logs[agent] = InboxLog(
                self.dirs, agent, DeadLetters(self.dirs, agent), self._left.pop(agent, None)
            )
        if len(self._logs) > LOGS_KEPT + 1:  # (an append trims after its ring: `trim`)
            self.trim()
        return log

    def trim(self) -> None:
        """Close the least recently used logs over `LOGS_KEPT`, remembering what their
        writers knew (`Left`): a lead of more agents than that comes back to each."""
        while len(self._logs) > LOGS_KEPT:
            with self._logs_lock:
                if len(self._logs) <= LOGS_KEPT:
                    return
                evicted = self._logs.popitem(last=False)[1]
            left = evicted.leave()
            if left is not None:
                with self._logs_lock:
                    self._left[evicted.agent] = left
                    if len(self._left) > LEFT_KEPT:
                        del self._left[next(iter(self._left))]

    def _one_thread(self) -> threading.Lock:
        """The lock of `_threads` (a new one in a child forked while a thread held it)."""
        if self._threads_pid != my_pid():
            self._threads, self._threads_pid = threading.Lock(), my_pid()
        return self._threads

    def _fresh(self) -> None:
        """After the team was deleted and made again, forget what belonged to the old one:
        kept cursor descriptors, and claims (taken again on the new team's lock)."""
        if self._generation == self.dirs.generation:
            return
        self._generation = self.dirs.generation
        self._left.clear()
        for slots in self._cursors.values():
            slots.close()
        self._cursors.clear()
        _close_state(self._state_fds, self._maps)
        self._versions.clear()
        for slots in self._presence.values():
            slots.close()
        self._presence.clear()
        self._claims.renew()

    # -- one consumer per inbox ------------------------------------------------------------

    def claim(self, agent: str) -> None:
        """Become the one consumer of ``agent``'s inbox for this process (see `Claims`)."""
        self._fresh()
        self._claims.claim(agent)

    def release(self, agent: str) -> None:
        self._claims.release(agent)

    def consumer(self, agent: str) -> int | None:
        """The pid of the process consuming ``agent``'s inbox now, or None."""
        return self._claims.consumer(agent)

    def _kept(self) -> tuple[Any, ...]:
        """What the store keeps open, as `_close_all` takes it (the same objects for the
        life of the store: they are emptied and filled, never replaced)."""
        slots = {"cursors": self._cursors, "presence": self._presence}
        return (self._logs, slots, self._claims, self._index_files, self._state_fds, self._maps,
                self.dirs)  # fmt: skip

    def close(self) -> None:
        """Close every kept descriptor and give up claims (those inherited through fork
        are left alone)."""
        if self._search is not None:
            self._search.close()
            self._search = None
        _close_all(*self._kept())


def _close_all(
    logs: dict[str, InboxLog],
    slot_files: dict[str, dict[str, SlotFile]],
    claims: Claims,
    index_files: IndexFiles,
    state_fds: dict[str, int],
    maps: dict[str, mmap.mmap],
    dirs: TeamDirs,
) -> None:
    # Takes the parts, not the store, so that it can also run as the store's finalizer.
    claims.close()
    for log in logs.values():
        log.close()
    logs.clear()
    for kept in slot_files.values():
        for slots in kept.values():
            slots.close()
        kept.clear()
    index_files.close()
    _close_state(state_fds, maps)
    dirs.close()


def _close_state(state_fds: dict[str, int], maps: dict[str, mmap.mmap]) -> None:
    for shared in maps.values():
        with contextlib.suppress(BufferError, ValueError):
            shared.close()
    maps.clear()
    for fd in state_fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    state_fds.clear()
