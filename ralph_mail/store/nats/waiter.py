"""A wait for the next line of some of a team's logs on NATS: a pull from an ephemeral
consumer of their subjects, in the waiting thread itself, which stands on the server
and brings each line as it is stored."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import TYPE_CHECKING, Any

from ralph_mail.errors import StoreError
from ralph_mail.store.nats.stream import PULL_BATCH, PULL_IDLE_S, PULL_MAX_S, PULL_STOP_S
from ralph_mail.store.nats.wire import TRY_S, Wire

if TYPE_CHECKING:
    from ralph_mail.store.base import StopEvent
    from ralph_mail.store.nats.logs import Logs
    from ralph_mail.store.nats.wire import Reply


class Waiter:
    """Waits in the caller's own thread: for the next line stored in its subjects, from
    a consumer of its own (memory, no acks), over the thread's `Wire`. Its pull stands
    on the server (`PULL_BATCH` lines, `PULL_MAX_S` at most: `Wire.pulled`) and each
    line is sent as it is stored, so nothing polls, no other thread has to pass the news
    on, and a waiter woken again and again does not ask anew each time; the line pulled
    is kept for the read that follows. A consumer the server forgot (restarted; idle
    past `PULL_IDLE_S`), or whose lines may have gone to a connection that broke, is
    made again, and the wait returns for a read of what came meanwhile. On a cluster
    the consumer lives on one server: one killed takes it along, and the pull is
    answered by no one, so its end is awaited a little past `PULL_MAX_S`; then the
    consumer is made again, from the stream sequence after the last line pulled. A
    wait in another thread than the last, while the last one's pull stands, makes it
    again too (that pull would take lines that thread no longer reads), and returns
    for a read."""

    def __init__(self, store: Logs, subjects: list[str]) -> None:
        self._store, self._subjects = store, subjects
        self._last = 0  # the last stream sequence pulled
        self._name = ""
        # The connection its pull stands on, and its consumer's name: the pull is
        # forgotten there when the waiter is closed, or dropped without a close (the
        # connection is its thread's, and outlives it).
        self._standing: list[tuple[Wire, str]] = []
        weakref.finalize(self, _forget, self._standing)
        self._make()

    def _make(self) -> None:
        self._forget()
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
            raise StoreError(f"NATS {self._store.shown}: {made['error'].get('description')}")
        self._name = str(made["name"])

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= deadline or (stop is not None and stop.is_set()):
                return False
            until = min(deadline, now + PULL_STOP_S) if stop is not None else deadline
            if self._moved():  # (that pull would take lines this thread never sees)
                self.close()
                with contextlib.suppress(StoreError):
                    self._make()
                return True  # (a read of what came meanwhile)
            try:
                if not self._name:  # (a server that did not answer the last making)
                    self._make()
                got = self._store._on_wire(functools.partial(self._next, until=until), PULL_MAX_S)
            except StoreError:
                self._forget()
                self._name = ""  # (made again below, once the server answers)
            else:
                if got is None and not self._overdue():
                    continue  # (nothing yet: its stop looked at, it waits on)
                if got is not None and got[0].status is None:
                    seq, pending = self._store._pulled(*got)
                    self._last = max(self._last, seq)
                    if seq > self._store.read_to(got[0].subject):
                        return True
                    if pending:  # lines read already, more of them queued: skip them all
                        self._catch_up()
                    continue  # (a line the store read before this pull: no news)
                if got is not None and got[0].status == "408":
                    continue  # the pull expired with nothing: pull again
            with contextlib.suppress(StoreError):  # gone (or the server away): again
                self._make()
            return True

    def _next(self, wire: Wire, until: float) -> tuple[Reply, int] | None:
        """The next line (or end) of the pull, by ``until``; its end awaited 2 `TRY_S`
        at most past when it is due."""
        self._standing[:] = [(wire, self._name)]
        due = wire.pulling(self._name) or time.monotonic() + PULL_MAX_S
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self._store.stream}.{self._name}"
        return wire.pulled(subject, self._name, PULL_BATCH, PULL_MAX_S,
                           min(until, due + 2 * TRY_S))  # fmt: skip

    def _due(self) -> tuple[Wire, float] | None:
        """The connection its pull stands on, and when the pull ends; None: none stands."""
        for wire, name in self._standing:
            due = wire.pulling(name)
            if due is not None:
                return wire, due
        return None

    def _overdue(self) -> bool:
        """Its pull's end did not come in time: its consumer's server is gone."""
        standing = self._due()
        return standing is not None and time.monotonic() >= standing[1] + 2 * TRY_S

    def _moved(self) -> bool:
        """Waiting in another thread than the last while that one's pull stands."""
        standing = self._due()
        return standing is not None and standing[0] is not Wire.for_thread(self._store.url)

    def _forget(self) -> None:
        _forget(self._standing)

    def caught_up(self) -> bool:
        """True when its consumer stands where the waiting thread stopped reading (the
        last line this thread read of its one subject is the last it pulled): a pull
        then brings at once whatever came after it."""
        return bool(
            self._name
            and len(self._subjects) == 1
            and self._last
            and self._last == self._store.read_to(self._subjects[0])
        )

    def _catch_up(self) -> None:
        """Start the consumer again after the lines its store read without it (lines
        that came while nobody waited are read, not pulled, so it fell behind): from the
        first line after those read in all its subjects, so it skips no line unread."""
        read = min(self._store.read_to(subject) for subject in self._subjects)
        if read > self._last:
            self.close()
            self._last = read
            with contextlib.suppress(StoreError):  # (made again by the next pull)
                self._make()

    def close(self) -> None:
        if self._name:
            self._forget()
            stream, name, self._name = self._store.stream, self._name, ""
            with contextlib.suppress(StoreError):  # else it lapses after PULL_IDLE_S
                self._store._ask(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", timeout=2.0)


def _forget(standing: list[tuple[Wire, str]]) -> None:
    """Drop a waiter's standing pull where it stands (see `Wire.forget`)."""
    for wire, name in standing:
        wire.forget(name)
    standing.clear()
