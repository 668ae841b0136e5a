"""Where a team's files live, and the team-level operations of the file backend.

Layout of one team (``$RALPH_HOME/teams/<team>/``)::

    team.json                  roster (written once, by create_team)
    mailbox/<agent>.jsonl      one append-only inbox per agent: inboxes and nothing else
    channels/<name>.jsonl      one append-only log per channel: its posts
    cursors/<agent>.cursor     the owner's read position (a slot file, see slots.py);
                               #<channel>@<member>.cursor: a member's in a channel
    cursors/<agent>.commits    when the owner's cursor moved (commits.py)
    consumers/<agent>.lock     held (flock) by the one process consuming that inbox
    presence/<agent>.slot      the agent's presence: state, until, last seen (a slot file)
    deadletters/<agent>.jsonl  lines set aside from that inbox, with the reason
    bases/<agent>.base         logical offset of the inbox's first byte, and its last ts
                               when gc compacted it (a slot file)
    state/<key>.json           small keyed state (the lead's handled ids, ...)
    index/<key>.idx            where the lines of a conversation are (indexes.py)
    index/threads.<xx>.idx     where the lines of the threads are: a fixed set of files
    logs/<name>.jsonl          team logs, append-only: tasks.jsonl, the task tree
    tmp/                       gc's copies of inboxes, renamed over them when whole
    bells/<key>/<pid>-<rand>   the doorbell (a FIFO) of a process waiting on log <key>,
                               rung by senders after an append (see bells.py)
    gc.lock                    keeps two gc runs of the team apart
    roster.lock                keeps two rewrites of team.json apart

A team is opened once by path, with ``O_NOFOLLOW``; everything inside it is opened
relative to that descriptor, so a symlink planted for the team or any directory in it is
refused, and a process that outlives the deletion of its team cannot re-create it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from ralph_mail.errors import StoreError, TeamNotFound
from ralph_mail.store.files.posix import (
    my_pid,
    open_dir,
    open_file,
    read_file,
    store_error,
    unlinked,
    write_all,
)
from ralph_mail.store.files.slots import SlotFile

#: The directories beside ``mailbox/``, made with the team.
SUBDIRS = (
    "cursors", "consumers", "presence", "deadletters", "bases", "state", "index", "logs", "tmp",
    "archive", "channels", "bells",
)  # fmt: skip


def log_place(key: str) -> tuple[str, str]:
    """The directory and file name of the log ``key`` names: an agent's inbox, or a
    channel's log for ``#NAME`` (both logs with an inbox's guarantees)."""
    if key.startswith("#"):
        return "channels", f"{key[1:]}.jsonl"
    return "mailbox", f"{key}.jsonl"


def teams_dir(home: Path) -> Path:
    """Where the teams of a home live."""
    return home / "teams"


def ensure_home(home: Path) -> Path:
    """``home/teams``, made 0700 when missing; `StoreError` when it cannot be."""
    parent = teams_dir(home)
    try:
        missing = []
        probe = parent
        while not probe.exists() and not probe.is_symlink():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700, follow_symlinks=False)
        if not parent.is_dir():
            raise StoreError(f"{parent} is not a directory: remove it or pick another RALPH_HOME")
    except OSError as exc:
        raise store_error(exc, str(parent), "create", "check RALPH_HOME") from None
    return parent


class TeamDirs:
    """Descriptors on one team's directory and the directories in it, opened on first use.

    Example:
        >>> dirs = TeamDirs(Path("~/.ralph"), "demo")   # doctest: +SKIP
        >>> os.open("lead.jsonl", os.O_RDONLY, dir_fd=dirs.get("mailbox"))  # doctest: +SKIP
    """

    def __init__(self, home: Path, team: str) -> None:
        self.home = home
        self.team = team
        self.root = teams_dir(home) / team
        self._root_fd = -1
        self._fds: dict[str, int] = {}
        self._pid = my_pid()
        #: Counts reopenings: what was opened through an older generation is stale.
        self.generation = 0

    def path(self, *parts: str) -> Path:
        """The path of a file in the team, for messages."""
        return self.root.joinpath(*parts)

    def root_fd(self) -> int:
        """The team directory; `TeamNotFound` when it is gone."""
        if self._pid != my_pid():  # descriptors inherited through fork: our own copies
            self._fds, self._root_fd, self._pid = {}, -1, my_pid()
        if self._root_fd < 0:
            try:
                self._root_fd = open_dir(str(self.root))
            except FileNotFoundError:
                raise self.gone() from None
            except OSError as exc:
                raise store_error(exc, str(self.root), "open team directory") from None
        return self._root_fd

    def get(self, name: str, *, create: bool = True) -> int:
        """The directory ``name`` of the team (made 0700 when missing and ``create``)."""
        fd = self._fds.get(name)
        if fd is not None and self._pid == my_pid():
            return fd
        root = self.root_fd()
        try:
            fd = open_dir(name, root, create=create)
        except FileNotFoundError:
            if unlinked(root):
                raise self.gone() from None
            raise StoreError(
                f"{self.path(name)} is missing: run 'ralph-mail doctor'", self.path(name)
            ) from None
        except OSError as exc:
            raise store_error(exc, str(self.path(name)), "open directory") from None
        self._fds[name] = fd
        return fd

    def replaced(self) -> bool:
        """Whether the team directory was deleted (or deleted and made again) since opened."""
        if self._root_fd < 0:
            return False
        try:
            now = os.stat(self.root, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return True
        return unlinked(self._root_fd) or os.fstat(self._root_fd).st_ino != now

    def gone(self) -> TeamNotFound:
        return TeamNotFound(
            f"team {self.team!r} was deleted from {self.home}: nothing can be read or "
            "written there; create it again or stop this process"
        )

    def reopen(self) -> None:
        """Drop every descriptor, so the next use opens the team found at its path now."""
        self.close()
        self.generation += 1

    def close(self) -> None:
        if self._pid == my_pid():
            for fd in self._fds.values():
                os.close(fd)
            if self._root_fd >= 0:
                os.close(self._root_fd)
        self._fds, self._root_fd, self._pid = {}, -1, my_pid()


def create_team_files(home: Path, name: str, agents: list[str], roster: bytes) -> None:
    """Create a team's directory with its roster and an empty inbox for every agent.

    The team is built in a hidden temporary directory and renamed into place, so it
    appears whole or not at all, and of two concurrent creators exactly one wins.
    """
    parent = ensure_home(home)
    target = parent / name
    if target.exists() or target.is_symlink():
        raise FileExistsError(target)
    staging = parent / f".{name}.{os.getpid()}.{time.time_ns()}.new"
    try:
        fd = open_dir(str(staging), create=True)
        try:
            mailbox = open_dir("mailbox", fd, create=True)
            try:
                for agent in agents:
                    os.close(
                        open_file(f"{agent}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, mailbox)
                    )
            finally:
                os.close(mailbox)
            for sub in SUBDIRS:
                os.close(open_dir(sub, fd, create=True))
            state = open_dir("state", fd)
            try:  # the counter of state saves (see FileStore.state_version), at 0
                control = open_file("control", os.O_WRONLY | os.O_CREAT | os.O_EXCL, state)
                os.ftruncate(control, 8)
                os.close(control)
            finally:
                os.close(state)
            bases = open_dir("bases", fd)
            try:  # gc writes bases in place: their blocks exist before a disk fills
                for agent in agents:
                    slots = SlotFile(lambda: bases, f"{agent}.base", f"base of {agent!r}")
                    slots.create()
                    slots.close()
            finally:
                os.close(bases)
            out = open_file("team.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, fd)
            try:
                write_all(out, roster)
                os.fsync(out)
            finally:
                os.close(out)
        finally:
            os.close(fd)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(target) from None
            raise
        dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if staging.exists():
            import shutil  # only on this path: 4 ms of start-up a send does not need

            shutil.rmtree(staging, ignore_errors=True)


def read_roster(home: Path, name: str) -> bytes:
    """The bytes of a team's ``team.json``; FileNotFoundError when there is no such team."""
    team_fd = open_dir(str(teams_dir(home) / name))
    try:
        return read_file("team.json", team_fd)
    finally:
        os.close(team_fd)


def team_names(home: Path) -> list[str]:
    """The names of the teams under ``home`` that have a roster, sorted."""
    parent = teams_dir(home)
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise store_error(exc, str(parent), "list the teams in", "check RALPH_HOME") from None
    return [e for e in entries if not e.startswith(".") and (parent / e / "team.json").is_file()]


def remove_team_files(home: Path, name: str) -> None:
    """Delete a team's directory: renamed aside first, so it disappears at once and whole."""
    target = teams_dir(home) / name
    doomed = teams_dir(home) / f".{name}.{os.getpid()}.{time.time_ns()}.deleted"
    os.rename(target, doomed)
    from ralph_mail.store.files.bells import ring_all  # bells.py builds on this module

    ring_all(str(doomed))
    import shutil

    shutil.rmtree(doomed)
