"""What nats-py carries for the NATS store (`ralph_mail.store.nats`): one asyncio
connection per process and server, on a loop thread of its own, for what the server
pushes (a waiter's `Feed` of lines, the bucket's `Keys`) and for the streams' and
buckets' administration. The store's own round trips go over `natswire` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

from ralph_mail.errors import StoreError
from ralph_mail.store.natswire import REQUEST_S

_T = TypeVar("_T")

#: Lines a feed keeps for reads at most, and bytes (see `Feed`).
FEED_LINES: Final = 2000
FEED_BYTES: Final = 1 << 20


class Loop:
    """One asyncio loop thread and one connection to a server, per process and URL."""

    _made: Final[dict[tuple[int, str], Loop]] = {}
    _lock: Final = threading.Lock()

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        import nats

        self.url = url
        where = urlsplit(url)  # a quick look first: nats-py retries a dead server forever
        socket.create_connection((where.hostname or "127.0.0.1", where.port or 4222), 3).close()
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="ralph-nats", daemon=True)
        thread.start()

        async def quiet(_: Exception) -> None:
            """Connection trouble surfaces in the call that meets it, not as log noise."""

        async def reconnected() -> None:
            for feed in list(self.feeds):  # a restarted server lost their consumers
                self._restarts.add(restart := asyncio.ensure_future(feed.restart()))
                restart.add_done_callback(self._restarts.discard)

        self.feeds: set[Pushed] = set()  # the process's consumers on this connection
        self._restarts: set[asyncio.Future[None]] = set()
        connecting = nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                  connect_timeout=5, error_cb=quiet,
                                  reconnected_cb=reconnected)  # fmt: skip
        self.nc: Any = self.run(connecting)
        self.js: Any = self.nc.jetstream(timeout=REQUEST_S)

    @classmethod
    def of(cls, url: str) -> Loop:
        with cls._lock:
            made = cls._made.get((os.getpid(), url))
            if made is None:
                try:
                    made = cls._made[os.getpid(), url] = cls(url)
                except Exception as exc:  # no server there
                    why = str(exc) or exc.__class__.__name__
                    raise StoreError(
                        f"cannot reach the NATS server at {url} ({why}): start it "
                        "(nats-server -js) or check RALPH_BACKEND"
                    ) from None
            return made

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float = REQUEST_S) -> _T:
        """Run ``coro`` on the loop's thread and wait for it (the bucket's and streams'
        administration, the pushes' set-up): a task and one lock, a fifth cheaper than
        ``run_coroutine_threadsafe``'s futures."""
        done, made = threading.Lock(), []
        done.acquire()

        def start() -> None:
            task = self.loop.create_task(coro)
            made.append(task)
            task.add_done_callback(lambda _: done.release())

        self.loop.call_soon_threadsafe(start)
        if not done.acquire(timeout=timeout):
            self.loop.call_soon_threadsafe(lambda: made and made[0].cancel())
            raise TimeoutError(f"no answer within {timeout:g} s")
        result: _T = made[0].result()
        return result


class Pushed:
    """An ephemeral consumer of ours (memory, no acks) pushing to a subscription of
    ours; started again after a reconnect (a restarted server forgot it)."""

    def __init__(self, link: Loop, stream: str) -> None:
        self._link, self._stream = link, stream
        self._last_seq = 0  # the last stream sequence delivered
        self._sub: Any = None
        self._consumer = ""

    def _config(self) -> Any:
        """The consumer's filter and where it starts (`_last_seq`: restarted)."""
        raise NotImplementedError

    async def _take(self, msg: Any) -> None:
        raise NotImplementedError

    async def start(self) -> Any:
        from nats.js.api import AckPolicy

        deliver = self._link.nc.new_inbox()
        self._sub = await self._link.nc.subscribe(deliver, cb=self._take)  # first
        config = self._config()
        config.deliver_subject, config.ack_policy = deliver, AckPolicy.NONE
        config.mem_storage, config.num_replicas, config.inactive_threshold = True, 1, 60.0
        info = await self._link.js.add_consumer(self._stream, config=config)
        self._consumer = info.name
        self._link.feeds.add(self)
        return info

    async def stop(self) -> None:
        self._link.feeds.discard(self)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a server gone: its consumers went too
                await sub.unsubscribe()
                await self._link.js.delete_consumer(self._stream, self._consumer)

    async def restart(self) -> None:
        """Start again after a reconnect, trying while JetStream recovers."""
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        for _ in range(100):
            if self not in self._link.feeds:
                return
            try:
                await self.start()
                break
            except Exception:
                await asyncio.sleep(0.2)
        self.restarted()

    def restarted(self) -> None:
        """Called once started again."""


class Feed(Pushed):
    """The lines of one subject, pushed by the server as it stores them.

    It wakes the waiters watching the subject, and keeps the last lines it was given (up
    to `FEED_LINES` and `FEED_BYTES`) by offset, each with the offset of the next line:
    a read from an offset it holds is served here, without a round trip. Each line kept
    is a fact about the stream (what starts at that offset), so deliveries that repeat,
    skip or restart (a reconnect) cannot make a read wrong, only send it to the server.
    It is fed on the loop's thread and read on the caller's (a hop saved), under a lock.
    """

    def __init__(self, link: Loop, stream: str, subject: str) -> None:
        super().__init__(link, stream)
        self.subject = subject
        self.events: set[threading.Event] = set()
        self.lines: dict[int, tuple[bytes, int, int]] = {}  # offset -> line, seq, next
        self._bytes = 0
        self._lock = threading.Lock()

    def _config(self) -> Any:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        if self._last_seq:  # from where the last one stopped
            return ConsumerConfig(filter_subject=self.subject, opt_start_seq=self._last_seq + 1,
                                  deliver_policy=DeliverPolicy.BY_START_SEQUENCE)  # fmt: skip
        return ConsumerConfig(filter_subject=self.subject, deliver_policy=DeliverPolicy.NEW)

    def restarted(self) -> None:
        self.wake()  # to read what came meanwhile

    async def _take(self, msg: Any) -> None:
        data, offset = msg.data or b"", int(msg.headers["Ralph-Offset"])
        seq = msg.metadata.sequence.stream
        self._last_seq = max(self._last_seq, seq)
        with self._lock:
            if offset not in self.lines:
                self.lines[offset] = (data, seq, offset + len(data) + 1)
                self._bytes += len(data)
                while len(self.lines) > FEED_LINES or self._bytes > FEED_BYTES:
                    self._bytes -= len(self.lines.pop(next(iter(self.lines)))[0])
        self.wake()

    def wake(self) -> None:
        for event in self.events:
            event.set()

    def read(self, offset: int, count: int) -> tuple[list[bytes], int, int] | None:
        """The lines held from ``offset`` on (at most ``count``), the offset after them
        and the stream sequence of the last; None when it holds no line there."""
        lines: list[bytes] = []
        at, seq = offset, 0
        with self._lock:
            while at in self.lines and len(lines) < count:
                line, seq, at = self.lines[at]
                lines.append(line)
        return (lines, at, seq) if lines else None

    def forget(self) -> None:
        with self._lock:
            self.lines.clear()
            self._bytes = 0


class Keys(Pushed):
    """The values of the bucket's watched keys (presence, claims, state, an inbox's
    start), pushed by the server as they change: the last of each first, then every
    change. Cursors and rates, written at every read and contact, are not watched."""

    WATCHED: Final = ("presence", "claim", "state", "base")

    def __init__(self, link: Loop, bucket: str) -> None:
        super().__init__(link, f"KV_{bucket}")
        self._prefix = f"$KV.{bucket}."
        self.values: dict[str, tuple[bytes, int] | None] = {}
        self.ready = threading.Event()

    def _config(self) -> Any:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        watched = [f"{self._prefix}{kind}.>" for kind in self.WATCHED]
        return ConsumerConfig(filter_subjects=watched,
                              deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)  # fmt: skip

    async def start(self) -> Any:
        info = await super().start()
        if not info.num_pending:
            self.ready.set()
        return info

    async def _take(self, msg: Any) -> None:
        key, meta = msg.subject[len(self._prefix) :], msg.metadata
        operation = msg.headers.get("KV-Operation") if msg.headers else None
        known = self.values.get(key)
        if known is None or known[1] < meta.sequence.stream:  # not older than my own write
            gone = operation in ("DEL", "PURGE")
            self.values[key] = None if gone else (bytes(msg.data or b""), meta.sequence.stream)
        if not meta.num_pending:
            self.ready.set()
