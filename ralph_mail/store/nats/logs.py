"""The NATS store's log side: each inbox, channel, team log and index is a subject of
the team's stream. A log message's payload is one line; its headers carry its logical
offset (``Ralph-Offset``: the byte offset the line would have in the inbox file, so
cursors and indexes mean what they mean on files) and its ordinal (``Ralph-N``).
Appends are serialised per subject by JetStream itself
(``Nats-Expected-Last-Subject-Sequence``: a writer that lost the race reads the new end
and tries again), and carry ``Nats-Msg-Id`` = the inbox and the message id, so a send
retried under the same id is stored once within the stream's duplicate window. An index
is not a log: its messages (entries) carry no offsets, and writers do not take turns.

Offsets and ordinals only grow, also across a subject the stream's limits or a purge
emptied (`_emptied`). A message published into a log by anything but the store (no
offset header) is set aside as a dead letter when first met (`_set_aside`).

Reads are batched direct gets (one round trip for up to `READ_BATCH` lines); a line a
`Waiter` pulled serves the read that follows.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from ralph_mail.errors import PermissionDenied, StoreError
from ralph_mail.message import format_ts
from ralph_mail.store.base import check_key
from ralph_mail.store.nats.background import flush, later, pending_lock
from ralph_mail.store.nats.claims import Claims
from ralph_mail.store.nats.names import kv_key, untoken
from ralph_mail.store.nats.stream import (
    APPEND_TRIES,
    EXPECTED,
    INDEX_PROBE,
    KEPT_BYTES,
    KEPT_LINES,
    LINE_BOUND,
    READ_BATCH,
    code_of,
)
from ralph_mail.store.nats.waiter import Waiter
from ralph_mail.store.nats.wire import Reply

_ID = re.compile(rb'"id":"([0-9a-f]{12})"')
#: How many spans back `Logs.read_tails` looks for a log's last lines, round after
#: round (a span: the stream's messages per line of the log, times the lines wanted).
_TAIL_SPANS = (1.5, 6.0)
#: JetStream's "no message found" (a message another process removed first).
_NO_MESSAGE = 10037


def ts_of(line: bytes) -> str:
    found = re.search(rb'"ts":"([^"]*)"', line)
    return found.group(1).decode() if found else ""


def placed(msg: Reply) -> bool:
    """Whether a message carries its place in its log, as the store writes it: an
    offset and an ordinal, whole numbers."""
    offset, n = msg.headers.get("Ralph-Offset", ""), msg.headers.get("Ralph-N", "")
    return offset.isascii() and offset.isdigit() and n.isascii() and n.isdigit() and n != "0"


def _unplaced(subject: str) -> bool:
    """Whether ``subject`` is no log's: an index's (``ix.``) or commit times' (``ct.``),
    whose messages carry no place."""
    return subject.split(".", 3)[2:3] in (["ix"], ["ct"])  # ralph.<team>.<kind>.<name>


def _ordinal(msg: Reply) -> int:
    return int(msg.headers["Ralph-N"])


#: How many index messages more than twice the entries asked for `Logs.index_tail` looks
#: at, for batches written late (a few writers, each with a batch behind).
INDEX_SLACK: Final = 8


def _entry(raw: bytes) -> tuple[str, int, int] | None:
    """An index entry, ``[agent, offset, length]``; None for anything else."""
    try:
        agent, offset, length = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    if not isinstance(agent, str) or not isinstance(offset, int) or not isinstance(length, int):
        return None
    return agent, offset, length


def _seqs_of(msg: Reply, entries: int) -> list[int]:
    """The stream sequences of the lines an index message's entries point at (its
    ``Ralph-Seqs`` header, one a entry); [] when it does not give one for each."""
    seqs = msg.headers.get("Ralph-Seqs", "").split(",")
    if len(seqs) != entries or not all(seq.isdigit() and int(seq) for seq in seqs):
        return []
    return [int(seq) for seq in seqs]


def _born_key(tail: str) -> str:
    """The bucket key marking that the log of a subject's tail (``in.agent``...) had a
    line (see `Logs._emptied`)."""
    return f"born.{tail}"


def _log_key(tail: str) -> str:
    """The log key (``agent``, ``#channel``, ``log:name``) of a subject's tail
    (``in.agent``, ``ch.channel``, ``tl.name``)."""
    kind, _, name = tail.partition(".")
    return {"ch": "#", "tl": "log:"}.get(kind, "") + untoken(name)


def _line_id(subject: str, seq: int, line: bytes) -> str:
    """A ``Nats-Msg-Id`` for a line that is no send: its place and its hash (two tries
    of one append are one message; two writers' lines at one place are two)."""
    return f"{subject}@{seq}:{hashlib.blake2b(line, digest_size=12).hexdigest()}"


def _dead_record(agent: str, offset: int, line: bytes, reason: str) -> dict[str, Any]:
    return {"ts": format_ts(time.time_ns() // 1000), "inbox": agent, "offset": offset,
            "reason": reason, "line": line.decode("utf-8", "backslashreplace")}  # fmt: skip


class Logs(Claims):
    """The team's logs, each a subject of its stream (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        super().__init__(url, team, durable=durable)
        self._tails: dict[str, tuple[int, int, int, str]] = {}  # subject -> seq, end, n, ts
        self._queued: dict[str, list[tuple[bytes, int]]] = {}  # index -> (entry, its seq)
        self._outbox: list[tuple[str, bytes]] = []  # other writes of the background's
        self._log_cache: dict[str, tuple[bytes, int]] = {}  # team log -> read so far, end
        self._locks: dict[str, threading.Lock] = {}  # subject -> its appends, one at a time
        self._kept: dict[str, dict[int, tuple[bytes, int, int]]] = {}  # see _pulled
        self._kept_bytes: dict[str, int] = {}  # subject -> the size of its lines kept
        self._kept_lock = threading.Lock()
        self._ends: dict[str, tuple[int, tuple[int, int]]] = {}  # see _pulled
        self._reading = threading.local()  # .to: subject -> seq of the last line read
        self._born: set[str] = set()  # subjects whose mark is in the bucket (see _emptied)

    # -- where a subject ends, where an offset is -----------------------------------------

    def _tail(self, subject: str) -> tuple[int, int, int, str]:
        """(seq, end offset, ordinal, ts) of the subject's last line; for an empty
        subject, no seq and where its next line goes (see `_emptied`)."""
        last = self._get(subject)
        if last is None:
            end, n = self._emptied(subject)
            return 0, end, n, ""
        data = last.data or b""
        end = self._offset(last) + len(data) + 1
        self._remember(subject, end, self._seq(last) + 1)  # where the next line will be
        return self._seq(last), end, int(last.headers["Ralph-N"]), ts_of(data)

    def _emptied(self, subject: str) -> tuple[int, int]:
        """Where the next line of an empty subject goes: (its offset, the ordinal before
        it). At 0 for a subject that never had a line: its mark (``born.<subject>``, put
        in the bucket before its first line) is missing, or the stream never lost a
        message. Else the stream's limits or a purge emptied it, and its readers'
        cursors, the indexes and other processes may still hold offsets of the lines it
        had: it goes on past anything it can have had. Each of those lines was a message
        of the stream, no longer than `LINE_BOUND`, so its last offset and ordinal were
        below the stream's last sequence times `LINE_BOUND` and the last sequence."""
        if subject not in self._born:
            if self._kv_get(_born_key(subject[len(self._prefix) + 1 :])) is None:
                return 0, 0
            self._born.add(subject)
        state = self._api(f"STREAM.INFO.{self.stream}", {}).get("state", {})
        last = int(state.get("last_seq", 0))
        if int(state.get("first_seq", 0)) <= 1 and not int(state.get("num_deleted", 0)):
            return 0, 0
        return last * LINE_BOUND, last

    def _mark_born(self, subject: str) -> None:
        """Put the mark of a subject about to get its first line (see `_emptied`)."""
        if subject not in self._born:
            self._kv_write(_born_key(subject[len(self._prefix) + 1 :]), b"1")
            self._born.add(subject)

    def _seq_at(self, subject: str, offset: int) -> tuple[int, int]:
        """(stream seq, offset) of the line starting at ``offset``, or of the first line
        kept when ``offset`` is below it; (0, end) when ``offset`` is at or past the end
        (an end below ``offset``: a cursor of a log that was since replaced)."""
        known = self._seqs.get(subject, {}).get(offset)
        if known is not None:
            return known, offset
        last = self._get(subject)
        if last is None:
            return 0, self._emptied(subject)[0] if offset else 0
        end = self._offset(last) + len(last.data) + 1
        if self._offset(last) < offset:
            return 0, end
        low, high = 1, self._seq(last)
        found = (self._seq(last), self._offset(last))
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
        self._remember(subject, found[1], found[0])
        return found

    # -- lines published by anything but the store ------------------------------------

    def _get(self, subject: str, seq: int | None = None) -> Reply | None:
        """`TeamStream._get`, with what is no line of the store's set aside first (see
        `_set_aside`)."""
        while True:
            msg = super()._get(subject, seq)
            if msg is None or placed(msg) or _unplaced(subject):
                return msg
            self._set_aside(subject, msg)

    def _after(self, subject: str, seq: int, count: int) -> tuple[list[Reply], int]:
        """`TeamStream._after`, with what is no line of the store's set aside first."""
        while True:
            found, after = super()._after(subject, seq, count)
            foreign = [msg for msg in found if not placed(msg)]
            if not foreign or _unplaced(subject):
                return found, after
            for msg in foreign:  # (``subject`` may be a wildcard: the message's own)
                self._set_aside(msg.headers.get("Nats-Subject", subject), msg)

    def _set_aside(self, subject: str, msg: Reply) -> None:
        """A message of a log that carries no place in it (published by anything but the
        store: a raw ``nats pub``, without ``Ralph-Offset`` and ``Ralph-N``, or with
        values that are no whole numbers) is kept among the log's dead letters, as the
        file store keeps a line that is no message, and taken out of the log, so that
        every line left has its place. The record first, under an id the stream
        deduplicates (two readers may meet it at once), then the removal."""
        seq = self._seq(msg)
        key = _log_key(subject[len(self._prefix) + 1 :])
        reason = ("published into the log without the store's headers (Ralph-Offset and "
                  "Ralph-N, whole numbers): set aside")  # fmt: skip
        record = _dead_record(key, -1, msg.data, reason) | {"seq": seq}
        dead = self._subject(f"log:dead.{kv_key(key)}")
        self._put(dead, orjson.dumps(record), b"", stamp=False, msg_id=f"{subject}:{seq}")
        try:
            gone = self._api(f"STREAM.MSG.DELETE.{self.stream}", {"seq": seq, "no_erase": True})
        except PermissionDenied:  # a member's user may remove no message (`auth`)
            raise PermissionDenied(
                f"{key!r} holds a message published without the store's headers (stream "
                f"sequence {seq}), which this user may not remove: the lead sets it aside "
                f"by reading it ('ralph-mail tail {key} --agent LEAD')"
            ) from None
        if "error" in gone and code_of(gone) != _NO_MESSAGE:  # (another reader was first)
            raise StoreError(f"NATS {self.shown}: {gone['error'].get('description', gone)}")
        self._seqs.pop(subject, None)
        self._tails.pop(subject, None)

    # -- logs -----------------------------------------------------------------------------

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        ts, offset = self._put(self._subject(agent), head, tail)
        return ts, offset

    def _put(
        self, subject: str, head: bytes, tail: bytes, stamp: bool = True, msg_id: str = ""
    ) -> tuple[str, int]:
        """Append ``head + ts + tail`` (``head + tail`` without ``stamp``) as the next line
        of ``subject``; return the ts and its offset. A send carries its message id
        (``Nats-Msg-Id``: sent again, stored once); any other line ``msg_id``, or its
        place and its hash, so that a try whose answer was lost is not stored twice."""
        found = _ID.search(head) if stamp else None  # a team log's record is no send
        msg_id = f"{subject}:{found.group(1).decode()}" if found else msg_id
        with self._locks.setdefault(subject, threading.Lock()):  # one at a time here
            known = self._tails.get(subject)
            for _ in range(APPEND_TRIES):
                if known is None:
                    known = self._tail(subject)
                seq, end, n, last = known
                if not seq:
                    self._mark_born(subject)
                ts = ""
                if stamp:
                    ts = max(format_ts(time.time_ns() // 1000), last)
                line = (head + ts.encode() + tail).removesuffix(b"\n")  # the payload: no newline
                headers = {"Ralph-Offset": str(end), "Ralph-N": str(n + 1),
                           EXPECTED: str(seq),
                           "Nats-Msg-Id": msg_id or _line_id(subject, seq, line)}  # fmt: skip
                ack = self._acked(subject, line, headers)
                if ack is None:  # another writer got there first
                    known = None
                    continue
                if ack.get("duplicate"):  # a retry of a send that was stored: where it is
                    stored = self._get(subject, ack["seq"])
                    self._tails.pop(subject, None)
                    if stored is None:  # purged since
                        raise StoreError(f"{subject}: message {headers['Nats-Msg-Id']} was "
                                         "stored, then purged")  # fmt: skip
                    return ts_of(stored.data), self._offset(stored)
                self._tails[subject] = (ack["seq"], end + len(line) + 1, n + 1, ts or last)
                self._remember(subject, end, ack["seq"])
                return ts, end
        raise StoreError(f"{subject}: {APPEND_TRIES} writers in a row got there first")

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        self.hold(agent)  # (a consumer fenced off gets ClaimLost, not the lines)
        return self._read(self._subject(agent), offset)

    def _read(self, subject: str, offset: int, count: int = READ_BATCH) -> tuple[bytes, int]:
        held = self._held(subject, offset, count)
        if held is not None:
            return held, offset
        if self._ends.pop(subject, None) == (offset, self._trips()):
            return b"", offset  # (the pull, this thread's last round trip, said so)
        return self._fetch(subject, offset, count)

    def read_to(self, subject: str) -> int:
        """The stream sequence of the last line of ``subject`` read in this thread (0:
        none). A waiter waits in the thread that read just before it, what was there
        then: a line pulled at or below it is no news (see `Waiter`)."""
        return self._read_so_far().get(subject, 0)

    def _read_so_far(self) -> dict[str, int]:
        so_far: dict[str, int] | None = getattr(self._reading, "to", None)
        if so_far is None:
            so_far = self._reading.to = {}
        return so_far

    def _read_up_to(self, subject: str, seq: int) -> None:
        so_far = self._read_so_far()
        so_far[subject] = max(so_far.get(subject, 0), seq)

    def _pulled(self, message: Reply, asked: int) -> tuple[int, int]:
        """Keep a line a waiter pulled, for the read that follows (up to `KEPT_LINES`
        and `KEPT_BYTES` a subject, by offset, each with the offset of the next line: a
        line kept is a fact about the stream, so a read from one is served here, without
        a round trip); return its stream sequence and how many lines follow it in the
        consumer's subjects (`Reply.pulled`). When none does, the read after it is
        answered too: nothing, as long as this thread made no request since it came
        (``asked``: its count of requests then), as a read asked of the server then
        would have been answered."""
        brought = message.pulled()
        assert brought is not None  # (a waiter passes the lines its consumer brought)
        _, seq, pending = brought
        if not placed(message):  # (no line of the store's: the read sets it aside)
            return seq, pending
        offset = int(message.headers["Ralph-Offset"])
        after = offset + len(message.data) + 1
        subject = message.subject
        with self._kept_lock:
            kept = self._kept.setdefault(subject, {})
            if offset not in kept:  # (kept already: the same line, a fact of the stream)
                kept[offset] = (message.data, seq, after)
                size = self._kept_bytes.get(subject, 0) + len(message.data)
                while len(kept) > KEPT_LINES or (len(kept) > 1 and size > KEPT_BYTES):
                    size -= len(kept.pop(next(iter(kept)))[0])
                self._kept_bytes[subject] = size
        if not pending:
            self._ends[message.subject] = (after, (self._trips()[0], asked))
        return seq, pending

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
        self._read_up_to(subject, seq)
        return b"".join(line + b"\n" for line in lines)

    def _fetch(self, subject: str, offset: int, count: int) -> tuple[bytes, int]:
        """Up to ``count`` lines from ``offset`` (or from the first line kept, when it
        is below that) and where they start, asked of the server."""
        seq, start = self._seq_at(subject, offset)
        found = self._batch(subject, seq, count) if seq else []
        # Nothing from the stream sequence of a line's offset on: nothing from the offset
        # on (lines follow each other in both). A line that starts elsewhere: a stale
        # position (purged), looked up again.
        if found and self._offset(found[0]) != start:
            self._seqs.pop(subject, None)
            seq, start = self._seq_at(subject, offset)
            found = self._batch(subject, seq, count) if seq else []
        if not seq:  # at the end; or past it: the log was replaced, read from its start
            if start >= offset:
                return b"", offset
            self._read_so_far().pop(subject, None)
            data, first = self._fetch(subject, 0, count)
            return (data, first) if data else (b"", start)
        lines = [msg.data for msg in found]
        if found:
            last = found[-1]
            after = self._offset(last) + len(last.data) + 1
            self._remember(subject, after, self._seq(last) + 1)
            self._read_up_to(subject, self._seq(last))
        return b"".join(line + b"\n" for line in lines), start

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        return self.read_tails([agent], lines)[0]

    def read_tails(self, agents: list[str], lines: int) -> list[tuple[list[bytes], int]]:
        """`read_tail` of each, in two round trips for them all as a rule: the last line
        of each log (``multi_last``), then one batched get each, all at once
        (`Wire.many`), from where the first line wanted is guessed to be: as if the
        log's lines were spread evenly over the stream, `_TAIL_SPANS` spans back (then
        further, for the logs whose guess fell short). A log still not found, or that
        ends in a foreign line, is read alone (`_tail_of`)."""
        subjects = [self._subject(agent) for agent in agents]
        lasts = self._lasts(subjects) if lines > 0 else {}
        tails: list[tuple[list[bytes], int] | None] = [None] * len(subjects)
        plans: dict[int, tuple[int, int, int, int]] = {}  # index -> seq, n, first, end
        for index, subject in enumerate(subjects):
            last = lasts.get(subject)
            if last is None and lines > 0:  # an empty log: where its next line goes
                tails[index] = ([], self._emptied(subject)[0])
            elif last is not None and placed(last):
                seq, n = self._seq(last), _ordinal(last)
                end = self._offset(last) + len(last.data) + 1
                self._remember(subject, end, seq + 1)
                plans[index] = (seq, n, max(1, n - lines + 1), end)
        for spans in _TAIL_SPANS:
            batch = min(READ_BATCH, int(3 * spans * lines) + 16)
            asks = [(subjects[index], max(1, seq - int(spans * seq * lines / n) - 1), batch)
                    for index, (seq, n, _, _) in plans.items()]  # fmt: skip
            for index, (found, after) in zip(list(plans), self._afters(asks), strict=True):
                first, end = plans[index][2:]
                if found and all(map(placed, found)) and _ordinal(found[0]) <= first and not after:
                    tails[index] = ([msg.data for msg in found if _ordinal(msg) >= first], end)
                    del plans[index]
        return [tail if tail is not None else self._tail_of(subject, lines)
                for subject, tail in zip(subjects, tails, strict=True)]  # fmt: skip

    def _tail_of(self, subject: str, lines: int) -> tuple[list[bytes], int]:
        """The last ``lines`` lines of ``subject``: the first of them found by bisection
        on the ordinals, then one batched get."""
        seq, end, n, _ = self._tail(subject)
        if lines <= 0 or not seq:
            return [], end
        if n <= min(READ_BATCH, 4 * lines + 16):  # a short log: all of it, in one get
            return [msg.data for msg in self._batch(subject, 1, n)[-lines:]], end
        first = max(1, n - lines + 1)
        low, high, start = 1, seq, seq
        while low <= high:  # the seq of the line whose ordinal is `first`
            middle = (low + high) // 2
            msg = self._get(subject, middle)
            if msg is None:
                high = middle - 1
                continue
            if _ordinal(msg) >= first:
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
        """Purge the lines older than ``before`` below the inbox's start (what gc
        collected: consumed by every reader), never one above it; return the offset
        its audit trail starts at now."""
        subject, start = self._subject(agent), self._base(agent)
        kept, position = None, 0
        while True:  # the first line to keep: not older than `before`, or not collected
            found = self._batch(subject, position + 1, READ_BATCH)
            kept = next((msg for msg in found if ts_of(msg.data) >= before
                         or self._offset(msg) >= start), None)  # fmt: skip
            if kept is not None or not found:
                break
            position = self._seq(found[-1])
        if position or (found and kept is not found[0]):  # a line before it: purge
            purge: dict[str, object] = {"filter": subject}
            if kept is not None:
                purge["seq"] = self._seq(kept)  # (what is below it)
            purged = self._api(f"STREAM.PURGE.{self.stream}", purge)
            if "error" in purged:
                raise StoreError(f"NATS {self.shown}: {purged['error']}")
            self._seqs.pop(subject, None)
            with self._kept_lock:
                self._kept.pop(subject, None)
                self._kept_bytes.pop(subject, None)
        return self._offset(kept) if kept is not None else self.size(agent)

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
        record = _dead_record(agent, offset, line, reason)
        self.log_append(f"dead.{kv_key(agent)}", orjson.dumps(record) + b"\n")

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_read(f"dead.{kv_key(agent)}").splitlines()]

    # -- indexes --------------------------------------------------------------------------

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Written in the background (the message is delivered already: an index entry
        costs a send no round trip); this process's index reads wait for it first. Another
        process may read the index a few milliseconds before the entry is in."""
        subject = self._subject(f"ix:{key}")
        seq = self._seqs.get(self._subject(agent), {}).get(offset, 0)  # (a line I stored)
        entry = orjson.dumps([agent, offset, length])
        self._queue(lambda: self._queued.setdefault(subject, []).append((entry, seq)))

    def _post(self, subject: str, payload: bytes) -> None:
        """Publish ``payload`` in the background, with what else is queued then."""
        self._queue(lambda: self._outbox.append((subject, payload)))

    def _queue(self, add: Callable[[], None]) -> None:
        """``add()`` a write to what `_send_out` sends next, and have it sent when
        nothing was queued (what comes while it waits to be sent goes with it)."""
        with pending_lock():
            idle = not self._queued and not self._outbox
            add()
        if idle:
            later(self._send_out)

    def index_extend(self, key: str, entries: list[tuple[str, int, int]]) -> None:
        """`index_add` each, in order (they go out in one message, or a few)."""
        for agent, offset, length in entries:
            self.index_add(key, agent, offset, length)

    def index_start(self, key: str) -> None:
        """An index is a subject of its own here: nothing before its first entry to skip."""

    def _send_out(self) -> None:
        """Write what is queued: each index's entries in one message (an index is not a
        log: its messages carry no offsets, so writers need not take turns, and the bus
        orders what it finds by ts), and the posts, all in one write (`_acked_all`). Each
        has an id: sent again, stored once."""
        with pending_lock():
            queued, outbox = self._queued, self._outbox
            self._queued, self._outbox = {}, []
        posts: list[tuple[str, bytes, dict[str, str] | None]] = []
        for subject, entries in queued.items():
            batch = b"\n".join(entry for entry, _ in entries)
            headers = {"Nats-Msg-Id": _line_id(subject, 0, batch)}
            if all(seq for _, seq in entries):  # where their lines are in the stream
                headers["Ralph-Seqs"] = ",".join(str(seq) for _, seq in entries)
            posts.append((subject, batch, headers))
        for subject, payload in outbox:
            posts.append((subject, payload, {"Nats-Msg-Id": _line_id(subject, 0, payload)}))
        if posts:
            self._acked_all(posts)

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        """The last ``count`` entries of the index's last messages (twice ``count`` of
        them, and `INDEX_SLACK` more), by the stream sequence of their lines when each
        message gives them (its ``Ralph-Seqs`` header): writers batch their entries
        (`_send_out`), so a batch written late holds lines stored before those of
        batches written sooner, and the stream's order is the order the lines were
        stored in."""
        flush()
        found: list[tuple[int, tuple[str, int, int]]] = []
        ordered = True
        window = 2 * count + INDEX_SLACK if count else 0
        for msg in self._index_tail(self._subject(f"ix:{key}"), window):
            raws = msg.data.split(b"\n")
            seqs = _seqs_of(msg, len(raws))
            ordered = ordered and bool(seqs)
            for seq, raw in zip(seqs or [0] * len(raws), raws, strict=True):
                entry = _entry(raw)
                if entry is not None:  # (a foreign one: none)
                    found.append((seq, entry))
        if ordered:
            found.sort(key=lambda seq_entry: seq_entry[0])
        return [entry for _, entry in found[-count:]] if count else []

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
