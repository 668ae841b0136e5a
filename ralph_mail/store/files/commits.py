"""A team store's commit times: when each owner's cursor moved, so a receipt can say when
a line was consumed (`TeamStore.note_commit`, `TeamStore.consumed_at`).

``cursors/AGENT.commits`` is a file of fixed-width records, one appended by each commit
of the inbox's owner with a single ``O_APPEND`` write after the cursor is saved (and its
doorbell rung, for `wait_consumed`): the floor before, the floor after, the line
consumed out of order (or -1), whether the floor passed lines consumed out of order (a
byte, then 7 of padding) and the time in microseconds, 40 bytes. Floors and times only
grow, so a lookup bisects the file in O(log commits) preads, whatever the inbox holds.

The owner is its only writer (one consumer per inbox), so the owner also keeps it short:
at its first commit and every `TRIM_EVERY` after, when gc has dropped lines from the
front of the inbox, the records that speak only of dropped lines go too (temp file and
rename), once they are half the file. A line gc dropped then has no time (None), never
a wrong one: a record says which floor it moved from, so a lookup knows when the record
before it is missing. A floor below the last one recorded means the inbox was replaced
(its offsets start again): the file starts again with it.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from functools import partial

from ralph_mail.store.base import Cursor
from ralph_mail.store.files.bells import ring
from ralph_mail.store.files.posix import open_file, pread_all, replace_file, store_error
from ralph_mail.store.files.team import TeamFiles
from ralph_mail.store.records import MARK_SCAN, Commit, first_where, marks, when_consumed

_RECORD = struct.Struct("<qqq?7xq")  # floor before, floor after, mark, passed, time (µs)
#: How many commits of one owner pass between two looks at what gc left to drop.
TRIM_EVERY = 4096
#: The fewest records worth a copy of the file to drop.
TRIM_MIN = 1024


def _name(agent: str) -> str:
    return f"{agent}.commits"


def _at(fd: int, k: int) -> Commit:
    return _unpack(pread_all(fd, _RECORD.size, k * _RECORD.size))


def _unpack(record: bytes) -> Commit:
    before, floor, mark, passed, stamp = _RECORD.unpack(record)
    return Commit(before, floor, mark, stamp, passed)


class Commits(TeamFiles):
    """The commit times of the inboxes' owners (mixed into `FileStore`)."""

    def note_commit(self, agent: str, before: Cursor, after: Cursor) -> None:
        """Append one record to ``cursors/AGENT.commits`` (one write of 40 bytes)."""
        try:
            fd, last = self._commit_file(agent)
            if before.floor < last[0]:  # a replaced inbox: its offsets start again
                os.ftruncate(fd, 0)
            now = max(time.time_ns() // 1000, last[1])
            record = _RECORD.pack(before.floor, after.floor, *marks(before, after), now)
            written = os.write(fd, record)
            if written != _RECORD.size:  # a full disk: no part of a record is left behind
                os.ftruncate(fd, os.fstat(fd).st_size - written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            last[0], last[1], last[2] = after.floor, now, last[2] + 1
            ring(self.dirs, f"commits:{agent}")  # one faccessat when nobody waits
            if last[2] % TRIM_EVERY == 1:
                self._trim_commits(agent, fd)
        except OSError as exc:
            raise store_error(exc, str(self.dirs.path("cursors", _name(agent))), "append to",
                              "the time of this commit is not kept") from None  # fmt: skip

    def _commit_file(self, agent: str) -> tuple[int, list[int]]:
        """The kept descriptor of the owner's commits file, and what this store knows of
        it: the last floor and time recorded, and how many records it appended."""
        key = _name(agent)
        fd = self._state_fds.get(key)
        if fd is None or self.dirs.generation != self._generation:
            self._fresh()
            fd = open_file(key, os.O_RDWR | os.O_APPEND | os.O_CREAT, self.dirs.get("cursors"))
            self._state_fds[key] = fd
            size = os.fstat(fd).st_size
            if size % _RECORD.size:  # a record cut short by a crash: only ever the last
                size -= size % _RECORD.size
                os.ftruncate(fd, size)
            last = _at(fd, size // _RECORD.size - 1) if size else Commit(0, 0, -1, 0)
            self._commit_state[agent] = [last.floor, last.time, 0]
        return fd, self._commit_state[agent]

    def _trim_commits(self, agent: str, fd: int) -> None:
        """Drop the records that speak only of lines gc dropped from the inbox, once
        they are at least half the file and `TRIM_MIN` records."""
        base = self._log(agent).base_record()[0]
        count = os.fstat(fd).st_size // _RECORD.size
        at = partial(_at, fd)
        if first_where(0, count, lambda k: at(k).floor > base) < max(count // 2, TRIM_MIN):
            return
        data = pread_all(fd, count * _RECORD.size, 0)
        records = (data[k : k + _RECORD.size] for k in range(0, len(data), _RECORD.size))
        kept = [r for r in records if (c := _unpack(r)).floor > base or c.mark >= base]
        replace_file(_name(agent), b"".join(kept), self.dirs.get("cursors"))
        os.close(self._state_fds.pop(_name(agent)))  # the next commit opens the new file

    def consumed_at(self, agent: str, offset: int, since: str) -> str | None:
        """Bisects ``cursors/AGENT.commits`` (see the module docstring)."""
        where = str(self.dirs.path("cursors", _name(agent)))
        try:
            fd = open_file(_name(agent), os.O_RDONLY, self.dirs.get("cursors"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(exc, where, "read") from None
        try:

            def between(low: int, high: int) -> tuple[list[Commit], bool]:
                count = min(high - low, MARK_SCAN)
                data = pread_all(fd, count * _RECORD.size, low * _RECORD.size)
                found = [data[k : k + _RECORD.size] for k in range(0, len(data), _RECORD.size)]
                return [_unpack(record) for record in found], count == high - low

            records = os.fstat(fd).st_size // _RECORD.size
            return when_consumed(offset, since, 0, records, partial(_at, fd), between)
        except OSError as exc:
            raise store_error(exc, where, "read") from None
        finally:
            os.close(fd)
