"""The NATS JetStream backend (DESIGN §13): the same mailbox for a team whose agents run
on several hosts. Selected by ``RALPH_BACKEND=nats://HOST:PORT`` (nats-py, the ``nats``
extra).

A team is one stream, ``RALPH_<team in hex>`` over ``ralph.<team in hex>.>``, and one
key-value bucket of the same name. Every log the library keeps is a subject of that
stream: an inbox (``in.<agent>``), a channel (``ch.<name>``), a team log (``tl.<name>``,
the task log among them), an index (``ix.<key>``). A log message's payload is one line;
its headers carry its logical offset (``Ralph-Offset``: the byte offset the line would
have in the inbox file, so cursors and indexes mean what they mean on files) and its
ordinal (``Ralph-N``). Appends are serialised per subject by JetStream itself
(``Nats-Expected-Last-Subject-Sequence``: a writer that lost the race reads the new end
and tries again), and carry ``Nats-Msg-Id`` = the inbox and the message id, so a send
retried under the same id is stored once within the stream's duplicate window. An index
is not a log: its messages (entries) carry no offsets, and writers do not take turns.

Reads are batched direct gets (one round trip for up to `READ_BATCH` lines). A waiter
pulls from an ephemeral consumer of its subjects (`_Waiter`): the server holds the pull
until a line is stored, and the line pulled serves the read that follows. The
bucket keeps the roster, presence, cursors (with the stream sequence of the floor),
state, rates and the one-consumer claim: a lease renewed every `LEASE_S` / 3 seconds, so
a consumer killed -9 is released within `LEASE_S` (on files, at once). Presence, claims,
state versions and inbox starts are pushed to each process (`Keys`).

What the file backend does with gc is the server's business here: nothing is compacted
(``compact`` drops nothing; the stream's limits and ``purge_archive`` bound it), so the
audit trail is the stream itself.

Two connections per process and server. The store's round trips (appends, reads, the
bucket's keys, cursor and index writes) go over a blocking socket per thread
(`natswire.Wire`): nats-py is asyncio only, and reaching its loop from a synchronous
caller costs a thread hop longer than the round trip. nats-py's connection
(`natspush`), on a loop thread of its own, carries the bucket's watch and the creation
and removal of teams; it is imported when first needed. Cursor and index writes are
made in the background, in order, on one thread of their own.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson

from ralph_mail.errors import InboxBusy, StoreError
from ralph_mail.message import format_ts
from ralph_mail.store.base import Compaction, Cursor, Finding, check_key
from ralph_mail.store.nats.wire import (
    REQUEST_S,
    NeverReached,
    Reply,
    TooBig,
    Wire,
    WireError,
)

if TYPE_CHECKING:  # natspush (nats-py, asyncio) is imported when first needed
    from ralph_mail.store.base import Query, StopEvent
    from ralph_mail.store.nats.push import Keys, Loop
    from ralph_mail.store.search import SearchIndex

_T = TypeVar("_T")

#: Lines a read returns at most (one batched direct get).
READ_BATCH: Final = 1000
#: How long a consumer's claim lasts without renewal (s); ``RALPH_NATS_LEASE_S`` sets it.
LEASE_S: Final = 10.0


def lease_s() -> float:
    """The claim's lease: ``$RALPH_NATS_LEASE_S`` (seconds), else `LEASE_S`."""
    try:
        return max(0.5, float(os.environ.get("RALPH_NATS_LEASE_S", LEASE_S)))
    except ValueError:
        return LEASE_S


#: How long a waiter's consumer lives on the server without a pull (s).
PULL_IDLE_S: Final = 60.0
#: How often a wait that may be stopped (an MCP call cancelled) looks at its stop (s).
PULL_STOP_S: Final = 0.1
#: Lines pulled by waiters kept for the reads that follow, a subject (see `_pulled`).
KEPT_LINES: Final = 256
#: Keys looked up one by one before the bucket's watch starts (see `NatsStore._watched`).
WATCH_AFTER: Final = 8
#: Index messages read first, hoping they are all (see `NatsStore.index_tail`).
INDEX_PROBE: Final = 64
#: Tries of an append that keeps losing the race for its subject's end.
APPEND_TRIES: Final = 1000
_ID = re.compile(rb'"id":"([0-9a-f]{12})"')
_KV_KEY = re.compile(r"[-_=.A-Za-z0-9]+")


def _hex(name: str) -> str:
    return name.encode().hex()


def _key(name: str) -> str:
    """A KV key for ``name``: itself when it is a valid key, else ``x`` + its hex."""
    plain = _KV_KEY.fullmatch(name) and not name.startswith("x") and _tokens(name)
    return name if plain else "x" + _hex(name)


def _tokens(name: str) -> bool:
    """Whether ``name`` splits into subject tokens, none empty: a valid name may hold
    ``..`` or end in ``.`` (``a..b``, ``b.``), which no subject or key may."""
    return ".." not in name and not name.endswith(".")


def _token(name: str) -> str:
    """``name`` as the end of a subject: itself, or ``=`` + its hex when its tokens are
    not all whole (no name holds ``=``, so the two never meet; see `_untoken`)."""
    return name if _tokens(name) else "=" + _hex(name)


def _untoken(token: str) -> str:
    return bytes.fromhex(token[1:]).decode() if token.startswith("=") else token


class _Waiter:
    """Waits in the caller's own thread: a pull of the next line stored in its subjects,
    from a consumer of its own (memory, no acks), over the thread's `Wire`. The server
    holds the pull until a line is stored or the wait is over, so nothing polls and no
    other thread has to pass the news on; the line pulled is kept for the read that
    follows. A consumer the server forgot (restarted; idle past `PULL_IDLE_S`) is made
    again, and the wait returns for a read of what came meanwhile."""

    def __init__(self, store: NatsStore, subjects: list[str]) -> None:
        self._store, self._subjects = store, subjects
        self._last = 0  # the last stream sequence pulled
        self._name = ""
        self._make()

    def _make(self) -> None:
        config: dict[str, Any] = {"ack_policy": "none", "mem_storage": True, "num_replicas": 1,
                                  "inactive_threshold": int(PULL_IDLE_S * 1e9)}  # fmt: skip
        if len(self._subjects) == 1:
            config["filter_subject"] = self._subjects[0]
        else:
            config["filter_subjects"] = self._subjects
        if self._last:  # from where the last one stopped
            config["deliver_policy"], config["opt_start_seq"] = "by_start_sequence", self._last + 1
        else:
            config["deliver_policy"] = "new"
        stream = self._store.stream
        made = self._store._api(f"CONSUMER.CREATE.{stream}", {"stream_name": stream,
                                                             "config": config})  # fmt: skip
        if "error" in made:
            raise StoreError(f"NATS {self._store.url}: {made['error'].get('description')}")
        self._name = str(made["name"])

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            step = max(0.001, min(left, PULL_STOP_S) if stop is not None else left)
            pull = orjson.dumps({"batch": 1, "expires": int(step * 1e9)})
            try:
                got = self._store._ask(f"$JS.API.CONSUMER.MSG.NEXT.{self._store.stream}."
                                       f"{self._name}", pull, timeout=step + REQUEST_S,
                                       pull=True)[0]  # fmt: skip
            except StoreError:
                self._name = ""  # (made again below, once the server answers)
                got = None
            if got is not None and got.status is None:
                self._last = max(self._last, self._store._pulled(got))
                return True
            if got is not None and got.status == "408":
                continue  # the pull expired with nothing: pull again
            with contextlib.suppress(StoreError):  # gone (or the server away): again
                self._make()
            return True

    def close(self) -> None:
        if self._name:
            stream, name, self._name = self._store.stream, self._name, ""
            with contextlib.suppress(StoreError):  # else it lapses after PULL_IDLE_S
                self._store._ask(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", timeout=2.0)


class NatsStore:
    """One team on a NATS server (see the module docstring)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        self.url, self.team, self.durable = url, team, durable
        self.stream = f"RALPH_{_hex(team)}"
        self._prefix = f"ralph.{_hex(team)}"
        self._looks = 0  # keys looked up before the bucket's watch started (see _watched)
        self._watching = False
        self._tails: dict[str, tuple[int, int, int, str]] = {}  # subject -> seq, end, n, ts
        self._seqs: dict[str, dict[int, int]] = {}  # subject -> offset -> stream seq
        self._claims: dict[str, int] = {}  # agent -> revision of my claim
        self._queued: dict[str, list[bytes]] = {}  # index subject -> entries to write
        self._log_cache: dict[str, tuple[bytes, int]] = {}  # team log -> read so far, end
        self._locks: dict[str, threading.Lock] = {}  # subject -> its appends, one at a time
        self._kept: dict[str, dict[int, tuple[bytes, int, int]]] = {}  # see _pulled
        self._kept_lock = threading.Lock()
        self._cache: dict[str, tuple[bytes, int] | None] | None = None  # see _watched
        self._keys: Keys | None = None
        self._renewer: threading.Thread | None = None
        self._search: SearchIndex | None = None
        self._closed = threading.Event()

    # -- plumbing -------------------------------------------------------------------------

    @property
    def _link(self) -> Loop:
        """nats-py's connection: made when something needs it (a waiter, the bucket's
        watch, the streams' administration), so a one-off command never imports it."""
        from ralph_mail.store.nats.push import Loop

        return Loop.of(self.url)

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        try:
            return self._link.run(coro)
        except (StoreError, InboxBusy, FileExistsError, FileNotFoundError):
            raise
        except Exception as exc:
            raise StoreError(f"NATS {self.url}: {exc or exc.__class__.__name__}") from None

    def _ask(
        self,
        subject: str,
        payload: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        batch: bool = False,
        timeout: float = REQUEST_S,
        pull: bool = False,
    ) -> list[Reply]:
        """One round trip over this thread's `Wire` (no hop to the loop's thread)."""
        read = subject.startswith(("$JS.API.DIRECT.GET.", "$JS.API.STREAM."))  # asked again
        try:  # (a read meeting a broken connection is asked again over a new one)
            wire = Wire.for_thread(self.url)
            return wire.request(subject, payload, headers, batch=batch, again=read,
                                timeout=timeout, pull=pull)  # fmt: skip
        except TooBig as exc:
            raise StoreError(f"NATS {self.url}: {exc}: send less, or raise max_payload in "
                             "the server's configuration") from None  # fmt: skip
        except NeverReached as exc:
            raise StoreError(str(exc)) from None  # (it names the server and the fix)
        except WireError as exc:
            raise StoreError(f"NATS {self.url}: {exc}") from None
        except TimeoutError as exc:
            raise StoreError(f"NATS {self.url}: {exc}") from None

    def _api(self, subject: str, request: dict[str, Any]) -> dict[str, Any]:
        """A JetStream API request's answer; a stream not found is no team."""
        answer = self._ask(f"$JS.API.{subject}", orjson.dumps(request))[0]
        if answer.status is not None:
            self._missing(answer)
        found: dict[str, Any] = orjson.loads(answer.data)
        if found.get("error", {}).get("err_code") == 10059:  # stream not found
            raise FileNotFoundError(f"no team {self.team!r} at {self.url}")
        return found

    def _subject(self, key: str) -> str:
        """The subject of log ``key``: an inbox, ``#channel``, ``log:name`` or ``ix:key``."""
        if key.startswith("#"):
            return f"{self._prefix}.ch.{_token(key[1:])}"
        if key.startswith("log:"):
            return f"{self._prefix}.tl.{_token(key[4:])}"
        if key.startswith("ix:"):
            return f"{self._prefix}.ix.{_hex(key[3:])}"
        return f"{self._prefix}.in.{_token(key)}"

    def _get(self, subject: str, seq: int | None = None) -> Reply | None:
        """The last message of ``subject`` (or the first at or after ``seq``), or None."""
        direct = f"$JS.API.DIRECT.GET.{self.stream}"
        if seq is None:
            answer = self._ask(f"{direct}.{subject}")[0]
        else:
            answer = self._ask(direct, orjson.dumps({"seq": seq, "next_by_subj": subject}))[0]
        if answer.status is None:
            return answer
        self._missing(answer)
        return None

    def _missing(self, answer: Reply) -> None:
        """Return on "no such message"; raise anything else the server says."""
        if answer.status in ("404", "408"):
            return
        if answer.status == "503":
            raise FileNotFoundError(f"no team {self.team!r} at {self.url}")
        why = answer.headers.get("Description", "")
        raise StoreError(f"NATS {self.url}: {answer.status} {why}")

    def _batch(self, subject: str, seq: int, count: int) -> list[Reply]:
        """Up to ``count`` messages of ``subject`` from stream sequence ``seq``: one
        batched direct get."""
        return self._after(subject, seq, count)[0]

    def _after(self, subject: str, seq: int, count: int) -> tuple[list[Reply], int]:
        """`_batch`, and how many messages of ``subject`` follow those."""
        request = {"seq": max(1, seq), "next_by_subj": subject, "batch": count}
        answers = self._ask(f"$JS.API.DIRECT.GET.{self.stream}", orjson.dumps(request), batch=True)
        end = answers.pop()
        if end.status != "204":
            self._missing(end)
            return answers, 0
        return answers, int(end.headers.get("Nats-Num-Pending", 0))

    @staticmethod
    def _offset(msg: Reply) -> int:
        return int(msg.headers["Ralph-Offset"])

    @staticmethod
    def _seq(msg: Reply) -> int:
        return int(msg.headers["Nats-Sequence"])

    def _remember(self, subject: str, offset: int, seq: int) -> None:
        known = self._seqs.setdefault(subject, {})
        if len(known) > 100_000:
            known.clear()
        known[offset] = seq

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

    # -- the roster, presence -------------------------------------------------------------

    def roster(self) -> bytes:
        return self._kv_get("roster") or b""

    def update_roster(self, change: Callable[[bytes], bytes]) -> None:
        self._kv_update("roster", lambda raw: change(raw or b""))

    def save_presence(self, agent: str, record: bytes) -> None:
        self._kv_put(f"presence.{_key(agent)}", record)

    def load_presence(self, agent: str) -> bytes | None:
        return self._looked(f"presence.{_key(agent)}")

    def _looked(self, key: str) -> bytes | None:
        """``key``'s value from the watch, asked of the server when the watch has not
        heard of it (a watch can start a moment behind a write)."""
        found = self._watched(key)
        if found is None and self._keys is not None:
            return self._kv_get(key)
        return found[0] if found is not None else None

    # -- the bucket, over the wire --------------------------------------------------------

    def _kv_get(self, key: str) -> bytes | None:
        return self._kv_entry(key)[0]

    def _kv_entry(self, key: str) -> tuple[bytes | None, int]:
        """``key``'s value and revision: None and the revision of its deletion when it
        was deleted, None and 0 when it never was."""
        got = self._api(f"STREAM.MSG.GET.KV_{self.stream}",
                        {"last_by_subj": f"$KV.{self.stream}.{key}"})  # fmt: skip
        if "error" in got:
            if got["error"].get("err_code") == 10037:  # no message: never set
                return None, 0
            raise StoreError(f"NATS {self.url}: {got['error'].get('description', got)}")
        message = got["message"]
        marks = base64.b64decode(message.get("hdrs") or b"")
        if b"KV-Operation: DEL" in marks or b"KV-Operation: PURGE" in marks:
            return None, int(message["seq"])
        return base64.b64decode(message.get("data") or b""), int(message["seq"])

    def _kv_write(
        self, key: str, value: bytes, last: int | None = None, *, timeout: float = REQUEST_S
    ) -> int | None:
        """Put ``value`` (``last``: only over that revision; 0, only when ``key`` was
        never set); its revision, or None when ``last`` was not the last."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last)} if last is not None else {}
        return self._kv_send(key, value, headers, timeout)

    def _kv_delete(self, key: str, *, timeout: float = REQUEST_S) -> None:
        self._kv_send(key, b"", {"KV-Operation": "DEL"}, timeout)
        if self._cache is not None:
            self._cache[key] = None

    def _kv_send(
        self, key: str, value: bytes, headers: dict[str, str], timeout: float
    ) -> int | None:
        ack = self._acked(f"$KV.{self.stream}.{key}", value, headers or None, timeout)
        return None if ack is None else int(ack["seq"])

    def _kv_put(self, key: str, value: bytes) -> None:
        revision = self._kv_write(key, value)
        assert revision is not None
        self._saw(key, value, revision)

    def _saw(self, key: str, value: bytes, revision: int) -> None:
        """Note my own write in the watch's cache at once: what this process wrote, it
        reads (the watch brings the same revision a moment later)."""
        if self._cache is not None:
            known = self._cache.get(key)
            if known is None or known[1] < revision:
                self._cache[key] = (value, revision)

    def _kv_update(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        """Replace ``key`` with ``change(value)``, retried until no other update came
        between the read and the write."""
        for _ in range(APPEND_TRIES):
            raw, revision = self._kv_entry(key)
            value = change(raw)
            written = self._kv_write(key, value, last=revision)
            if written is not None:
                self._saw(key, value, written)
                return
        raise StoreError(f"NATS {self.url}: {key} kept changing under {APPEND_TRIES} updates")

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

    def _acked(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None = None,
        timeout: float = REQUEST_S,
    ) -> dict[str, Any] | None:
        """Publish to a stream (the team's, or its bucket's) and return its ack; None
        when an expected last sequence was not the last (another writer got there
        first)."""
        answer = self._ask(subject, payload, headers, timeout=timeout)[0]
        if answer.status is not None:  # 503: no stream takes that subject
            self._missing(answer)
            raise FileNotFoundError(f"no team {self.team!r} at {self.url}")
        ack: dict[str, Any] = orjson.loads(answer.data)
        error = ack.get("error")
        if error is None:
            return ack
        if error.get("err_code") == 10071:
            return None
        raise StoreError(f"NATS {self.url}: {error.get('description', error)}")

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

    def search(self, query: Query) -> list[bytes]:
        import sqlite3

        from ralph_mail.store.search import SearchIndex

        if self._search is None:
            connect = lambda: sqlite3.connect(":memory:", check_same_thread=False)  # noqa: E731
            self._search = SearchIndex(connect, self.read_audit, self._logs)
        found = self._search.search(query)
        lines = (self.read_line(inbox, offset, length) for inbox, offset, length in found)
        return [line for line in lines if line is not None]

    def _logs(self) -> list[str]:
        """Every inbox and channel of the team that holds a line (a former member's too)."""
        found = []
        for kind, mark in (("in", ""), ("ch", "#")):  # (not the indexes: one a thread)
            wanted = {"subjects_filter": f"{self._prefix}.{kind}.>"}
            info = self._api(f"STREAM.INFO.{self.stream}", wanted)
            for subject in info.get("state", {}).get("subjects") or {}:
                found.append(mark + _untoken(subject[len(self._prefix) + len(kind) + 2 :]))
        return sorted(found)

    def forget_archived(self, agent: str, offset: int) -> None:
        if self._search is not None:
            self._search.forget_before(agent, offset)

    def index_add(self, key: str, agent: str, offset: int, length: int) -> None:
        """Written in the background (the message is delivered already: an index entry
        costs a send no round trip); this process's index reads wait for it first. Another
        process may read the index a few milliseconds before the entry is in."""
        subject = self._subject(f"ix:{key}")
        with _PENDING_LOCK:
            queue = self._queued.setdefault(subject, [])
            queue.append(orjson.dumps([agent, offset, length]))
            first = len(queue) == 1
        if first:  # entries that come while it writes go in its next message
            self._later("index", self._drain, subject)

    def _drain(self, subject: str) -> None:
        """Write the queued index entries of ``subject``, all there are in one message.
        An index is not a log: its messages carry no offsets, so writers need not take
        turns (the bus orders what it finds by ts)."""
        while True:
            with _PENDING_LOCK:
                entries = self._queued.pop(subject, [])
            if not entries:
                return
            self._acked(subject, b"\n".join(entries))

    def _flush(self, kind: str = "") -> None:
        """Wait for the writes of ``kind`` ("index" entries, "cursor"s; all by default)
        this process is still making (any store's: a bus reads what another bus of the
        process wrote, as on files)."""
        with _PENDING_LOCK:
            pending = [f for k, f in _PENDING if kind in ("", k)]
            _PENDING[:] = [(k, f) for k, f in _PENDING if kind not in ("", k)]
        deadline = time.monotonic() + REQUEST_S  # for them all (a server away: not each)
        for future in pending:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                import warnings

                why = str(exc) or f"not done within {REQUEST_S:g} s"
                warnings.warn(f"a background write failed ({why}): an index entry is "
                              "missing, or a cursor moved less far", RuntimeWarning,
                              stacklevel=3)  # fmt: skip

    def index_tail(self, key: str, count: int) -> list[tuple[str, int, int]]:
        self._flush("index")
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

    # -- cursors, claims ------------------------------------------------------------------

    def load_cursor(self, agent: str) -> Cursor:
        self._flush("cursor")
        raw = self._kv_get(f"cursor.{_key(agent)}")
        if raw is None:
            return Cursor(0)
        saved = orjson.loads(raw)
        if saved.get("seq"):
            self._remember(self._subject(agent.partition("@")[0]), saved["floor"], saved["seq"])
        return Cursor(int(saved["floor"]), {int(a) for a in saved.get("acked", [])})

    def save_cursor(self, agent: str, cursor: Cursor) -> None:
        subject = self._subject(agent.partition("@")[0])
        seq = self._seqs.get(subject, {}).get(cursor.floor, 0)
        record = {"floor": cursor.floor, "acked": sorted(cursor.acked), "seq": seq}
        # In the background, in order: a crash before it is stored leaves the old cursor
        # (what was consumed since comes again: at least once); close and every cursor
        # load of this process wait for it.
        self._later("cursor", self._kv_write, f"cursor.{_key(agent)}", orjson.dumps(record))

    def _later(self, kind: str, write: Callable[..., Any], *args: Any) -> None:
        """Make ``write(*args)`` on the process's background thread, after the writes
        started before it; `_flush` waits for it."""
        with _PENDING_LOCK:
            _PENDING[:] = [(k, f) for k, f in _PENDING if not f.done()]
            _PENDING.append((kind, _BACKGROUND.submit(write, *args)))

    def claim(self, agent: str) -> None:
        if agent in self._claims:
            return
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        key = f"claim.{_key(agent)}"
        for _ in range(3):
            raw, revision = self._kv_entry(key)
            holder = orjson.loads(raw) if raw else {}
            alive = holder.get("until", 0) > time.time()
            if alive and (holder["pid"], holder["host"]) != (me["pid"], me["host"]):
                raise InboxBusy(
                    f"the inbox of {agent!r} is consumed by pid {holder['pid']} on "
                    f"{holder['host']}: stop it first (its claim lapses {lease_s():g} s "
                    "after it dies)",
                    int(holder["pid"]),
                )
            value = orjson.dumps({**me, "until": time.time() + lease_s()})
            taken = self._kv_write(key, value, last=revision)
            if taken is None:  # another process took it meanwhile: look again
                continue
            self._claims[agent] = taken
            self._saw(key, value, taken)
            self._renew()
            return
        raise InboxBusy(f"the inbox of {agent!r} is being claimed by another process")

    def _renew(self) -> None:
        """Keep my claims alive (a thread, once)."""
        if self._renewer is not None:
            return

        def renew() -> None:
            while not self._closed.wait(lease_s() / 3):
                for agent in list(self._claims):
                    key = f"claim.{_key(agent)}"
                    value = orjson.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "until": time.time() + lease_s()})  # fmt: skip
                    try:
                        renewed = self._kv_write(key, value, last=self._claims[agent])
                    except Exception:
                        renewed = None  # (a server away past the lease: claimed again)
                    if renewed is None:
                        self._claims.pop(agent, None)  # lost: the next read claims again
                    else:
                        self._claims[agent] = renewed

        self._renewer = threading.Thread(target=renew, name="ralph-nats-lease", daemon=True)
        self._renewer.start()

    def release(self, agent: str) -> None:
        if self._claims.pop(agent, None) is not None:
            with contextlib.suppress(StoreError):  # else the lease lapses by itself
                self._kv_delete(f"claim.{_key(agent)}", timeout=2.0)

    def consumer(self, agent: str) -> int | None:
        raw = self._looked(f"claim.{_key(agent)}")
        holder = orjson.loads(raw) if raw else None
        if holder is None or holder.get("until", 0) <= time.time():
            return None
        return int(holder["pid"])

    # -- dead letters, compaction, waking -------------------------------------------------

    def dead_letter(self, agent: str, offset: int, line: bytes, reason: str) -> None:
        record = {"ts": format_ts(time.time_ns() // 1000), "inbox": agent, "offset": offset,
                  "reason": reason, "line": line.decode("utf-8", "backslashreplace")}  # fmt: skip
        self.log_append(f"dead.{_key(agent)}", orjson.dumps(record) + b"\n")

    def dead_letters(self, agent: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_read(f"dead.{_key(agent)}").splitlines()]

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
        (`read_audit` reads it); with ``drop_before`` the lines older than it are purged
        from the server for good."""
        if drop_before is not None:
            self.purge_archive(agent, drop_before)
        subject = self._subject(agent)
        base = self._base(agent)
        floors = [self.load_cursor(reader).floor for reader in self._readers(agent)]
        floor = min(floors, default=base)
        end = self.size(agent)
        if floor - base < max(min_bytes, 1):
            return Compaction(agent, 0, end - base, base)
        dropped = self._ordinal(subject, floor) - self._ordinal(subject, base)
        self._kv_put(f"base.{_key(agent)}", str(floor).encode())
        return Compaction(agent, floor - base, end - floor, floor, dropped)

    def _base(self, agent: str) -> int:
        raw = self._kv_get(f"base.{_key(agent)}")
        return int(raw) if raw else 0

    def _ordinal(self, subject: str, offset: int) -> int:
        """How many lines of ``subject`` come before ``offset``."""
        at = self._seq_at(subject, offset)
        found = self._get(subject, at[0]) if at is not None else None
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
            if name.startswith(prefix) and self._kv_get(f"cursor.{_key(name)}") is not None:
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
        found = self._watched(f"base.{_key(agent)}")
        return max(0, floor - (int(found[0]) if found is not None else 0))

    def drop_cursor(self, key: str) -> None:
        self._flush("cursor")  # (not to be put back by a write still under way)
        self._kv_delete(f"cursor.{_key(key)}")

    def waiter(self, agents: list[str]) -> _Waiter:
        return _Waiter(self, [self._subject(key) for key in agents])

    def create_log(self, key: str) -> None:
        name = f"log.{_key(key)}"
        raw, revision = self._kv_entry(name)  # a deleted one may be made again
        if raw is not None or self._kv_write(name, b"1", last=revision) is None:
            raise FileExistsError(key)

    # -- team logs, state, rates ----------------------------------------------------------

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

    def load_state(self, key: str) -> bytes | None:
        check_key(key, "state key")
        return self._kv_get(f"state.{_key(key)}")

    def save_state(self, key: str, data: bytes) -> None:
        check_key(key, "state key")
        self._kv_put(f"state.{_key(key)}", data)

    def update_state(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        check_key(key, "state key")
        self._kv_update(f"state.{_key(key)}", change)

    def state_version(self, key: str) -> tuple[int, ...] | None:
        """From the bucket's watch (see `_watched`): no round trip."""
        check_key(key, "state key")
        found = self._watched(f"state.{_key(key)}")
        return None if found is None else (found[1],)

    def _watched(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and revision as a watch of the bucket has them (`Keys`): the
        server pushes every change, so presence, claims, state versions and an inbox's
        start cost no round trip (a change reaches this process within the server's
        delivery time). A short life (a command) never needs it: the watch is started
        at the `WATCH_AFTER`-th look, on a thread of its own (nats-py to import, a
        connection to make), and until it is ready each look asks the server."""
        if self._cache is None:
            self._looks += 1
            if self._looks >= WATCH_AFTER and not self._watching:
                self._watching = True
                threading.Thread(target=self._watch, name="ralph-nats-watch", daemon=True).start()
            raw, revision = self._kv_entry(key)
            return None if raw is None else (raw, revision)
        return self._cache.get(key)

    def _watch(self) -> None:
        from ralph_mail.store.nats.push import Keys

        with contextlib.suppress(StoreError):  # else looks go on asking the server
            keys = Keys(self._link, self.stream)
            self._run(keys.start())
            if keys.ready.wait(REQUEST_S) and not self._closed.is_set():
                self._keys, self._cache = keys, keys.values
            else:
                self._run(keys.stop())

    def state_where(self, key: str) -> str:
        return f"{self.url} bucket {self.stream} key state.{_key(key)}"

    def take(self, key: str, limit: int, window: float) -> float:
        wait = 0.0

        def change(raw: bytes | None) -> bytes:
            nonlocal wait
            now = time.time()
            times = [t for t in (orjson.loads(raw) if raw else []) if t > now - window]
            wait = 0.0
            if len(times) >= limit:
                wait = times[len(times) - limit] + window - now
                return orjson.dumps(times)
            return orjson.dumps([*times, now])

        self._kv_update(f"rate.{_key(key)}", change)
        return wait

    def close(self) -> None:
        self._flush()
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


#: Writes this process has under way in the background (index entries, cursors), made
#: in order on one thread of their own.
_PENDING: list[tuple[str, concurrent.futures.Future[Any]]] = []
_PENDING_LOCK = threading.Lock()


class _Background:
    """One daemon thread making writes in the order they came. Not an executor's: at
    exit the interpreter would wait for every write still queued (10 s each, with the
    server away); what `close` did not see done is left, as a crash would leave it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, write: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, lambda: write(*args)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ralph-nats-write",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            future, write = self._queue.get()
            try:
                future.set_result(write())
            except BaseException as exc:
                future.set_exception(exc)


_BACKGROUND = _Background()


def _forked() -> None:
    """A child starts with no writes of its parent's (their thread did not come along)."""
    global _BACKGROUND, _PENDING_LOCK
    _BACKGROUND, _PENDING_LOCK = _Background(), threading.Lock()
    _PENDING.clear()


os.register_at_fork(after_in_child=_forked)


def _ts_of(line: bytes) -> str:
    found = re.search(rb'"ts":"([^"]*)"', line)
    return found.group(1).decode() if found else ""


class NatsBackend:
    """Teams on one NATS server: a stream and a bucket each, listed in ``RALPH_TEAMS``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _link(self) -> Loop:
        from ralph_mail.store.nats.push import Loop

        return Loop.of(self.url)

    def _teams(self) -> Any:
        link = self._link()

        async def bucket() -> Any:
            return await link.js.create_key_value(bucket="RALPH_TEAMS", history=1)

        return link.run(bucket())

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

        link, teams = self._link(), self._teams()
        stream = f"RALPH_{_hex(name)}"

        async def create() -> None:
            try:
                await teams.create(_hex(name), name.encode())
            except KeyWrongLastSequenceError:  # there, or a team deleted a moment ago
                try:
                    await teams.get(_hex(name))
                except NotFoundError:  # deleted (or purged): its name is free again
                    await teams.put(_hex(name), name.encode())
                else:
                    raise FileExistsError(name) from None
            await link.js.add_stream(StreamConfig(
                name=stream, subjects=[f"ralph.{_hex(name)}.>"], allow_direct=True,
                storage=StorageType.FILE, duplicate_window=120.0,
            ))  # fmt: skip
            kv = await link.js.create_key_value(bucket=stream, history=1)
            await kv.put("roster", roster)

        link.run(create())

    def read_roster(self, name: str) -> bytes:
        store = NatsStore(self.url, name)
        raw = store._kv_get("roster")
        if raw is None:
            raise FileNotFoundError(name)
        return raw

    def team_names(self) -> list[str]:
        """The teams whose streams the server has (the list of streams is exact; the
        bucket of names only keeps two creators of one name apart)."""
        link = self._link()

        async def names() -> list[str]:
            found = []
            for info in await link.js.streams_info():
                name = str(info.config.name)
                if name.startswith("RALPH_") and name != "RALPH_TEAMS":
                    with contextlib.suppress(ValueError):
                        found.append(bytes.fromhex(name[len("RALPH_") :]).decode())
            return sorted(found)

        return link.run(names())

    def remove_team(self, name: str) -> None:
        link, teams = self._link(), self._teams()
        stream = f"RALPH_{_hex(name)}"

        async def remove() -> None:
            for action in (link.js.delete_stream(stream), link.js.delete_key_value(stream)):
                with contextlib.suppress(Exception):  # already gone
                    await action
            await teams.delete(_hex(name))

        link.run(remove())

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        """The server answers, JetStream is on, each team's stream keeps its messages."""
        return [Finding(level, "server", text) for level, text in self.health()]  # type: ignore[arg-type]

    def where(self) -> str:
        return self.url

    def health(self) -> list[tuple[str, str]]:
        """``(level, message)`` findings for ``ralph-mail doctor``: the server answers,
        JetStream is on, and each team's stream keeps its messages on disk."""
        try:
            link = self._link()
        except StoreError as exc:
            return [("fail", str(exc))]

        async def check() -> list[tuple[str, str]]:
            try:
                account = await link.js.account_info()
            except Exception as exc:
                return [("fail", f"JetStream is not enabled on {self.url} ({exc}): start "
                         "the server with -js")]  # fmt: skip
            found = [("ok", f"{self.url}: JetStream on, {account.streams} streams, "
                      f"{account.storage:,} bytes stored")]  # fmt: skip
            return found

        found = link.run(check())
        for name in self.team_names():
            store = NatsStore(self.url, name)

            async def stream(store: NatsStore = store) -> Any:
                return await link.js.stream_info(store.stream)

            try:
                info = link.run(stream())
            except Exception as exc:
                found.append(("fail", f"team {name!r}: its stream {store.stream} is missing "
                              f"({exc}): delete the team and create it again"))  # fmt: skip
                continue
            storage = str(info.config.storage).rsplit(".", 1)[-1].lower()
            level = "ok" if storage == "file" else "warn"
            found.append((level, f"team {name!r}: stream {store.stream}, {storage} storage, "
                          f"{info.config.num_replicas or 1} replica(s), "
                          f"{info.state.messages:,} messages"))  # fmt: skip
        return found

    def team_store(self, name: str, *, durable: bool = False) -> NatsStore:
        return NatsStore(self.url, name, durable=durable)


__all__ = ["NatsBackend", "NatsStore"]
