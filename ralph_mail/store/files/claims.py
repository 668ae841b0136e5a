"""The one consumer of an inbox: a claim is an flock on ``consumers/<agent>.lock``.

The kernel drops the lock when the process dies, so a killed consumer never keeps an
inbox. The pid written in the file only names the holder in an error; the lock is what
counts. Claims are counted per process: two stores of one team in one process share a
claim (and its descriptor), and a child does not own those it inherits through ``fork``.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Final

from ralph_mail.errors import InboxBusy
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import open_file, store_error

#: This process's claims: (team directory inode, agent) -> (pid, lock descriptor, users).
_claims: dict[tuple[int, int, str], list[int]] = {}


class Claims:
    """The claims one team store holds, by agent."""

    def __init__(self, dirs: TeamDirs, team: str) -> None:
        self.dirs = dirs
        self.team = team
        self.held: dict[str, tuple[int, int, str]] = {}

    def claim(self, agent: str) -> None:
        """Become the one consumer of ``agent``'s inbox for this process (see `TeamStore`);
        `InboxBusy` when another process is."""
        if agent in self.held:
            return
        try:
            key = (*_dir_key(self.dirs.root_fd()), agent)
            held = _claims.get(key)
            if held is not None and held[0] == os.getpid():
                held[2] += 1
            else:
                fd = open_file(f"{agent}.lock", os.O_RDWR | os.O_CREAT, self.dirs.get("consumers"))
                try:
                    _lock_claim(fd)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                    os.close(fd)
                    raise InboxBusy(
                        f"the inbox of {agent!r} in team {self.team!r} is being consumed by "
                        f"process {holder}: one consumer per inbox; stop that one first, or "
                        "look without consuming with 'ralph-mail tail' or 'read --peek'",
                        int(holder) if holder.isdigit() else None,
                    ) from None
                except BaseException:
                    os.close(fd)
                    raise
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _claims[key] = [os.getpid(), fd, 1]
        except OSError as exc:
            raise store_error(
                exc, str(self.dirs.path("consumers", f"{agent}.lock")), "claim"
            ) from None
        self.held[agent] = key

    def release(self, agent: str) -> None:
        key = self.held.pop(agent, None)
        if key is not None:
            _release(key)

    def renew(self) -> None:
        """Take every claim again (the team was deleted and made again: a new lock)."""
        agents = list(self.held)
        for agent in agents:
            self.release(agent)
        for agent in agents:
            self.claim(agent)

    def close(self) -> None:
        """Give up every claim (those inherited through fork are left alone)."""
        for key in self.held.values():
            _release(key)
        self.held.clear()

    def consumer(self, agent: str) -> int | None:
        """The pid of the process consuming ``agent``'s inbox now, or None."""
        try:
            fd = open_file(f"{agent}.lock", os.O_RDONLY, self.dirs.get("consumers"))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(
                exc, str(self.dirs.path("consumers", f"{agent}.lock")), "read"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(holder) if holder.isdigit() else -1
        finally:
            os.close(fd)
        return None


def _dir_key(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


#: How long a claim keeps trying when the lock is taken (s): `consumer` probes with a
#: shared lock held for microseconds, and a claim meeting one must not fail; a consumer
#: holds it for as long as it runs.
_CLAIM_PATIENCE_S: Final = 0.05


def _lock_claim(fd: int) -> None:
    """The claim's exclusive flock; `BlockingIOError` when another consumer holds it."""
    deadline = time.monotonic() + _CLAIM_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def _release(key: tuple[int, int, str]) -> None:
    held = _claims.get(key)
    if held is None or held[0] != os.getpid():
        return  # inherited through fork: the parent's claim, not ours to drop
    held[2] -= 1
    if held[2] <= 0:
        os.close(held[1])
        del _claims[key]
