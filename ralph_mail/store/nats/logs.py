"""The NATS store's log side: each inbox, channel, team log and index is a subject of
the team's stream. A log message's payload is one line; its headers carry its logical
offset (``Ralph-Offset``: the byte offset the line would have in the inbox file, so
cursors and indexes mean what they mean on files) and its ordinal (``Ralph-N``).
Appends are serialised per subject by JetStream itself
(``Nats-Expected-Last-Subject-Sequence``: a writer that lost the race reads the new end
and tries again), and carry ``Nats-Msg-Id`` = the inbox and the message id, so a send
retried under the same id is stored once within the stream's duplicate window. An index
is not a log: its messages (entries) carry no offsets, and writers do not take turns.

Reads are batched direct gets (one round trip for up to `READ_BATCH` lines); a line a
`Waiter` pulled serves the read that follows.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import orjson

from ralph_mail.errors import StoreError
from ralph_mail.message import format_ts
from ralph_mail.store.base import check_key
from ralph_mail.store.nats.background import flush, later, pending_lock
from ralph_mail.store.nats.bucket import Bucket
from ralph_mail.store.nats.names import kv_key
from ralph_mail.store.nats.stream import APPEND_TRIES, INDEX_PROBE, KEPT_LINES, READ_BATCH
from ralph_mail.store.nats.waiter import Waiter
from ralph_mail.store.nats.wire import Reply

_ID = re.compile(rb'"id":"([0-9a-f]{12})"')


def _ts_of(line: bytes) -> str:
    found = re.search(rb'"ts":"([^"]*)"', line)
    return found.group(1).decode() if found else ""


class Logs(Bucket):
    """The team's logs, each a subject of its stream (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        super().__init__(url, team, durable=durable)
        self._tails: dict[str, tuple[int, int, int, str]] = {}  # subject -> seq, end, n, ts
        self._queued: dict[str, list[bytes]] = {}  # index subject -> entries to write
        self._log_cache: dict[str, tuple[bytes, int]] = {}  # team log -> read so far, end
        self._locks: dict[str, threading.Lock] = {}  # subject -> its appends, one at a time
        self._kept: dict[str, dict[int, tuple[bytes, int, int]]] = {}  # see _pulled
        self._kept_lock = threading.Lock()

    # -- where a subject ends, where an offset is -----------------------------------------

    def _tail(self, subject: str) -> tuple[int, int, int, str]:
        """(seq, end offset, ordinal, ts) of the subject's last line; zeros when empty."""
        last = self._get(subject)
        if last is None:
            return 0, 0, 0, ""
        data = last.data or b""
        end = self._offset(last) + len(data) + 1
        self._remember(subject, end, self._seq(last) + 1)  # where the next line will be
        return self._seq(last), end, int(last.headers["Ralph-N"]), _ts_of(data)

    def _seq_at(self, subject: str, offset: int) -> tuple[int, int] | None:
        """(stream seq, offset) of the line starting at ``offset``, or of the first line
        kept when ``offset`` is below it; None when ``offset`` is at or past the end."""
        known = self._seqs.get(subject, {}).get(offset)
        if known is not None:
            return known, offset
        last = self._get(subject)
        if last is None or self._offset(last) < offset:
            return None
        low, high = 1, self._seq(last)
        found: tuple[int, int] | None = None
        while low <= high:  # the first line at or after offset, by bisection on seq
            middle = (low + high) // 2
            msg = self._get(subject, middle)
            if msg is None:
                high = middle - 1
                continue
            if self._offset(msg) >= offset:
                found = (self._seq(msg), self._offset(msg))
                high = middle - 1
            else:
                low = self._seq(msg) + 1
        if found is not None:
            self._remember(subject, found[1], found[0])
        return found

    # -- logs -----------------------------------------------------------------------------

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        ts, offset = self._put(self._subject(agent), head, tail)
        return ts, offset

    def _put(self, subject: str, head: bytes, tail: bytes, stamp: bool = True) -> tuple[str, int]:
        """Append ``head + ts + tail`` (``head + tail`` without ``stamp``) as the next line
        of ``subject``; return the ts and its offset."""
        found = _ID.search(head) if stamp else None  # a team log's record is no send
        msg_id = f"{subject}:{found.group(1).decode()}" if found else None
        with self._locks.setdefault(subject, threading.Lock()):  # one at a time here
            known = self._tails.get(subject)
            for _ in range(APPEND_TRIES):
                if known is None:
                    known = self._tail(subject)
                seq, end, n, last = known
                ts = ""
                if stamp:
                    ts = max(format_ts(time.time_ns() // 1000), last)
                line = (head + ts.encode() + tail).removesuffix(b"\n")  # the payload: no newline
                headers = {"Ralph-Offset": str(end), "Ralph-N": str(n + 1),
                           "Nats-Expected-Last-Subject-Sequence": str(seq)}  # fmt: skip
                if msg_id is not None:
                    headers["Nats-Msg-Id"] = msg_id
                ack = self._acked(subject, line, headers)
                if ack is None:  # another writer got there first
                    known = None
                    continue
                if ack.get("duplicate"):  # a retry of a send that was stored: where it is
                    stored = self._get(subject, ack["seq"])
                    self._tails.pop(subject, None)
                    if stored is None:  # purged since
                        raise StoreError(f"{subject}: message {msg_id} was stored, then purged")
                    return _ts_of(stored.data), self._offset(stored)
                self._tails[subject] = (ack["seq"], end + len(line) + 1, n + 1, ts or last)
                self._remember(subject, end, ack["seq"])
                return ts, end
        raise StoreError(f"{subject}: {APPEND_TRIES} writers in a row got there first")

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        return self._read(self._subject(agent), offset)

    def _read(self, subject: str, offset: int, count: int = READ_BATCH) -> tuple[bytes, int]:
        held = self._held(subject, offset, count)
        return (held, offset) if held is not None else self._fetch(subject, offset, count)

    def _pulled(self, message: Reply) -> int:
        """Keep a line a waiter pulled, for the read that follows (up to `KEPT_LINES` a
        subject, by offset, each with the offset of the next line: a line kept is a
        fact about the stream, so a read from one is served here, without a round
        trip); return its stream sequence."""
        tokens = message.reply.split(".")  # $JS.ACK.[domain.account.]stream.consumer...
        seq = int(tokens[5] if len(tokens) == 9 else tokens[7])
        if "Ralph-Offset" not in message.headers:  # no line of a log (a commit): not kept
            return seq
        offset = int(message.headers["Ralph-Offset"])
        with self._kept_lock:
            kept = self._kept.setdefault(message.subject, {})
            kept[offset] = (message.data, seq, offset + len(message.data) + 1)
            if len(kept) > KEPT_LINES:
                del kept[next(iter(kept))]
        return seq

    def _held(self, subject: str, offset: int, count: int) -> bytes | None:
        """The lines kept from ``offset`` on (see `_pulled`); None when none is."""
        lines: list[bytes] = []
        at, seq = offset, 0
        with self._kept_lock:
            kept = self._kept.get(subject, {})
            while at in kept and len(lines) < count:
                line, seq, at = kept[at]
                lines.append(line)
        if not lines:
            return None
        self._remember(subject, at, seq + 1)
        return b"".join(line + b"\n" for line in lines)

    def _fetch(self, subject: str, offset: int, count: int) -> tuple[bytes, int]:
        """Up to ``count`` lines from ``offset`` (or from the first line kept, when it
        is below that) and where they start, asked of the server."""
        at = self._seq_at(subject, offset)
        if at is None:
            return b"", offset
        seq, start = at
        found = self._batch(subject, seq, count)
        # Nothing from the stream sequence of a line's offset on: nothing from the offset
        # on (lines follow each other in both). A line that starts elsewhere: a stale
        # position (purged), looked up again.
        if found and self._offset(found[0]) != start:
            self._seqs.pop(subject, None)
            at = self._seq_at(subject, offset)
            if at is None:
                return b"", offset
            seq, start = at
            found = self._batch(subject, seq, count)
        lines = [msg.data for msg in found]
        if found:
            last = found[-1]
            after = self._offset(last) + len(last.data) + 1
            self._remember(subject, after, self._seq(last) + 1)
        return b"".join(line + b"\n" for line in lines), start

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        subject = self._subject(agent)
        seq, end, n, _ = self._tail(subject)
        if lines <= 0 or not seq:
            return [], end
        if n <= READ_BATCH:  # a short log: the server finds its first line itself
            return [msg.data for msg in self._batch(subject, 1, n)[-lines:]], end
        first = max(1, n - lines + 1)
        low, high, start = 1, seq, seq
        while low <= high:  # the seq of the line whose ordinal is `first`
            middle = (low + high) // 2
            msg = self._get(subject, middle)
            if msg is None:
                high = middle - 1
                continue
            if int(msg.headers["Ralph-N"]) >= first:
                start, high = self._seq(msg), middle - 1
            else:
                low = self._seq(msg) + 1
        return [msg.data for msg in self._batch(subject, start, lines)], end

    def size(self, agent: str) -> int:
        return self._tail(self._subject(agent))[1]

    def read_line(self, agent: str, offset: int, length: int) -> bytes | None:
        data, start = self._read(self._subject(agent), offset, 1)
        return data if start == offset and len(data) == length else None

    def read_audit(self, agent: str, offset: int) -> tuple[bytes, int]:
        return self.read(agent, offset, skip_collected=True)

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        subject = self._subject(agent)
        position = 0
        while True:  # the first line not older than `before`
            found = self._batch(subject, position + 1, READ_BATCH)
            if not found:
                return self._tail(subject)[1]
            for msg in found:
                if _ts_of(msg.data) >= before:
                    purged = self._api(f"STREAM.PURGE.{self.stream}",
                                       {"filter": subject, "seq": self._seq(msg)})  # fmt: skip
                    if "error" in purged:
                        raise StoreError(f"NATS {self.url}: {purged['error']}")
                    self._seqs.pop(subject, None)
                    with self._kept_lock:
                        self._kept.pop(subject, None)
                    return self._offset(msg)
            position = self._seq(found[-1])

    def waiter(self, agents: list[str]) -> Waiter:
        return Waiter(self, [self._subject(key) for key in agents])

    def create_log(self, key: str) -> None:
        name = f"log.{kv_key(key)}"
        raw, revision = self._kv_entry(name)  # a deleted one may be made again
        if raw is not None or self._kv_write(name, b"1", last=revision) is None:
            raise FileExistsError(key)

    # -- team logs, dead letters ----------------------------------------------------------

    def log_append(self, name: str, record: bytes) -> None:
        check_key(name, "log name")
        self._put(self._subject(f"log:{name}"), record.rstrip(b"\n"), b"", stamp=False)

    def log_read(self, name: str) -> bytes:
        """The whole log; what this store read of it before is kept, so reading it again
        (the task tree does, at every change) costs only what was appended since."""
        check_key(name, "log name")
        subject = self._subject(f"log:{name}")
        known, offset = self._log_cache.get(subject, (b"", 0))
        out = [known]
        while True:
            data, start = self._read(subject, offset)
            if start != offset and known:  # purged or made again: read it whole
                self._log_cache.pop(subject, None)
                return self.log_read(name)
            if not data:
                whole = b"".join(out)
                self._log_cache[subject] = (whole, offset)
                return whole
            out.append(data)
            offset = start + len(data)

    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        record = {"ts": format_ts(time.time_ns() // 1000), "inbox": agent, "offset": offset,
                  "reason": reason, "line": line.decode("utf-8", "backslashreplace")}  # fmt: skip
        self.log_append(f"dead.{kv_key(agent)}", orjson.dumps(record) + b"\n")

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_read(f"dead.{kv_key(agent)}").splitlines()]

    # -- indexes --------------------------------------------------------------------------

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Written in the background (the message is delivered already: an index entry
        costs a send no round trip); this process's index reads wait for it first. Another
        process may read the index a few milliseconds before the entry is in."""
        subject = self._subject(f"ix:{key}")
        with pending_lock():
            queue = self._queued.setdefault(subject, [])
            queue.append(orjson.dumps([agent, offset, length]))
            first = len(queue) == 1
        if first:  # entries that come while it writes go in its next message
            later("index", self._drain, subject)

    def index_extend(self, key: str, entries: list[tuple[str, int, int]]) -> None:
        """`index_add` each, in order (they go out in one message, or a few)."""
        for agent, offset, length in entries:
            self.index_add(key, agent, offset, length)

    def index_start(self, key: str) -> None:
        """An index is a subject of its own here: nothing before its first entry to skip."""

    def _drain(self, subject: str) -> None:
        """Write the queued index entries of ``subject``, all there are in one message.
        An index is not a log: its messages carry no offsets, so writers need not take
        turns (the bus orders what it finds by ts)."""
        while True:
            with pending_lock():
                entries = self._queued.pop(subject, [])
            if not entries:
                return
            self._acked(subject, b"\n".join(entries))

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        flush("index")
        lines = [msg.data for msg in self._index_tail(self._subject(f"ix:{key}"), count)]
        entries = [entry for line in lines for entry in line.split(b"\n")][-count:] if count else []
        return [(str(a), int(o), int(n)) for a, o, n in map(orjson.loads, entries)]

    def _index_tail(self, subject: str, count: int) -> list[Reply]:
        """The last ``count`` messages of an index (a message: one entry or more). An
        index of fewer than `INDEX_PROBE` (a thread's) is one round trip."""
        found, after = self._after(subject, 1, INDEX_PROBE)
        if not after or not count:
            return found[-count:] if count else []
        start = self._seq(found[0])
        if len(found) + after > count:  # the first of the last `count`, by bisection
            last = self._get(subject)
            low, high = start, self._seq(last) if last is not None else start
            while low <= high:
                middle = (low + high) // 2
                probe, following = self._after(subject, middle, 1)
                if not probe or following < count - 1:
                    high = middle - 1
                else:
                    start = self._seq(probe[0])
                    if following == count - 1:
                        break
                    low = start + 1
        kept: list[Reply] = []
        while True:
            found, after = self._after(subject, start, READ_BATCH)
            kept += found
            if not after or not found:
                return kept[-count:]
            start = self._seq(found[-1]) + 1
