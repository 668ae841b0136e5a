"""A wait for the next line of some of a team's logs on NATS: a pull from an ephemeral
consumer of their subjects, in the waiting thread itself, which the server holds until a
line is stored."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import orjson

from ralph_mail.errors import StoreError
from ralph_mail.store.nats.stream import PULL_IDLE_S, PULL_MAX_S, PULL_STOP_S
from ralph_mail.store.nats.wire import TRY_S

if TYPE_CHECKING:
    from ralph_mail.store.base import StopEvent
    from ralph_mail.store.nats.logs import Logs


class Waiter:
    """Waits in the caller's own thread: a pull of the next line stored in its subjects,
    from a consumer of its own (memory, no acks), over the thread's `Wire`. The server
    holds the pull until a line is stored or the wait is over, so nothing polls and no
    other thread has to pass the news on; the line pulled is kept for the read that
    follows. A consumer the server forgot (restarted; idle past `PULL_IDLE_S`) is made
    again, and the wait returns for a read of what came meanwhile. On a cluster the
    consumer lives on one server: one killed takes it along, and the pull is answered by
    no one (no responders, or nothing), so a pull lasts `PULL_MAX_S` at most and its
    answer is awaited a little longer; then the consumer is made again, from the
    stream sequence after the last line pulled."""

    def __init__(self, store: Logs, subjects: list[str]) -> None:
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
            raise StoreError(f"NATS {self._store.shown}: {made['error'].get('description')}")
        self._name = str(made["name"])

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            step = max(0.001, min(left, PULL_STOP_S if stop is not None else PULL_MAX_S))
            pull = orjson.dumps({"batch": 1, "expires": int(step * 1e9)})
            try:
                if not self._name:  # (a server that did not answer the last making)
                    self._make()
                got = self._store._ask(f"$JS.API.CONSUMER.MSG.NEXT.{self._store.stream}."
                                       f"{self._name}", pull, timeout=step + 2 * TRY_S,
                                       pull=True)[0]  # fmt: skip
            except StoreError:
                self._name = ""  # (made again below, once the server answers)
                got = None
            if got is not None and got.status is None:
                seq, pending = self._store._pulled(got)
                self._last = max(self._last, seq)
                if seq > self._store.read_to(got.subject):
                    return True
                if pending:  # lines read already, more of them queued: skip them all
                    self._catch_up()
                continue  # (a line the store read before this pull: no news)
            if got is not None and got.status == "408":
                continue  # the pull expired with nothing: pull again
            with contextlib.suppress(StoreError):  # gone (or the server away): again
                self._make()
            return True

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
            stream, name, self._name = self._store.stream, self._name, ""
            with contextlib.suppress(StoreError):  # else it lapses after PULL_IDLE_S
                self._store._ask(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", timeout=2.0)
