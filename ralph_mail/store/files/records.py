"""A team store's small records: presence, keyed state (with the save counter every
process watches), rate rings, the indexes of conversations and threads (indexes.py), dead letters.

Presence is a slot file (slots.py); state a file per key, replaced whole; a rate ring
and the save counter are files mapped shared.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

from ralph_mail.store.base import check_key
from ralph_mail.store.files.deadletters import DeadLetters
from ralph_mail.store.files.posix import open_file, read_file, replace_file, store_error
from ralph_mail.store.files.slots import SlotFile
from ralph_mail.store.files.team import TeamFiles

_COUNTER = struct.Struct("<Q")
#: State and rate keys already checked: the checks stay off the send path.
_CHECKED: set[str] = set()
_RING_HEAD = struct.Struct("<QQ")  # limit, head: the slot of the oldest time
_RING_SLOT = struct.Struct("<d")


#: How many presence files one store keeps open (a teammate's is read at each ask).
PRESENCE_KEPT: Final = 8


class Records(TeamFiles):
    """Presence, state, rates, indexes and dead letters (mixed into `FileStore`)."""

    # -- presence --------------------------------------------------------------------------

    def save_presence(self, agent: str, record: bytes) -> None:
        """Keep ``record`` as ``agent``'s presence (a slot file: no fsync, a pwrite).

        Every process of the agent saves it (a runner, a ``presence`` command), so each
        save reads the newest sequence number first: a save numbered after what this
        process last wrote would lose to another's higher one, unread."""
        with self._presence_lock:
            slots = self._presence_slots(agent)
            slots.refresh()
            slots.save(record)

    def load_presence(self, agent: str) -> bytes | None:
        """The last presence record saved for ``agent`` (None: never)."""
        with self._presence_lock:
            return self._presence_slots(agent).load(keep=True)

    def _presence_slots(self, agent: str) -> SlotFile:
        """``agent``'s presence file, its descriptor kept: `PRESENCE_KEPT` of them at
        most, the least recently used closed first (under ``_presence_lock``)."""
        kept = self._presence
        slots = kept.get(agent)
        if slots is not None:
            kept.move_to_end(agent)
            return slots
        dirs = self.dirs
        slots = kept[agent] = SlotFile(
            lambda: dirs.get("presence"), f"{agent}.slot", f"presence of {agent!r}"
        )
        while len(kept) > PRESENCE_KEPT:
            kept.popitem(last=False)[1].close()
        return slots

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
        fd = self._state_fds["control"]
        with self._one_thread():
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
            fd = self._state_fds.get(name)
            if fd is None:
                fd = open_file(name, os.O_RDWR | os.O_CREAT, self.dirs.get("state"))
                self._state_fds[name] = fd
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

    # -- rates -----------------------------------------------------------------------------

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
            fd = self._state_fds[name]
            with self._one_thread():
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    return _take(ring, limit, window, time.time())
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("state", name)), "count") from None

    # -- indexes (indexes.py) ---------------------------------------------------------------

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Append one entry (the inbox, offset, length) to index ``key`` (see indexes.py)."""
        self._index_files.add(key, agent, offset, length)

    def index_start(self, key: str) -> None:
        """Mark the start of thread ``key``, whose first message is about to be sent."""
        self._index_files.start(key)

    def index_extend(self, key: str, entries: list[tuple[str, int, int]]) -> None:
        """Append several entries to index ``key`` in one O_APPEND write (see indexes.py)."""
        self._index_files.extend(key, entries)

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        return self._index_files.tail(key, count)

    # -- dead letters ----------------------------------------------------------------------

    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        """Record a line of ``agent``'s inbox that was set aside, and why."""
        DeadLetters(self.dirs, agent)(offset, line, reason)

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        """Every dead letter recorded for ``agent``'s inbox, oldest first."""
        return DeadLetters(self.dirs, agent).read()


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
