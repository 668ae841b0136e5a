"""The NATS store's commit times: when each owner's cursor moved, so a receipt can say
when a line was consumed (`TeamStore.note_commit`, `TeamStore.consumed_at`).

Each commit of an inbox's owner is a message of the subject ``ct.<agent>`` of the team's
stream (``before floor mark time passed``, in ASCII), published in the background once
its cursor was sent. The cursor's write is not waited for (`claims`), so the commit may
be stored a moment before it: `consumed` takes the last commit as well as the cursor.
Floors and times only grow along the subject, so a lookup bisects it by stream
sequence: O(log) round trips, whatever the inbox holds. Like the inbox, the subject is
bounded by the stream's limits and by `purge_archive`, which drops the commits older than
what it purges.
"""

from __future__ import annotations

import time

from ralph_mail.errors import StoreError
from ralph_mail.store.base import Cursor
from ralph_mail.store.nats.background import flush
from ralph_mail.store.nats.logs import Logs
from ralph_mail.store.nats.stream import READ_BATCH
from ralph_mail.store.nats.wire import Reply
from ralph_mail.store.records import MARK_SCAN, Commit, marks, micros, when_consumed


def _commit(message: Reply) -> Commit:
    before, floor, mark, stamp, passed = message.data.split()
    return Commit(int(before), int(floor), int(mark), int(stamp), passed == b"1")


class Commits(Logs):
    """The commit times of the inboxes' owners (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        super().__init__(url, team, durable=durable)
        self._commit_times: dict[str, int] = {}  # agent -> the last time I recorded

    def note_commit(self, agent: str, before: Cursor, after: Cursor) -> None:
        now = max(time.time_ns() // 1000, self._commit_times.get(agent, 0))
        self._commit_times[agent] = now
        mark, passed = marks(before, after)
        fields = (before.floor, after.floor, mark, now, passed)
        self._post(self._subject(f"commits:{agent}"), b"%d %d %d %d %d" % fields)

    def consumed(self, agent: str, offset: int) -> bool:
        """The cursor passed it, or the last commit did: a commit time may be stored a
        moment before its cursor (`claims`), never more than one commit ahead (a commit
        sends its cursor once the one before was answered)."""
        if self.load_cursor(agent).passed(offset):
            return True
        last = self._get(self._subject(f"commits:{agent}"))
        if last is None:
            return False
        commit = _commit(last)
        return offset < commit.floor or offset == commit.mark

    def consumed_at(self, agent: str, offset: int, since: str) -> str | None:
        """Bisects the subject by stream sequence; each probe is one direct get of the
        first commit at or after a sequence."""
        flush()
        subject = self._subject(f"commits:{agent}")
        last = self._get(subject)
        if last is None:
            return None
        end = self._seq(last) + 1

        def at(seq: int) -> Commit:
            # The first commit at or after ``seq`` (purged since: one after them all).
            got = self._get(subject, seq)
            return _commit(got) if got is not None else Commit(*(1 << 62,) * 4)

        def between(low: int, high: int) -> tuple[list[Commit], bool]:
            commits: list[Commit] = []
            while len(commits) < MARK_SCAN:
                batch = [m for m in self._batch(subject, low, READ_BATCH) if self._seq(m) < high]
                commits += map(_commit, batch)
                if len(batch) < READ_BATCH:
                    return commits, True
                low = self._seq(batch[-1]) + 1
            return commits[:MARK_SCAN], False

        return when_consumed(offset, since, 1, end, at, between)

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        """Also drop the owner's commits made before ``before`` (a ts)."""
        start = super().purge_archive(agent, before, timeout=timeout)
        subject = self._subject(f"commits:{agent}")
        stamp = micros(before)
        position = 0
        while True:  # the first commit not older than `before`: purge below it
            found = self._batch(subject, position + 1, READ_BATCH)
            keep = next((m for m in found if _commit(m).time >= stamp), None)
            if keep is not None or not found:
                request: dict[str, str | int] = {"filter": subject}
                if keep is not None:
                    request["seq"] = self._seq(keep)
                purged = self._api(f"STREAM.PURGE.{self.stream}", request)
                if "error" in purged:
                    raise StoreError(f"NATS {self.url}: {purged['error']}")
                return start
            position = self._seq(found[-1])
