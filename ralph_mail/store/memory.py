"""An in-memory backend: the storage seam's second implementation, inside one process.

It keeps everything `TeamStore` promises in dictionaries guarded by one lock, so the
contract suite (tests/storage/test_store_contract.py) and the bus suite run on it as on files:
proof that nothing above the seam depends on files. Mail lives as long as the process;
use it in tests and for a team of threads. Select it with ``RALPH_BACKEND=memory://NAME``
(or ``backend="memory://NAME"``): every `MessageBus` of the process naming the same
NAME shares one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ralph_mail.errors import StoreError
from ralph_mail.message import format_ts
from ralph_mail.store.base import Compaction, StopEvent, check_key
from ralph_mail.store.records import Records, is_record_log

if TYPE_CHECKING:
    from ralph_mail.store.health import Finding
    from ralph_mail.store.search import Query, SearchIndex

_places: dict[str, MemoryBackend] = {}
_places_lock = threading.Lock()


def memory_backend(name: str) -> MemoryBackend:
    """The in-memory place called ``name`` (made on first use)."""
    with _places_lock:
        place = _places.get(name)
        if place is None:
            place = _places[name] = MemoryBackend(name)
        return place


@dataclass
class _Inbox:
    data: bytearray = field(default_factory=bytearray)
    base: int = 0
    last_ts: str = ""
    version: int = 0
    archive: bytearray = field(default_factory=bytearray)
    archive_start: int = 0


@dataclass
class _Team:
    roster: bytes
    inboxes: dict[str, _Inbox]
    state: dict[str, bytes] = field(default_factory=dict)
    saves: dict[str, int] = field(default_factory=dict)
    rates: dict[str, list[float]] = field(default_factory=dict)


class MemoryBackend:
    """Teams kept in this process's memory (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.changed = threading.Condition()
        self.teams: dict[str, _Team] = {}

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        with self.changed:
            if name in self.teams:
                raise FileExistsError(name)
            self.teams[name] = _Team(roster, {agent: _Inbox() for agent in agents})

    def read_roster(self, name: str) -> bytes:
        with self.changed:
            if name not in self.teams:
                raise FileNotFoundError(name)
            return self.teams[name].roster

    def team_names(self) -> list[str]:
        with self.changed:
            return sorted(self.teams)

    def remove_team(self, name: str) -> None:
        with self.changed:
            del self.teams[name]
            self.changed.notify_all()

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        from ralph_mail.store.health import Finding

        found = f"{len(self.team_names())} teams in this process's memory"
        return [Finding("ok", "team", found)]

    def where(self) -> str:
        return "this process's memory"

    def team_store(self, name: str, *, durable: bool = False) -> MemoryStore:
        return MemoryStore(self, name, durable)


class MemoryStore(Records):
    """One team of a `MemoryBackend`, behind `TeamStore`: the primitives over dictionaries,
    the records (cursors, presence, dead letters, indexes, team logs) `Records`' defaults."""

    def __init__(self, place: MemoryBackend, team: str, durable: bool) -> None:
        self.place = place
        self.team = team
        self.durable = durable
        self._search: SearchIndex | None = None

    def _team(self) -> _Team:
        found = self.place.teams.get(self.team)
        if found is None:
            raise StoreError(f"team {self.team!r} was deleted from memory://{self.place.name}")
        return found

    def _inbox(self, agent: str) -> _Inbox:
        inbox = self._team().inboxes.get(agent)
        if inbox is None:
            raise StoreError(f"no inbox for {agent!r} in team {self.team!r}")
        return inbox

    def roster(self) -> bytes:
        with self.place.changed:
            return self._team().roster

    def update_roster(self, change: Callable[[bytes], bytes]) -> None:
        with self.place.changed:
            team = self._team()
            team.roster = change(team.roster)

    def consumer(self, agent: str) -> int | None:
        return None  # one process: nobody else can consume

    def append(self, agent: str, head: bytes, tail: bytes) -> tuple[str, int]:
        with self.place.changed:
            inbox = self._inbox(agent)
            ts = max(format_ts(time.time_ns() // 1000), inbox.last_ts)
            offset = inbox.base + len(inbox.data)
            inbox.data += head + ts.encode() + tail
            inbox.last_ts = ts
            inbox.version += 1
            self.place.changed.notify_all()
            return ts, offset

    def read_line(self, agent: str, offset: int, length: int) -> bytes | None:
        with self.place.changed:
            inbox = self._inbox(agent)
            if offset < inbox.base:
                start = offset - inbox.archive_start
                if start < 0:
                    return None
                return bytes(inbox.archive[start : start + length])
            start = offset - inbox.base
            return bytes(inbox.data[start : start + length])

    def read_audit(self, agent: str, offset: int) -> tuple[bytes, int]:
        with self.place.changed:
            inbox = self._inbox(agent)
            if offset >= inbox.base:
                return self.read(agent, offset)
            offset = max(offset, inbox.archive_start)
            data = bytes(inbox.archive[offset - inbox.archive_start :])
            return data[: data.rfind(b"\n") + 1], offset

    def search(self, query: Query) -> list[bytes]:
        """Through an FTS5 index in this process's memory (see `ralph_mail.store.search`)."""
        import sqlite3

        from ralph_mail.store.search import SearchIndex

        if self._search is None:
            connect = lambda: sqlite3.connect(":memory:", check_same_thread=False)  # noqa: E731
            self._search = SearchIndex(connect, self.read_audit, lambda: list(self._inboxes_now()))
        found = self._search.search(query)
        lines = (self.read_line(inbox, offset, length) for inbox, offset, length in found)
        return [line for line in lines if line]

    def forget_archived(self, agent: str, offset: int) -> None:
        if self._search is not None:
            self._search.forget_before(agent, offset)

    def _inboxes_now(self) -> list[str]:
        with self.place.changed:
            return [log for log in self._team().inboxes if not is_record_log(log)]

    def purge_archive(self, agent: str, before: str, *, timeout: float = 0.0) -> int:
        from ralph_mail.message import last_ts

        with self.place.changed:
            inbox = self._inbox(agent)
            cut = 0
            for line in bytes(inbox.archive).splitlines(keepends=True):
                stamp = last_ts(line)
                if stamp is not None and stamp >= before:
                    break
                cut += len(line)
            del inbox.archive[:cut]
            inbox.archive_start += cut
            return inbox.archive_start if inbox.archive else inbox.base

    def read(self, agent: str, offset: int, *, skip_collected: bool = False) -> tuple[bytes, int]:
        with self.place.changed:
            inbox = self._inbox(agent)
            if offset < inbox.base:
                if not skip_collected:
                    raise StoreError(f"offset {offset} of {agent!r} was collected")
                offset = inbox.base
            data = bytes(inbox.data[offset - inbox.base :])
            return data[: data.rfind(b"\n") + 1], offset

    def read_tail(self, agent: str, lines: int) -> tuple[list[bytes], int]:
        with self.place.changed:
            inbox = self._inbox(agent)
            parts = bytes(inbox.data).split(b"\n")[:-1]
            return (parts[-lines:] if lines > 0 else []), inbox.base + len(inbox.data)

    def size(self, agent: str) -> int:
        with self.place.changed:
            inbox = self._inbox(agent)
            return inbox.base + len(inbox.data)

    def claim(self, agent: str) -> None:
        self._inbox(agent)  # one process holds the whole place: the claim is its own

    def release(self, agent: str) -> None:
        pass

    def compact(
        self,
        agent: str,
        min_bytes: int = 1,
        *,
        timeout: float = 0.0,
        drop_before: str | None = None,
    ) -> Compaction:
        with self.place.changed:
            inbox = self._inbox(agent)
            floor = self.least_floor(agent)
            cut = floor - inbox.base
            if cut < max(min_bytes, 1):
                return Compaction(agent, 0, len(inbox.data), inbox.base)
            dropped = inbox.data[:cut].count(b"\n")
            if drop_before is not None:
                self.purge_archive(agent, drop_before)
            skip = 0
            if drop_before is not None and not inbox.archive:
                from ralph_mail.store.files.archive import older

                skip = older(bytes(inbox.data[:cut]), drop_before)
            if not inbox.archive:
                inbox.archive_start = inbox.base + skip
            inbox.archive.extend(inbox.data[skip:cut])  # the audit trail keeps what gc drops
            del inbox.data[:cut]
            inbox.base = floor
            return Compaction(agent, cut, len(inbox.data), inbox.base, dropped)

    def collectable(self, agent: str, floor: int) -> int:
        with self.place.changed:
            return floor - self._inbox(agent).base

    def waiter(self, agents: list[str]) -> _Waiter:
        return _Waiter(self, agents)

    def create_log(self, key: str) -> None:
        with self.place.changed:
            inboxes = self._team().inboxes
            if key in inboxes:
                raise FileExistsError(key)
            inboxes[key] = _Inbox()

    def load_state(self, key: str) -> bytes | None:
        check_key(key, "state key")
        with self.place.changed:
            return self._team().state.get(key)

    def save_state(self, key: str, data: bytes) -> None:
        check_key(key, "state key")
        with self.place.changed:
            team = self._team()
            team.state[key] = bytes(data)
            team.saves[key] = team.saves.get(key, 0) + 1

    def update_state(self, key: str, change: Callable[[bytes | None], bytes]) -> None:
        check_key(key, "state key")
        with self.place.changed:
            self.save_state(key, change(self._team().state.get(key)))

    def state_version(self, key: str) -> tuple[int, ...] | None:
        check_key(key, "state key")
        with self.place.changed:
            team = self._team()
            return (team.saves[key],) if key in team.state else None

    def state_where(self, key: str) -> str:
        # Not `Records`' default: the place is named, so nobody looks for it on disk.
        return f"state {check_key(key, 'state key')!r} of memory team {self.team!r}"

    def take(self, key: str, limit: int, window: float) -> float:
        check_key(key, "rate key")
        with self.place.changed:
            times = self._team().rates.setdefault(key, [])
            now = time.time()
            times[:] = [t for t in times if t > now - window][-limit:]
            if len(times) >= limit:
                return times[0] + window - now
            times.append(now)
            return 0.0

    def close(self) -> None:
        if self._search is not None:
            self._search.close()
            self._search = None


class _Waiter:
    """Wakes when one of its inboxes got a line since the last wait (or since made)."""

    def __init__(self, store: MemoryStore, agents: list[str]) -> None:
        self._store = store
        self._agents = agents
        self._seen = self._versions()

    def _versions(self) -> tuple[int, ...]:
        team = self._store.place.teams.get(self._store.team)
        if team is None:
            return ()
        inboxes = team.inboxes
        return tuple(inboxes[key].version if key in inboxes else -1 for key in self._agents)

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        deadline = time.monotonic() + timeout
        with self._store.place.changed:
            while self._versions() == self._seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    return False
                # A stop event cannot notify the condition: look at it every 50 ms.
                self._store.place.changed.wait(min(remaining, 0.05) if stop else remaining)
            self._seen = self._versions()
            return True

    def caught_up(self) -> bool:
        return False

    def close(self) -> None:
        pass


__all__ = ["MemoryBackend", "MemoryStore", "memory_backend"]
