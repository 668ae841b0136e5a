"""The NATS backend: teams on one NATS server, each a stream and a bucket (`NatsStore`),
created, listed, removed and checked here, over nats-py's connection (`push`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from ralph_mail.errors import StoreError
from ralph_mail.store.health import Finding
from ralph_mail.store.nats.names import hexed, prefix_of, stream_of
from ralph_mail.store.nats.team import NatsStore

if TYPE_CHECKING:  # push (nats-py, asyncio) is imported when first needed
    from ralph_mail.store.nats.push import Loop

_T = TypeVar("_T")
#: JetStream's "error creating store for stream": the server has not yet finished removing
#: a stream of the same name (a team deleted and made again at once). It passes.
_STORE_BUSY: Final = 10049
#: How long a stream or bucket is tried again while the server says so (s).
_STORE_BUSY_S: Final = 3.0


async def _made(make: Callable[[], Awaitable[_T]]) -> _T:
    """``make()`` (a stream or a bucket created), tried again while the server is still
    removing one of the same name, for up to `_STORE_BUSY_S`."""
    import asyncio  # here: a one-off command imports neither it nor nats-py

    from nats.js.errors import ServerError

    loop = asyncio.get_running_loop()
    give_up = loop.time() + _STORE_BUSY_S
    while True:
        try:
            return await make()
        except ServerError as exc:
            if exc.err_code != _STORE_BUSY or loop.time() >= give_up:
                raise
        await asyncio.sleep(0.02)


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
            return await _made(lambda: link.js.create_key_value(bucket="RALPH_TEAMS", history=1))

        return link.run(bucket())

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

        link, teams = self._link(), self._teams()
        stream = stream_of(name)

        async def create() -> None:
            try:
                await teams.create(hexed(name), name.encode())
            except KeyWrongLastSequenceError:  # there, or a team deleted a moment ago
                try:
                    await teams.get(hexed(name))
                except NotFoundError:  # deleted (or purged): its name is free again
                    await teams.put(hexed(name), name.encode())
                else:
                    raise FileExistsError(name) from None
            config = StreamConfig(name=stream, subjects=[f"{prefix_of(name)}.>"],
                                  allow_direct=True, storage=StorageType.FILE,
                                  duplicate_window=120.0)  # fmt: skip
            await _made(lambda: link.js.add_stream(config))
            kv = await _made(lambda: link.js.create_key_value(bucket=stream, history=1))
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
        stream = stream_of(name)

        async def remove() -> None:
            for action in (link.js.delete_stream(stream), link.js.delete_key_value(stream)):
                with contextlib.suppress(Exception):  # already gone
                    await action
            await teams.delete(hexed(name))

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
