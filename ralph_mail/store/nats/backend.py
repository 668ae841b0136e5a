"""The NATS backend: teams on a NATS server (or a cluster's, each team kept by
``RALPH_NATS_REPLICAS`` of them), each a stream and a bucket (`NatsStore`), created,
listed, removed and checked here, over nats-py's connection (`push`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from ralph_mail.errors import MailError, PermissionDenied, StoreError
from ralph_mail.store.health import Finding
from ralph_mail.store.nats.auth import login, write_authorization
from ralph_mail.store.nats.doctor import team_findings
from ralph_mail.store.nats.names import hexed, prefix_of, stream_of
from ralph_mail.store.nats.stream import TeamStream, replicas
from ralph_mail.store.nats.team import NatsStore
from ralph_mail.store.nats.urls import addresses, redacted

if TYPE_CHECKING:  # push (nats-py, asyncio) is imported when first needed
    from ralph_mail.store.nats.push import Loop

_T = TypeVar("_T")
#: JetStream's "error creating store for stream": the server has not yet finished removing
#: a stream of the same name (a team deleted and made again at once). It passes.
_STORE_BUSY: Final = 10049
#: How long a stream or bucket is tried again while the server says so (s).
_STORE_BUSY_S: Final = 3.0
#: How long a write into a stream or bucket just made is tried again while no server
#: answers for it (s): in a cluster, its leader is being elected (under load, seconds).
_NO_LEADER_S: Final = 15.0


async def _made(make: Callable[[], Awaitable[_T]]) -> _T:
    """``make()`` (a stream or a bucket created, or a first write into one), tried again
    while the server is still removing one of the same name, for up to `_STORE_BUSY_S`,
    and while nothing answers for it (a stream that has no leader yet: the write was
    not stored), for up to `_NO_LEADER_S`."""
    import asyncio  # here: a one-off command imports neither it nor nats-py

    from nats.js.errors import NoStreamResponseError, ServerError

    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        try:
            return await make()
        except ServerError as exc:
            if exc.err_code != _STORE_BUSY or loop.time() >= start + _STORE_BUSY_S:
                raise
        except NoStreamResponseError:
            if loop.time() >= start + _NO_LEADER_S:
                raise
        await asyncio.sleep(0.02)


class NatsBackend:
    """Teams on one NATS server: a stream and a bucket each, listed in ``RALPH_TEAMS``.
    The creation and removal of teams go through nats-py (`push`), the rest over the
    store's own connection (`wire`), which says what a failure means in one line."""

    def __init__(self, url: str, home: Path | None = None) -> None:
        try:
            where = addresses(url)[0]  # (a cluster's servers: the first one's login)
        except ValueError as exc:
            raise MailError(f"{exc}; set it with --backend or RALPH_BACKEND") from None
        login(where.user, where.password)  # a credentials file named, but not there: now
        self.url, self.home = url, home  # home: where a team's index is kept (`index`)
        self._server = TeamStream(url, "")  # the server's API, for no team in particular

    def _link(self) -> Loop:
        from ralph_mail.store.nats.push import Loop

        self._server._api("INFO", {})  # first a round trip that says what is wrong
        return Loop.of(self.url)

    def _admin(self, work: Callable[[Loop], Coroutine[Any, Any, _T]]) -> _T:
        """``work`` done through nats-py, what it raises in one line."""
        link = self._link()
        try:
            return link.run(work(link))
        except (MailError, FileExistsError, FileNotFoundError):
            raise
        except Exception as exc:
            why = str(exc) or exc.__class__.__name__
            if link.refused:  # (the request went unanswered: the server dropped it)
                why, link.refused = link.refused, ""
                raise PermissionDenied(
                    f"NATS {redacted(self.url)}: {why}: this user's permissions on the server "
                    "(written by 'ralph-mail nats config') do not allow it: the lead's do"
                ) from None
            raise StoreError(f"NATS {redacted(self.url)}: {why}") from None

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

        stream, copies = stream_of(name), replicas()

        async def create(link: Loop) -> None:
            teams = await _teams(link, copies)
            try:
                await _made(lambda: teams.create(hexed(name), name.encode()))
            except KeyWrongLastSequenceError:  # there, or a team deleted a moment ago
                try:
                    await teams.get(hexed(name))
                except NotFoundError:  # deleted (or purged): its name is free again
                    await _made(lambda: teams.put(hexed(name), name.encode()))
                else:
                    raise FileExistsError(name) from None
            config = StreamConfig(name=stream, subjects=[f"{prefix_of(name)}.>"],
                                  allow_direct=True, storage=StorageType.FILE,
                                  duplicate_window=120.0, num_replicas=copies)  # fmt: skip
            await _made(lambda: link.js.add_stream(config))
            kv = await _made(lambda: link.js.create_key_value(bucket=stream, history=1,
                                                              replicas=copies))  # fmt: skip
            await _made(lambda: kv.put("roster", roster))

        self._admin(create)

    def read_roster(self, name: str) -> bytes:
        store = NatsStore(self.url, name)
        raw = store._kv_get("roster")
        if raw is None:
            raise FileNotFoundError(name)
        return raw

    def team_names(self) -> list[str]:
        """The teams whose streams the server has (the list of streams is exact; the
        bucket of names only keeps two creators of one name apart)."""
        found: list[str] = []
        offset = 0
        while True:
            page = self._server._api("STREAM.NAMES", {"offset": offset})
            names = [str(name) for name in page.get("streams") or []]
            for stream in names:
                if stream.startswith("RALPH_") and stream != "RALPH_TEAMS":
                    with contextlib.suppress(ValueError):
                        found.append(bytes.fromhex(stream[len("RALPH_") :]).decode())
            offset += len(names)
            if not names or offset >= int(page.get("total", 0)):
                return sorted(found)

    def remove_team(self, name: str) -> None:
        stream = stream_of(name)

        async def remove(link: Loop) -> None:
            teams = await _teams(link)
            for name_of in (stream, f"KV_{stream}"):
                # Emptied first: a file stream deleted and made again at once can come
                # back with its old messages (nats-server 2.15), an empty one cannot.
                for action in (link.js.purge_stream, link.js.delete_stream):
                    with contextlib.suppress(Exception):  # already gone
                        await action(name_of)
            await teams.delete(hexed(name))

        self._admin(remove)

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        """The server answers, JetStream is on, each team's stream keeps its messages."""
        return [Finding(level, "server", text) for level, text in self.health(team)]  # type: ignore[arg-type]

    def where(self) -> str:
        return redacted(self.url)

    def health(self, team: str | None = None) -> list[tuple[str, str]]:
        """``(level, message)`` findings for ``ralph-mail doctor``: the server answers,
        JetStream is on, each team's (or ``team``'s) stream keeps its messages on disk,
        and what the store reads of it is whole (`doctor`)."""
        shown = redacted(self.url)
        try:
            account = self._server._api("INFO", {})
            names = self.team_names()
        except (MailError, FileNotFoundError) as exc:
            return [("fail", str(exc))]
        found = [("ok", f"{shown}: JetStream on, {account.get('streams', 0)} streams, "
                  f"{int(account.get('storage', 0)):,} bytes stored")]  # fmt: skip
        for name in names if team is None else [team]:
            store = NatsStore(self.url, name)
            try:
                info = store._api(f"STREAM.INFO.{store.stream}", {})
            except (MailError, FileNotFoundError) as exc:
                found.append(("fail", f"team {name!r}: its stream {store.stream} is missing "
                              f"({exc}): delete the team and create it again"))  # fmt: skip
                continue
            config, state = info.get("config", {}), info.get("state", {})
            storage = str(config.get("storage", "file"))
            level = "ok" if storage == "file" else "warn"
            found.append((level, f"team {name!r}: stream {store.stream}, {storage} storage, "
                          f"{config.get('num_replicas') or 1} replica(s), "
                          f"{int(state.get('messages', 0)):,} messages"))  # fmt: skip
            try:
                found += team_findings(store)
            except (MailError, FileNotFoundError) as exc:
                found.append(("fail", f"team {name!r}: {exc}"))
        return found

    def write_authorization(
        self,
        team: str,
        lead: str,
        reach: dict[str, set[str]],
        cursors: dict[str, list[str]],
        out: Path | None = None,
    ) -> tuple[Path, dict[str, Path]]:
        """The server's ``authorization`` block for ``team`` and its agents' credentials,
        written (`auth.write_authorization`); where."""
        if self.home is None:
            raise MailError("no home to write the agents' credentials in: pass --home")
        return write_authorization(self.home, team, lead, reach, cursors, out)

    def team_store(self, name: str, *, durable: bool = False) -> NatsStore:
        return NatsStore(self.url, name, durable=durable, home=self.home)


async def _teams(link: Loop, copies: int = 1) -> Any:
    """The bucket of team names: as it is when it is there (made with other replicas
    than a team made now may have), else made with ``copies`` replicas."""
    from nats.js.errors import BucketNotFoundError

    try:
        return await link.js.key_value("RALPH_TEAMS")
    except BucketNotFoundError:
        return await _made(lambda: link.js.create_key_value(bucket="RALPH_TEAMS", history=1,
                                                            replicas=copies))  # fmt: skip


__all__ = ["NatsBackend", "NatsStore"]
