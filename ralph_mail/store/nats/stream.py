"""The NATS store's round trips to a team's stream, which every side of the store
makes: requests over this thread's `Wire`, JetStream API calls, direct gets of a
subject's messages, publishes with their acks; nats-py's connection, made when first
needed. The store's tunables are here too, in one place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final, TypeVar

import orjson

from ralph_mail.errors import InboxBusy, StoreError
from ralph_mail.store.nats.names import hexed, prefix_of, stream_of, token
from ralph_mail.store.nats.wire import (
    REQUEST_S,
    NeverReached,
    Reply,
    TooBig,
    Wire,
    WireError,
)

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


class TeamStream:
    """One team's stream on a NATS server, asked over the wire (the base of `NatsStore`)."""

    def __init__(self, url: str, team: str, *, durable: bool = False) -> None:
        self.url, self.team, self.durable = url, team, durable
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
