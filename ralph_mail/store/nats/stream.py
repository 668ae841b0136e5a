"""The NATS store's round trips to a team's stream, which every side of the store
makes: requests over this thread's `Wire`, JetStream API calls, direct gets of a
subject's messages, publishes with their acks; nats-py's connection, made when first
needed. The store's tunables are here too, in one place.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson

from ralph_mail.errors import InboxBusy, PermissionDenied, StoreError
from ralph_mail.store.nats.names import hexed, prefix_of, stream_of, token
from ralph_mail.store.nats.urls import redacted
from ralph_mail.store.nats.wire import (
    REQUEST_S,
    TRY_S,
    Forbidden,
    NeverReached,
    Refused,
    Reply,
    TooBig,
    Wire,
    WireError,
)
from ralph_mail.store.outage import Tries

if TYPE_CHECKING:  # push (nats-py, asyncio) is imported when first needed
    from ralph_mail.store.nats.push import Loop

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


#: How many servers of a cluster keep each team's stream and bucket, by default: one
#: (a single server). ``RALPH_NATS_REPLICAS`` sets it (1 to 5) when a team is created.
REPLICAS: Final = 1


def replicas() -> int:
    """The replicas a team created now gets: ``$RALPH_NATS_REPLICAS``, else `REPLICAS`;
    `StoreError` naming a value that is no count from 1 to 5 (JetStream's bounds)."""
    raw = os.environ.get("RALPH_NATS_REPLICAS", "").strip()
    if not raw:
        return REPLICAS
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 5):
        raise StoreError(f"invalid RALPH_NATS_REPLICAS={raw!r}: give how many servers of "
                         "the cluster keep each team, 1 to 5 (3 for a 3-node cluster)")  # fmt: skip
    return int(raw)


#: How long a waiter's consumer lives on the server without a pull (s).
PULL_IDLE_S: Final = 60.0
#: How long one pull of a waiter lasts at most (s): a wait longer than this pulls again,
#: so that one whose consumer's server died is not left waiting for its answer.
PULL_MAX_S: Final = 5.0
#: How often a wait that may be stopped (an MCP call cancelled) looks at its stop (s).
PULL_STOP_S: Final = 0.1
#: Lines one pull of a waiter asks for: it stands, across waits, until they came (or
#: `PULL_MAX_S` passed), so a waiter woken again and again asks once every so many.
PULL_BATCH: Final = 16
#: Lines pulled by waiters kept for the reads that follow, a subject (see `_pulled`):
#: this many at most, and of this many bytes (the newest line is kept whatever its size).
KEPT_LINES: Final = 32
KEPT_BYTES: Final = 1 << 20
#: Offsets whose stream sequence a store keeps, a subject: the newest it met (its
#: appends, where its reads stopped, a cursor's floor), which the next read or commit
#: looks up; an older one is found by bisection.
SEQS_KEPT: Final = 64
#: Keys looked up one by one before the bucket's watch starts (see `NatsStore._watched`).
WATCH_AFTER: Final = 8
#: Bytes a line of a log takes at most, its newline included: above NATS's own ceiling
#: on a message (64 MiB). A subject found empty goes on past this much per message the
#: stream ever had (see `Logs._emptied`).
LINE_BOUND: Final = 1 << 27
#: Index messages read first, hoping they are all (see `NatsStore.index_tail`).
INDEX_PROBE: Final = 64
#: Tries of an append that keeps losing the race for its subject's end.
APPEND_TRIES: Final = 1000

#: The header of a write made only over its subject's last sequence (a key's revision).
EXPECTED: Final = "Nats-Expected-Last-Subject-Sequence"
#: JetStream's error codes: stream not found; wrong last sequence (another writer was
#: first); a publish sent again while the first is under way; JetStream off (for the
#: server, for the account); JetStream there but not answering for now (no meta leader,
#: not the leader, a stream offline).
_NO_STREAM: Final = 10059
_WRONG_LAST: Final = (10071, 10164)  # (with the sequence; without it, on a cluster)
_IN_PROCESS: Final = 10158  # "duplicate message id is in process": a try still under way
_JETSTREAM_OFF: Final = (10076, 10039)
_JETSTREAM_AWAY: Final = (10008, 10009, 10118)


def _may_repeat(subject: str, headers: dict[str, str] | None) -> bool:
    """Whether a request may be sent again when its connection breaks or its answer
    does not come: all but a consumer's pull (the waiter makes another) and a change of
    a key made over its revision that is not idempotent (a state, a rate, the roster:
    applied twice). An append carries a ``Nats-Msg-Id`` (stored once); a cursor or a
    claim written over its revision twice is written once (`claims` reads it back)."""
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        return False
    if subject.startswith("$KV.") and EXPECTED in (headers or {}):
        return subject.split(".", 2)[2].startswith(("cursor.", "claim."))
    return True


def code_of(answer: dict[str, Any]) -> int | None:
    """The error code of a JetStream API answer, or None."""
    error = answer.get("error")
    return int(error.get("err_code", 0)) if isinstance(error, dict) else None


def jetstream_off(shown: str) -> str:
    """The one line for a server without JetStream."""
    return (f"the NATS server at {shown} has JetStream off, which the nats backend needs: "
            "start it with -js (nats-server -js), or add 'jetstream {}' to its "
            "configuration")  # fmt: skip


class TeamStream:
    """One team's stream on a NATS server, asked over the wire (the base of `NatsStore`)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        self.url, self.team, self.durable = url, team, durable
        self.shown = redacted(url)  # the URL as messages show it (no password)
        self.stream = stream_of(team)
        self._prefix = prefix_of(team)
        self._seqs: dict[str, dict[int, int]] = {}  # subject -> offset -> stream seq
        self._closed = threading.Event()

    @property
    def _link(self) -> Loop:
        """nats-py's connection: made when something needs it (a waiter, the bucket's
        watch, the streams' administration), so a one-off command never imports it."""
        from ralph_mail.store.nats.push import Loop

        return Loop.of(self.url)

    def _trips(self) -> tuple[int, int]:
        """Which connection this thread has, and how many requests it made so far: the
        same after a request when it was this thread's last round trip."""
        wire = Wire.for_thread(self.url)
        return id(wire), wire.asked

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        try:
            return self._link.run(coro)
        except (StoreError, InboxBusy, FileExistsError, FileNotFoundError):
            raise
        except Exception as exc:
            raise StoreError(f"NATS {self.shown}: {exc or exc.__class__.__name__}") from None

    def _ask(
        self,
        subject: str,
        payload: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        batch: bool = False,
        timeout: float = REQUEST_S,
    ) -> list[Reply]:
        """One round trip over this thread's `Wire` (no hop to the loop's thread). No
        responders (503) is JetStream off (said at once), the team gone (no team), or
        JetStream unavailable for a while (a leader election, a restart): asked again
        until ``timeout``, or for as long as the process is patient."""
        tries = Tries(time.monotonic() + timeout, f"the NATS server at {self.shown}")
        while True:
            replies = self._round_trip(subject, payload, headers, batch, timeout)
            if replies[0].status != "503":
                return replies
            self._no_responders(subject, tries)

    def _round_trip(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None,
        batch: bool,
        timeout: float,
    ) -> list[Reply]:
        again = _may_repeat(subject, headers)
        return self._on_wire(lambda wire: wire.request(
            subject, payload, headers, batch=batch, again=again, timeout=timeout
        ), timeout)  # fmt: skip

    def _on_wire(self, call: Callable[[Wire], _T], timeout: float) -> _T:
        """``call`` with this thread's `Wire`, what it raises in one line."""
        try:
            return call(Wire.for_thread(self.url))
        except TooBig as exc:
            raise StoreError(f"NATS {self.shown}: {exc}: send less, or raise max_payload in "
                             "the server's configuration") from None  # fmt: skip
        except (NeverReached, Refused) as exc:
            raise StoreError(str(exc)) from None  # (it names the server and the fix)
        except Forbidden as exc:
            raise PermissionDenied(
                f"{exc}: this user's permissions on the server (written "
                "by 'ralph-mail nats config') do not allow it"
            ) from None
        except WireError as exc:
            raise StoreError(f"NATS {self.shown}: {exc}") from None
        except TimeoutError:
            raise StoreError(self._unavailable(f"no answer within {timeout:g} s")) from None

    def _unavailable(self, why: str) -> str:
        """The one line for a server that is there and does not answer (yet)."""
        return (f"the NATS server at {self.shown} is unavailable ({why}: a leader "
                "election, a restart or an overload): tried again until the bound; run "
                "the command again once it is back")  # fmt: skip

    def _no_responders(self, subject: str, tries: Tries) -> None:
        """After a 503: raise what it means, or return to ask again (see `_ask`)."""
        if not Wire.for_thread(self.url).jetstream:
            raise StoreError(jetstream_off(self.shown))
        if not subject.startswith("$JS.API."):  # a stream's subject: is the stream there?
            try:
                probe = self._round_trip(f"$JS.API.STREAM.INFO.{self.stream}", b"{}", None,
                                         False, TRY_S)[0]  # fmt: skip
            except StoreError:  # (no answer: as unavailable as the request)
                probe = Reply({"Status": "408"})
            code = code_of(orjson.loads(probe.data)) if probe.status is None else None
            if code == _NO_STREAM:
                raise FileNotFoundError(f"no team {self.team!r} at {self.shown}")
            if code in _JETSTREAM_OFF:
                raise StoreError(jetstream_off(self.shown))
        if not tries.again("JetStream does not answer"):
            raise StoreError(self._unavailable("JetStream does not answer"))

    def _api(self, subject: str, request: dict[str, Any]) -> dict[str, Any]:
        """A JetStream API request's answer; a stream not found is no team; JetStream
        unavailable for now is asked again, as in `_ask`."""
        tries = Tries(time.monotonic() + REQUEST_S, f"the NATS server at {self.shown}")
        while True:
            answer = self._ask(f"$JS.API.{subject}", orjson.dumps(request))[0]
            if answer.status is not None:
                self._missing(answer)
            found: dict[str, Any] = orjson.loads(answer.data)
            code = code_of(found)
            if code == _NO_STREAM:
                raise FileNotFoundError(f"no team {self.team!r} at {self.shown}")
            if code in _JETSTREAM_OFF:
                raise StoreError(jetstream_off(self.shown))
            if code not in _JETSTREAM_AWAY:
                return found
            why = str(found["error"].get("description", "JetStream unavailable"))
            if not tries.again(why):
                raise StoreError(self._unavailable(why))

    def _subject(self, key: str) -> str:
        """The subject of log ``key``: an inbox, ``#channel``, ``log:name``, ``ix:key`` or
        ``commits:agent``."""
        if key.startswith("#"):
            return f"{self._prefix}.ch.{token(key[1:])}"
        if key.startswith("log:"):
            return f"{self._prefix}.tl.{token(key[4:])}"
        if key.startswith("ix:"):
            return f"{self._prefix}.ix.{hexed(key[3:])}"
        if key.startswith("commits:"):
            return f"{self._prefix}.ct.{token(key[8:])}"
        return f"{self._prefix}.in.{token(key)}"

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
        why = answer.headers.get("Description", "")
        raise StoreError(f"NATS {self.shown}: {answer.status} {why}")

    def _batch(self, subject: str, seq: int, count: int) -> list[Reply]:
        """Up to ``count`` messages of ``subject`` from stream sequence ``seq``: one
        batched direct get."""
        return self._after(subject, seq, count)[0]

    def _after(self, subject: str, seq: int, count: int) -> tuple[list[Reply], int]:
        """`_batch`, and how many messages of ``subject`` follow those."""
        request = {"seq": max(1, seq), "next_by_subj": subject, "batch": count}
        answers = self._ask(f"$JS.API.DIRECT.GET.{self.stream}", orjson.dumps(request), batch=True)
        return self._ended(answers)

    def _afters(self, asks: list[tuple[str, int, int]]) -> list[tuple[list[Reply], int]]:
        """`_after` of each ``(subject, seq, count)``, at once: one round trip for them
        all (`Wire.many`)."""
        direct = f"$JS.API.DIRECT.GET.{self.stream}"
        requests = [
            (direct, orjson.dumps({"seq": max(1, seq), "next_by_subj": subject, "batch": count}))
            for subject, seq, count in asks
        ]
        if not requests:
            return []
        answers = self._on_wire(lambda wire: wire.many(requests), REQUEST_S)
        return [self._ended(found) for found in answers]

    def _ended(self, answers: list[Reply]) -> tuple[list[Reply], int]:
        """A batched direct get's messages, and how many follow them (its end says)."""
        end = answers.pop()
        if end.status != "204":
            self._missing(end)
            return answers, 0
        return answers, int(end.headers.get("Nats-Num-Pending", 0))

    def _lasts(self, subjects: list[str]) -> dict[str, Reply]:
        """The last message of each of ``subjects`` that has one: one batched direct
        get (``multi_last``), or one each from a server without it (before 2.11)."""
        request = orjson.dumps({"multi_last": subjects, "batch": len(subjects)})
        answers = self._ask(f"$JS.API.DIRECT.GET.{self.stream}", request, batch=True)
        end = answers.pop()
        if end.status in ("204", "404"):
            return {msg.headers.get("Nats-Subject", ""): msg for msg in answers}
        found = ((subject, self._get(subject)) for subject in subjects)
        return {subject: msg for subject, msg in found if msg is not None}

    @staticmethod
    def _offset(msg: Reply) -> int:
        return int(msg.headers["Ralph-Offset"])

    @staticmethod
    def _seq(msg: Reply) -> int:
        return int(msg.headers["Nats-Sequence"])

    def _remember(self, subject: str, offset: int, seq: int) -> None:
        known = self._seqs.setdefault(subject, {})
        known[offset] = seq
        if len(known) > SEQS_KEPT:
            del known[next(iter(known))]

    def _acked_all(self, posts: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
        """Publish each ``(subject, payload, headers)`` with its ack, all in one write
        (`Wire.publish_all`); one the server did not take at once is published again
        alone, as `_acked` does (each has an id: stored once)."""
        try:
            answers: list[Reply | None] = list(
                self._on_wire(lambda wire: wire.publish_all(posts), REQUEST_S)
            )
        except StoreError:
            answers = [None] * len(posts)
        for (subject, payload, headers), answer in zip(posts, answers, strict=True):
            if (answer is None or answer.status is not None
                    or code_of(orjson.loads(answer.data)) is not None):  # fmt: skip
                self._acked(subject, payload, headers)

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
        tries = Tries(time.monotonic() + timeout, f"the NATS server at {self.shown}")
        while True:
            answer = self._ask(subject, payload, headers, timeout=timeout)[0]
            if answer.status is not None:
                self._missing(answer)
                raise StoreError(f"NATS {self.shown}: {answer.status} to a publish")
            ack: dict[str, Any] = orjson.loads(answer.data)
            code, error = code_of(ack), ack.get("error", {})
            if code is None:
                return ack
            if code in _WRONG_LAST:
                return None
            why = str(error.get("description", error))
            if code != _IN_PROCESS:
                raise StoreError(f"NATS {self.shown}: {why}")
            if not tries.again(why):  # (a try before this one is not stored yet: no leader)
                raise StoreError(self._unavailable(why))
