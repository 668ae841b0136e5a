"""The NATS JetStream backend's team store (DESIGN §13): the same mailbox for a team
whose agents run on several hosts. Selected by ``RALPH_BACKEND=nats://HOST:PORT``
(nats-py, the ``nats`` extra).

A team is one stream, ``RALPH_<team in hex>`` over ``ralph.<team in hex>.>``, and one
key-value bucket of the same name. Every log the library keeps is a subject of that
stream: an inbox (``in.<agent>``), a channel (``ch.<name>``), a team log (``tl.<name>``,
the task log among them), an index (``ix.<key>``), an owner's commits (``ct.<agent>``,
`commits`); how they are written and read is `logs`. A waiter pulls from an ephemeral
consumer of its subjects (`waiter`). The bucket keeps the roster, presence, state and
rates (`bucket`), and the cursors and the one-consumer claims (`claims`). `NatsStore`
puts the two sides together, and adds what needs both: gc and search (through the
team's index, `index`).

What the file backend does with gc is the server's business here: nothing is compacted
(``compact`` drops nothing; the stream's limits and ``purge_archive`` bound it), so the
audit trail is the stream itself.

Two connections per process and server. The store's round trips (appends, reads, the
bucket's keys, cursor and index writes) go over a blocking socket per thread
(`wire.Wire`; see `stream`): nats-py is asyncio only, and reaching its loop from a
synchronous caller costs a thread hop longer than the round trip. nats-py's connection
(`push`), on a loop thread of its own, carries the bucket's watch and the creation and
removal of teams; it is imported when first needed. Index writes are made in the
background, in order, on one thread of their own (`background`); a commit sends its
cursor and reads the answer with its thread's next request (`claims`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from ralph_mail.errors import StoreError
from ralph_mail.store.base import Compaction
from ralph_mail.store.nats.background import flush
from ralph_mail.store.nats.bucket import start_of
from ralph_mail.store.nats.commits import Commits
from ralph_mail.store.nats.names import index_path, kv_key

if TYPE_CHECKING:
    from ralph_mail.store.nats.index import StreamIndex
    from ralph_mail.store.search import Query


class NatsStore(Commits):
    """One team on a NATS server (see the module docstring)."""

    def __init__(
        self, url: str, team: str, *, durable: bool = False, home: Path | None = None
    ) -> None:
        super().__init__(url, team, durable=durable)
        self._search: StreamIndex | None = None
        self._search_path = index_path(home, url, self.stream) if home is not None else None

    # -- gc -------------------------------------------------------------------------------

    def compact(
        self,
        agent: str,
        min_bytes: int = 1,
        *,
        timeout: float = 0.0,
        drop_before: str | None = None,
    ) -> Compaction:
        """Move the inbox's start up to its readers' floor. Nothing is deleted: what an
        inbox drops on files goes to the archive, and here the stream is that archive
        (`read_audit` reads it); with ``drop_before`` the lines of the archive (below
        the start) older than it are purged from the server for good."""
        subject = self._subject(agent)
        base = self._base(agent)
        floors = [self.load_cursor(reader).floor for reader in self._readers(agent)]
        floor = min(floors, default=base)
        end = self.size(agent)
        if floor - base < max(min_bytes, 1):
            done = Compaction(agent, 0, end - base, base)
        else:
            dropped = self._ordinal(subject, floor) - self._ordinal(subject, base)
            self._kv_put(f"base.{kv_key(agent)}", str(floor).encode())
            done = Compaction(agent, floor - base, end - floor, floor, dropped)
        if drop_before is not None:
            self.purge_archive(agent, drop_before)
        return done

    def _ordinal(self, subject: str, offset: int) -> int:
        """How many lines of ``subject`` come before ``offset``."""
        seq, _ = self._seq_at(subject, offset)
        found = self._get(subject, seq) if seq else None
        if found is None:  # at the end: every line comes before it
            return self._tail(subject)[2]
        return int(found.headers["Ralph-N"]) - 1

    def _readers(self, key: str) -> list[str]:
        """Whose cursors hold a log's start: its owner, or a channel's members."""
        if not key.startswith("#"):
            return [key]
        cursors = f"$KV.{self.stream}.cursor."
        info = self._api(f"STREAM.INFO.KV_{self.stream}", {"subjects_filter": f"{cursors}>"})
        prefix = f"{key}@"
        readers = []
        for stored in info.get("state", {}).get("subjects") or {}:
            name = stored[len(cursors) :]
            name = bytes.fromhex(name[1:]).decode() if name.startswith("x") else name
            if name.startswith(prefix) and self._kv_get(f"cursor.{kv_key(name)}") is not None:
                readers.append(name)  # (a deleted cursor keeps its subject, empty)
        return readers

    def collect(
        self, logs: list[str], min_bytes: int, drop_before: str | None, timeout: float
    ) -> tuple[tuple[Compaction, ...], tuple[Path, ...]]:
        """gc: each log compacted; this backend keeps no temp files to remove."""
        compactions = tuple(self.compact(log, min_bytes, drop_before=drop_before) for log in logs)
        return compactions, ()

    def collectable(self, agent: str, floor: int) -> int:
        """From the bucket's watch (a test after every consume: no round trip); a base
        moved a moment ago elsewhere only makes `compact` look, and it reads it exactly."""
        found = self._watched(f"base.{kv_key(agent)}")
        return max(0, floor - ((start_of(found[0]) or 0) if found is not None else 0))

    # -- search ---------------------------------------------------------------------------

    def search(self, query: Query) -> list[bytes]:
        """Through the team's index (`index`: brought up to date in one round trip when
        nothing is new); each line found read back by its stream sequence."""
        import sqlite3

        try:
            index = self._index()
            found = index.search(query)
            seqs = index.seqs([(inbox, offset) for inbox, offset, _ in found])
        except (sqlite3.Error, OSError) as exc:
            where = self._search_path or "in memory"
            raise StoreError(f"the search index {where} failed ({exc}): delete it, and the "
                             "next search makes it again") from None  # fmt: skip
        lines = (self._line_at(seq, *place) for seq, place in zip(seqs, found, strict=True))
        return [line for line in lines if line is not None]  # purged since: not shown

    def _index(self) -> StreamIndex:
        from ralph_mail.store.nats.index import StreamIndex

        if self._search is None:
            self._search = StreamIndex(self, self._search_path)
        return self._search

    def _line_at(self, seq: int | None, inbox: str, offset: int, length: int) -> bytes | None:
        """The line at ``offset`` of ``inbox`` (``length`` bytes), read by its stream
        sequence when the index knows it."""
        if seq is not None:
            request = orjson.dumps({"seq": seq})
            msg = self._ask(f"$JS.API.DIRECT.GET.{self.stream}", request)[0]
            if (msg.status is None and msg.headers.get("Nats-Subject") == self._subject(inbox)
                    and msg.headers.get("Ralph-Offset") == str(offset)
                    and len(msg.data) + 1 == length):  # fmt: skip
                return msg.data + b"\n"
        return self.read_line(inbox, offset, length)

    def forget_archived(self, agent: str, offset: int) -> None:
        self._index().forget_before(agent, offset)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        flush()
        self._closed.set()
        for agent in list(self._claims):
            self.release(agent)
        if self._keys is not None:
            keys, self._keys, self._cache = self._keys, None, None
            with contextlib.suppress(Exception):  # a server gone: its consumers went too
                self._link.run(keys.stop(), 2.0)
        if self._search is not None:
            self._search.close()
            self._search = None
