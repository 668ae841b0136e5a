"""The NATS store's index of its team's lines: the full-text search of the audit trail
(`SearchIndex`, FTS5) and where each line of an inbox or a channel is in the stream (its
sequence), so that a line found is read back in one round trip.

It is made by reading the stream in order, by stream sequence, every inbox (``in.>``)
and every channel (``ch.>``) at once, up to `READ_BATCH` lines a round trip; at each use
only what came since is read, which the stream's last sequence says (one round trip,
whatever the team's size). It lives in an SQLite file in the home (``nats/<server>/
<stream>.sqlite3``): a cache, emptied when its team was deleted and made again (the
stream's creation time tells), made again from the stream whenever it is deleted. A
store made without a home keeps it in the process's memory.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_mail.store.nats.stream import READ_BATCH
from ralph_mail.store.search import SearchIndex

if TYPE_CHECKING:
    from ralph_mail.store.nats.logs import Logs
    from ralph_mail.store.nats.wire import Reply

_SCHEMA = """
CREATE TABLE IF NOT EXISTS lines (seq INTEGER PRIMARY KEY, inbox TEXT NOT NULL,
                                  offset INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS lines_at ON lines (inbox, offset);
CREATE TABLE IF NOT EXISTS scanned (kind TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS stream (created TEXT NOT NULL);
"""
#: The logs indexed, by the subject's kind: inboxes and channels (``#NAME``).
_KINDS = (("in", ""), ("ch", "#"))


class StreamIndex(SearchIndex):
    """The index of one team's lines (see the module docstring); ``path`` None: in
    memory."""

    def __init__(self, store: Logs, path: Path | None) -> None:
        def connect() -> sqlite3.Connection:
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            return sqlite3.connect(str(path or ":memory:"), timeout=30, check_same_thread=False)

        super().__init__(connect, store.read_audit, list)
        self._store, self.path = store, path
        self._ready = False

    def _conn(self) -> sqlite3.Connection:
        db = super()._conn()
        if not self._ready:
            db.executescript(_SCHEMA)
            self._ready = True
        return db

    def _update(self) -> int:
        """Index what the stream holds past what is indexed; return how many lines."""
        db = self._conn()
        info = self._store._api(f"STREAM.INFO.{self._store.stream}", {})
        state = info.get("state", {})
        last = int(state.get("last_seq", 0))
        self._same_stream(db, str(info.get("created", "")), int(state.get("first_seq", 0)))
        total = 0
        for kind, mark in _KINDS:
            while (seq := self._scanned(db, kind)) < last:
                subjects = f"{self._store._prefix}.{kind}.>"
                found, after = self._store._after(subjects, seq + 1, READ_BATCH)
                total += self._take(db, kind, mark, found, last if not after else 0)
                if not found:
                    break
        return total

    def _same_stream(self, db: sqlite3.Connection, created: str, first: int) -> None:
        """Empty the index when its team's stream was made again since; forget the lines
        the stream no longer holds (its limits, a purge)."""
        db.execute("BEGIN IMMEDIATE")
        try:
            known = db.execute("SELECT created FROM stream").fetchone()
            if known is None or known[0] != created:
                for table in ("messages", "progress", "broadcasts", "lines", "scanned", "stream"):
                    db.execute(f"DELETE FROM {table}")  # (our own tables)
                db.execute("INSERT INTO stream VALUES (?)", (created,))
            db.execute("DELETE FROM lines WHERE seq < ?", (first,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @staticmethod
    def _scanned(db: sqlite3.Connection, kind: str) -> int:
        row = db.execute("SELECT seq FROM scanned WHERE kind = ?", (kind,)).fetchone()
        return int(row[0]) if row else 0

    def _take(
        self, db: sqlite3.Connection, kind: str, mark: str, found: list[Reply], last: int
    ) -> int:
        """Index ``found`` (lines of logs of ``kind``, in stream order; ``last``: the
        stream's last sequence when none follows them, else 0) in one IMMEDIATE
        transaction that reads how far the index is first: two processes at once take
        turns, and neither indexes a line the other did."""
        from ralph_mail.store.nats.logs import placed
        from ralph_mail.store.nats.names import untoken

        start = len(self._store._prefix) + len(kind) + 2
        db.execute("BEGIN IMMEDIATE")
        try:
            seen = self._scanned(db, kind)
            rows: list[tuple[object, ...]] = []
            places: list[tuple[int, str, int]] = []
            for msg in found:
                seq = int(msg.headers["Nats-Sequence"])
                if seq <= seen or not placed(msg):
                    continue
                inbox = mark + untoken(msg.headers["Nats-Subject"][start:])
                offset = int(msg.headers["Ralph-Offset"])
                rows += self._rows(db, inbox, offset, msg.data + b"\n")
                places.append((seq, inbox, offset))
            db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            db.executemany("INSERT OR REPLACE INTO lines VALUES (?, ?, ?)", places)
            done = max(last, int(found[-1].headers["Nats-Sequence"]) if found else 0)
            db.execute("INSERT INTO scanned VALUES (?, ?) ON CONFLICT(kind) DO UPDATE SET "
                       "seq = max(seq, excluded.seq)", (kind, done))  # fmt: skip
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return len(rows)

    def seqs(self, places: list[tuple[str, int]]) -> list[int | None]:
        """The stream sequence of each ``(inbox, offset)``, as indexed (None: not)."""
        with self._lock:
            db = self._conn()
            query = "SELECT seq FROM lines WHERE inbox = ? AND offset = ?"
            found = (db.execute(query, place).fetchone() for place in places)
            return [int(row[0]) if row else None for row in found]

    def _forget_before(self, inbox: str, offset: int) -> None:
        super()._forget_before(inbox, offset)
        db = self._conn()
        db.execute("DELETE FROM lines WHERE inbox = ? AND offset < ?", (inbox, offset))
