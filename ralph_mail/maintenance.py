"""Keeping a mailbox home healthy: `doctor` checks it, `collect` (gc) compacts inboxes.

`doctor` looks at what the delivery guarantees rest on (a local file system with working
``flock`` and inotify, private permissions) and at what a fault leaves behind (torn tails,
dead letters, stuck locks, temp files of a killed gc). `collect` drops the messages each
owner has consumed from the front of its inbox, under a team-wide lock so that two runs
never overlap.

Example:
    >>> report = doctor(home="/tmp/mail")                   # doctest: +SKIP
    >>> report.healthy, [f.message for f in report.problems]  # doctest: +SKIP
    (True, [])
    >>> [c.removed for c in collect("demo").compactions]   # doctest: +SKIP
    [5120, 0, 0]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ralph_mail import settings
from ralph_mail.store import Compaction, backend
from ralph_mail.store.health import Finding
from ralph_mail.team import load_team

__all__ = ["Collection", "Finding", "Report", "collect", "doctor"]


@dataclass(frozen=True, slots=True)
class Report:
    """What `doctor` found.

    Attributes:
        home: the home that was checked.
        findings: every finding, in the order the checks ran.
        where: what was checked, as the verdict names it (the home, or a server's URL).
    """

    home: Path
    findings: tuple[Finding, ...]
    where: str = ""

    @property
    def problems(self) -> list[Finding]:
        """The findings that are not ok."""
        return [f for f in self.findings if f.level != "ok"]

    def healthy(self, strict: bool = False) -> bool:
        """No failure (and, when ``strict``, no warning either)."""
        bad = {"fail", "warn"} if strict else {"fail"}
        return not any(f.level in bad for f in self.findings)


@dataclass(frozen=True, slots=True)
class Collection:
    """What one `collect` run did to a team.

    Attributes:
        team: the team's name.
        compactions: one per member's inbox, in roster order.
        removed_temp: temp files of killed gc runs or cursor rewrites that were deleted.
    """

    team: str
    compactions: tuple[Compaction, ...]
    removed_temp: tuple[Path, ...]

    @property
    def removed(self) -> int:
        """Bytes dropped over all inboxes."""
        return sum(c.removed for c in self.compactions)


def collect(
    team: str,
    home: str | os.PathLike[str] | None = None,
    *,
    timeout: float = settings.MAINTENANCE_LOCK_TIMEOUT_S,
    min_bytes: int = 1,
    drop_before: str | None = None,
) -> Collection:
    """Drop the consumed messages from the front of every inbox and channel of ``team``.

    Safe while members send and read: each inbox is compacted under its own lock and cut
    at its owner's committed cursor, so no unread message is lost and every cursor stays
    valid. Two runs on one team take turns (``gc.lock``, waited for up to ``timeout``
    seconds, then `LockTimeout`). Inboxes with fewer than ``min_bytes`` consumed are left.
    What is dropped goes to the team's archive first, but with ``drop_before`` (a ts:
    ``gc --purge-before``) the lines older than it are dropped for good.

    Example:
        >>> collect("demo", home="/tmp/mail").removed        # doctest: +SKIP
        5120
    """
    from ralph_mail.talk.channels import listed

    roster = load_team(team, home)
    store = roster.store
    # Every inbox, then every channel's log (cut where its least advanced member is).
    logs = [*roster.names, *(f"#{channel.name}" for channel in listed(store))]
    try:
        compactions, removed = store.collect(logs, min_bytes, drop_before, timeout)
    finally:
        store.close()
    return Collection(roster.name, compactions, removed)


def doctor(
    home: str | os.PathLike[str] | None = None,
    team: str | None = None,
    *,
    lock_wait: float = settings.DOCTOR_LOCK_WAIT_S,
) -> Report:
    """Check a home (or one of its teams): file system, inotify, permissions, inboxes,
    cursors, dead letters, locks and leftovers of killed processes.

    Nothing is changed. Each problem comes with its fix; a torn tail or dead letters are
    warnings (the mailbox already set the bad bytes aside), an unsafe file system, foreign
    permissions or a damaged file are failures.

    Example:
        >>> doctor(home="/tmp/mail").healthy()               # doctest: +SKIP
        True
    """
    root = settings.home(home)
    place = backend(root, settings.backend())
    return Report(root, tuple(place.doctor(team, lock_wait)), place.where())
