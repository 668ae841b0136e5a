"""What nats-py carries for the NATS store (`ralph_mail.store.nats`): one asyncio
connection per process and server, on a loop thread of its own, for what the server
pushes (the bucket's `Keys`, watched) and for the creation and removal of teams. The
store's own round trips, waits included, go over `wire` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

from ralph_mail.errors import MailError, StoreError
from ralph_mail.store.nats.wire import REQUEST_S

_T = TypeVar("_T")


class Loop:
    """One asyncio loop thread and one connection to a server, per process and URL."""

    _made: Final[dict[tuple[int, str], Loop]] = {}
    _lock: Final = threading.Lock()

    def __init__(self, url: str) -> None:
        import nats

        from ralph_mail.store.nats.auth import login
        from ralph_mail.store.nats.urls import addresses, servers

        self.url, wheres = url, addresses(url)
        user, password = login(wheres[0].user, wheres[0].password)  # (or RALPH_NATS_CREDS's)
        logged = {"user": user, "password": password} if password is not None else {}
        self._look(wheres)  # a quick look first: nats-py retries a dead server forever
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, name="ralph-nats", daemon=True)
        thread.start()

        async def quiet(exc: Exception) -> None:
            """Connection trouble surfaces in the call that meets it, not as log noise;
            a publish the server refused (this user's permissions) is kept for it."""
            if "permissions violation" in str(exc).lower():
                self.refused = str(exc)

        async def reconnected() -> None:
            for keys in list(self.pushed):  # a restarted server lost their consumers
                self._restarts.add(restart := asyncio.ensure_future(keys.restart()))
                restart.add_done_callback(self._restarts.discard)

        self.refused = ""  # the last publish the server refused (see `quiet`)
        self.pushed: set[Keys] = set()  # the process's watches on this connection
        self._restarts: set[asyncio.Future[None]] = set()
        connecting = nats.connect(servers=servers(url), dont_randomize=True,  # (as the wire)
                                  max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                  connect_timeout=5, error_cb=quiet,
                                  reconnected_cb=reconnected, **logged)  # fmt: skip
        self.nc: Any = self.run(connecting)
        self.js: Any = self.nc.jetstream(timeout=REQUEST_S)

    @staticmethod
    def _look(wheres: list[Any]) -> None:
        """Return when one of the servers (a cluster's) accepts a connection; raise
        what the last one said when none does."""
        for at, where in enumerate(wheres):
            try:
                socket.create_connection((where.host, where.port), 3).close()
                return
            except OSError:
                if at == len(wheres) - 1:
                    raise

    @classmethod
    def of(cls, url: str) -> Loop:
        with cls._lock:
            made = cls._made.get((os.getpid(), url))
            if made is None:
                try:
                    made = cls._made[os.getpid(), url] = cls(url)
                except MailError:
                    raise  # (a credentials file that is not there: said as it is)
                except Exception as exc:  # no server there
                    why = str(exc) or exc.__class__.__name__
                    from ralph_mail.store.nats.urls import redacted

                    raise StoreError(
                        f"cannot reach the NATS server at {redacted(url)} ({why}): start it "
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


class Keys:
    """The values of a bucket's watched keys (presence, claims, state, an inbox's
    start), pushed by the server as they change: the last of each first, then every
    change. Cursors and rates, written at every read and contact, are not watched. An
    ephemeral consumer of ours (memory, no acks) pushing to a subscription of ours;
    started again after a reconnect (a restarted server forgot it), which delivers the
    last of each again. On a cluster the consumer lives on one server, which can die
    while this connection, to another, lives on: the server sends a heartbeat every
    `HEARTBEAT_S` when it has nothing else to send, and a watch that heard nothing for
    three of them is started again."""

    WATCHED: Final = ("presence", "claim", "state", "base")
    HEARTBEAT_S: Final = 2.0

    def __init__(self, link: Loop, bucket: str) -> None:
        self._link, self._stream = link, f"KV_{bucket}"
        self._prefix = f"$KV.{bucket}."
        self._sub: Any = None
        self._consumer = ""
        self.values: dict[str, tuple[bytes, int] | None] = {}
        self.ready = threading.Event()
        self._heard = 0.0  # when the server last sent something (the loop's time)
        self._guard: asyncio.Future[None] | None = None

    async def start(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        deliver = self._link.nc.new_inbox()
        self._sub = await self._link.nc.subscribe(deliver, cb=self._take)  # first
        watched = [f"{self._prefix}{kind}.>" for kind in self.WATCHED]
        config = ConsumerConfig(deliver_subject=deliver, filter_subjects=watched,
                                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
                                inactive_threshold=60.0,
                                idle_heartbeat=self.HEARTBEAT_S)  # fmt: skip
        info = await self._link.js.add_consumer(self._stream, config=config)
        self._consumer = info.name
        self._link.pushed.add(self)
        self._heard = asyncio.get_running_loop().time()
        if self._guard is None:
            self._guard = asyncio.ensure_future(self._watch_the_watch())
        if not info.num_pending:
            self.ready.set()

    async def _watch_the_watch(self) -> None:
        """Start the watch again when the server went silent (see the class docstring)."""
        loop = asyncio.get_running_loop()
        while self in self._link.pushed:
            await asyncio.sleep(self.HEARTBEAT_S)
            if loop.time() - self._heard > 3 * self.HEARTBEAT_S and self._sub is not None:
                await self.restart()
        self._guard = None

    async def stop(self) -> None:
        self._link.pushed.discard(self)
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
            if self not in self._link.pushed:
                return
            try:
                await self.start()
                return
            except Exception:
                await asyncio.sleep(0.2)

    async def _take(self, msg: Any) -> None:
        self._heard = asyncio.get_running_loop().time()
        if msg.headers and msg.headers.get("Status") == "100":
            return  # a heartbeat
        key, meta = msg.subject[len(self._prefix) :], msg.metadata
        operation = msg.headers.get("KV-Operation") if msg.headers else None
        known = self.values.get(key)
        if known is None or known[1] < meta.sequence.stream:  # not older than my own write
            gone = operation in ("DEL", "PURGE")
            self.values[key] = None if gone else (bytes(msg.data or b""), meta.sequence.stream)
        if not meta.num_pending:
            self.ready.set()
