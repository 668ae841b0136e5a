"""Full-text search over a team's audit trail: an SQLite FTS5 index derived from it.

The index never holds a copy of a message: it is built from every inbox's audit
trail (`TeamStore.read_audit`: the inbox, and below its start what gc archived), and
brought up to date from what is new before each query. It records, per inbox, the
logical offset up to which it has indexed, in the same transaction as the rows, so a
process killed while indexing leaves the index as it was before that batch, and the
next query indexes the batch again. Deleting the index file rebuilds it from scratch.
It keeps the words and where each message is (inbox, offset, length); the message itself
is read back from the store.

A query is words, each matched as a word (FTS5 syntax is not interpreted: quotes,
operators and parentheses in a query are plain text), plus filters on sender,
recipient, type, thread and time. Results come newest first. A broadcast, one line in
every member's inbox, is one result.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ralph_mail import codec
from ralph_mail.errors import InvalidMessage

_WORD = re.compile(r"\w+", re.UNICODE)

_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages USING fts5(
    content, sender UNINDEXED, recipient UNINDEXED, type UNINDEXED, thread UNINDEXED,
    ts UNINDEXED, id UNINDEXED, inbox UNINDEXED, offset UNINDEXED, length UNINDEXED,
    tokenize = 'unicode61'
);
CREATE TABLE IF NOT EXISTS progress (inbox TEXT PRIMARY KEY, offset INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS broadcasts (id TEXT PRIMARY KEY);
"""


@dataclass(frozen=True, slots=True)
class Query:
    """What to look for in the audit trail: ``words`` (all of them), and optional filters."""

    words: str = ""
    sender: str | None = None
    recipient: str | None = None
    type: str | None = None
    thread: str | None = None
    since: str | None = None  # a ts: messages at or after it
    limit: int = 20


def match_expression(words: str) -> str:
    """An FTS5 expression matching every word of ``words`` as a word, whatever
    characters they hold; `InvalidMessage` for a query no search could answer."""
    if "\x00" in words:
        raise InvalidMessage("the query holds a NUL character: remove it")
    if len(words) > 1000:
        raise InvalidMessage(f"the query is {len(words):,} characters long: use at most 1,000")
    return " ".join('"' + word.replace('"', '""') + '"' for word in _WORD.findall(words))


class SearchIndex:
    """An FTS5 index over the audit trails of a team's inboxes.

    ``connect`` opens the database; ``read_audit`` is the store's; ``inboxes`` lists
    the team's inboxes now.
    """

    def __init__(
        self,
        connect: Callable[[], sqlite3.Connection],
        read_audit: Callable[[str, int], tuple[bytes, int]],
        inboxes: Callable[[], Iterable[str]],
    ) -> None:
        self._connect = connect
        self._read = read_audit
        self._inboxes = inboxes
        self._db: sqlite3.Connection | None = None
        # One statement at a time from any thread (the connection is made with
        # check_same_thread=False: an MCP server's tools run on worker threads).
        self._lock = threading.RLock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = self._connect()
            db.isolation_level = None  # transactions are begun by hand, IMMEDIATE
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def update(self) -> int:
        with self._lock:
            return self._update()

    def _update(self) -> int:
        """Index what is new in every inbox's audit trail; return how many messages.

        Each batch is one IMMEDIATE transaction that reads how far the inbox is indexed,
        inserts what follows and records the new end: two processes updating at once
        take turns, and neither indexes a line the other did.
        """
        db = self._conn()
        total = 0
        for inbox in self._inboxes():
            while True:
                db.execute("BEGIN IMMEDIATE")
                try:
                    row = db.execute(
                        "SELECT offset FROM progress WHERE inbox = ?", (inbox,)
                    ).fetchone()
                    data, start = self._read(inbox, int(row[0]) if row else 0)
                    if data:
                        total += self._insert(db, inbox, start, data)
                        db.execute(
                            "INSERT INTO progress VALUES (?, ?) ON CONFLICT(inbox) "
                            "DO UPDATE SET offset = excluded.offset",
                            (inbox, start + len(data)),
                        )
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                if not data:
                    break
        return total

    def _insert(self, db: sqlite3.Connection, inbox: str, start: int, data: bytes) -> int:
        rows = self._rows(db, inbox, start, data)
        db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        return len(rows)

    def _rows(
        self, db: sqlite3.Connection, inbox: str, start: int, data: bytes
    ) -> list[tuple[object, ...]]:
        """The rows of the messages in ``data`` (whole lines of ``inbox`` from ``start``):
        a damaged line none, a broadcast's copy after the first none."""
        rows: list[tuple[object, ...]] = []
        position = start
        for line in data.splitlines(keepends=True):
            at = position
            position += len(line)
            try:
                envelope = codec.loads(line)
                message_id, sender, recipient = envelope["id"], envelope["from"], envelope["to"]
                content, kind, ts = envelope["content"], envelope["type"], envelope["ts"]
            except (codec.DecodeError, KeyError, TypeError):
                continue  # a damaged line: doctor and the dead letters report it
            if recipient == "*":  # a broadcast: one copy per inbox, one result
                seen = db.execute("INSERT OR IGNORE INTO broadcasts VALUES (?)", (message_id,))
                if not seen.rowcount:
                    continue
            thread = envelope.get("thread") or message_id
            rows.append((str(content), sender, recipient, kind, thread, ts, message_id,
                         inbox, at, len(line)))  # fmt: skip
        return rows

    def search(self, query: Query) -> list[tuple[str, int, int]]:
        with self._lock:
            return self._search(query)

    def _search(self, query: Query) -> list[tuple[str, int, int]]:
        """Where the messages matching ``query`` are (inbox, offset, length: the store
        reads them back, so the index holds no copy of a message), newest first."""
        self.update()
        where, params = [], []
        expression = match_expression(query.words)
        if expression:
            where.append("messages MATCH ?")
            params.append(expression)
        for column, value in (("sender", query.sender), ("recipient", query.recipient),
                              ("type", query.type), ("thread", query.thread)):  # fmt: skip
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if query.since is not None:
            where.append("ts >= ?")
            params.append(query.since)
        sql = "SELECT inbox, offset, length FROM messages"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY ts DESC LIMIT ?"
        params.append(str(min(query.limit, 2**63 - 1)))  # sqlite's largest: no more can match
        return [(str(inbox), int(offset), int(length))
                for inbox, offset, length in self._conn().execute(sql, params)]  # fmt: skip

    def forget_before(self, inbox: str, offset: int) -> None:
        with self._lock:
            return self._forget_before(inbox, offset)

    def _forget_before(self, inbox: str, offset: int) -> None:
        """Drop the rows of ``inbox`` below ``offset`` (its archive was purged)."""
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM messages WHERE inbox = ? AND offset < ?", (inbox, offset))
        db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            return self._close()

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
