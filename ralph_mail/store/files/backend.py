"""The file backend: `FileBackend` (a home of teams) and `FileStore` (one team's files).

`FileStore` is put together from parts, each in its module: team.py (the directories and
kept descriptors), logs.py (inboxes, channels, team logs, cursors, search), records.py
(presence, state, rates, indexes, dead letters), commits.py (when cursors moved),
claims.py (the one consumer of an inbox) and maintenance.py (gc); below them, the inbox
log in inbox.py, the slot file in slots.py, the layout in layout.py and the POSIX
helpers in posix.py.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_mail.store.files.commits import Commits
from ralph_mail.store.files.layout import (
    create_team_files,
    read_roster,
    remove_team_files,
    team_names,
)
from ralph_mail.store.files.maintenance import Maintenance
from ralph_mail.store.files.posix import store_error
from ralph_mail.store.files.records import Records

if TYPE_CHECKING:
    from ralph_mail.store.health import Finding


class FileStore(Maintenance, Records, Commits):
    """The files of one team (see layout.py for where each lives): a `TeamStore`.

    Keeps descriptors open between calls (that is what makes a send cost microseconds);
    call `close` when done. Descriptors inherited through ``fork`` are never reused: a
    child shares the parent's open file description, and with it the parent's flock.

    Example:
        >>> store = FileBackend(Path("/tmp/mail")).team_store("demo")   # doctest: +SKIP
        >>> store.size("lead")                                           # doctest: +SKIP
        0
    """


class FileBackend:
    """Teams as directories under a home (``$RALPH_HOME/teams``).

    Example:
        >>> backend = FileBackend(Path("/tmp/mail"))   # doctest: +SKIP
        >>> backend.team_names()                        # doctest: +SKIP
        ['demo']
    """

    def __init__(self, home: Path) -> None:
        self.home = home

    def doctor(self, team: str | None, lock_wait: float) -> list[Finding]:
        """File system, inotify, permissions, inboxes, cursors, dead letters, locks and
        leftovers of killed processes (`ralph_mail.store.files.doctor`)."""
        from ralph_mail.store.files import doctor

        return doctor.check(self.home, team, lock_wait)

    def where(self) -> str:
        return str(self.home)

    def create_team(self, name: str, agents: list[str], roster: bytes) -> None:
        try:
            create_team_files(self.home, name, agents, roster)
        except FileExistsError:
            raise
        except OSError as exc:
            raise store_error(exc, f"team {name!r} in {self.home}", "create") from None

    def read_roster(self, name: str) -> bytes:
        try:
            return read_roster(self.home, name)
        except FileNotFoundError:
            raise
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise FileNotFoundError(name) from None
            raise store_error(exc, f"team {name!r} in {self.home}", "read") from None

    def team_names(self) -> list[str]:
        return team_names(self.home)

    def remove_team(self, name: str) -> None:
        try:
            remove_team_files(self.home, name)
        except OSError as exc:
            raise store_error(exc, f"team {name!r} in {self.home}", "delete") from None

    def team_store(self, name: str, *, durable: bool = False) -> FileStore:
        return FileStore(self.home, name, durable=durable)
