"""Doorbells: how a sender wakes the processes waiting on a log, with no file events.

inotify gives a user 128 instances, one per waiting process: past that, waits polled.
A doorbell costs no kernel quota. A waiting process makes one FIFO and links it into
``bells/<key>/`` for each log it waits on (an agent's inbox, ``#channel``,
``log:NAME``), as ``<pid>-<random>``. A sender, once its line is appended, looks for
``bells/<key>``: when nobody waits the directory is not there and that one
``faccessat`` is all a send pays; else it writes one byte into each FIFO listed, and the
waiters blocked in ``poll(2)`` on them wake at once.

Why no wake-up is lost: the waiter links its FIFO *before* it reads its inbox, and a
sender lists the FIFOs *after* its append. A sender that did not see the link appended
before the link was made, so the waiter's read finds the line.

Why a killed waiter costs nothing: the waiter holds its FIFO open read-write, so the
FIFO has a reader exactly while the process lives. Opening a FIFO for writing without
blocking fails with ENXIO when it has no reader: the sender that meets a dead waiter's
FIFO unlinks it, once. A full FIFO (a waiter stopped, rung 65,536 times) refuses the
byte with EAGAIN: it is rung already.

A waiter that must poll (``RALPH_WAIT=poll``, or no other way could be had) leaves a
note in ``bells/.polling/``, so doctor can say how many poll and why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import weakref
from dataclasses import dataclass

from ralph_mail.settings import FILE_MODE
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import open_dir, pid_alive, wait_readable

#: The team's directory of doorbells, and the one of notes left by polling waiters.
BELLS = "bells"
POLLING = ".polling"

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RING = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def ring(dirs: TeamDirs, key: str) -> None:
    """Wake every process waiting on log ``key`` of the team (after an append to it).

    Never raises: a bell that cannot be rung leaves its waiter to its safety poll.
    """
    try:
        root = dirs.root_fd()
        where = f"{BELLS}/{key}"
        # faccessat: the usual answer (nobody waits) without an exception, under 1 µs.
        if not os.access(where, os.F_OK, dir_fd=root, follow_symlinks=False):
            return
        listing = os.open(where, _DIR, dir_fd=root)
    except Exception:  # the team is gone, or the directory went meanwhile
        return
    _ring_listed(listing)


def ring_all(team: str) -> None:
    """Wake every waiter of the team directory ``team`` (it is being deleted, renamed
    aside: they must find out now, not at their next safety poll)."""
    try:
        bells = open_dir(os.path.join(team, BELLS))
    except OSError:  # no bells: nobody to wake
        return
    try:
        for key in os.listdir(bells):
            if not key.startswith("."):
                with contextlib.suppress(OSError):
                    _ring_listed(os.open(key, _DIR, dir_fd=bells))
    finally:
        os.close(bells)


def _ring_listed(listing: int) -> None:
    try:
        for name in os.listdir(listing):
            _ring_one(listing, name)
    except OSError:
        pass
    finally:
        os.close(listing)


def _ring_one(listing: int, name: str) -> None:
    try:
        fd = os.open(name, _RING, dir_fd=listing)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader: its waiter died without unlinking it
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=listing)
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):  # anything else is not ours to write
            os.write(fd, b"\0")
    except OSError:  # EAGAIN: full, so rung already
        pass
    finally:
        os.close(fd)


class Bell:
    """One process's doorbell for ``keys``: a FIFO linked under ``bells/<key>/`` for each.

    Example:
        >>> bell = Bell(store.dirs, ["lead"])   # doctest: +SKIP
        >>> bell.wait(30.0)                     # True once a sender rang it
        True
    """

    def __init__(self, dirs: TeamDirs, keys: list[str]) -> None:
        self.token = f"{os.getpid()}-{os.urandom(6).hex()}"
        bells = os.dup(dirs.get(BELLS))  # made on first use: older teams have none
        self._links: list[str] = []
        self._fds = [bells, -1]
        self._finalizer = weakref.finalize(
            self, _release, self._fds, self._links, self.token, os.getpid()
        )
        temp = f".{self.token}"
        try:
            os.mkfifo(temp, FILE_MODE, dir_fd=bells)
            # Read-write: the FIFO never reports end of file, and it has a reader for
            # exactly as long as this process lives (see the module docstring).
            self.fd = self._fds[1] = os.open(
                temp, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=bells
            )
            os.fchmod(self.fd, FILE_MODE)
            for key in dict.fromkeys(keys):
                self._link(bells, temp, key)
        except BaseException:
            self.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=bells)
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)

    def _link(self, bells: int, temp: str, key: str) -> None:
        for _ in range(100):  # another waiter's close may remove the directory between
            place = open_dir(key, bells, create=True)
            try:
                os.link(temp, self.token, src_dir_fd=bells, dst_dir_fd=place)
                self._links.append(key)
                return
            except FileNotFoundError:
                continue
            finally:
                os.close(place)
        raise OSError(errno.EAGAIN, f"cannot register a doorbell for {key!r}")

    def wait(self, timeout: float, also: tuple[int, ...] = ()) -> bool:
        """Block until rung, ``timeout`` seconds or one of ``also`` readable; True when
        rung (and drained)."""
        return wait_readable(self._poller, self.fd, timeout, also)

    def close(self) -> None:
        """Unlink the FIFO from every key and close it."""
        self._finalizer()


def _release(fds: list[int], links: list[str], token: str, pid: int) -> None:
    # Takes the parts, not the bell, so that it can run as the bell's finalizer; a child
    # forked with the bell leaves the parent's registrations alone.
    bells = fds[0]
    if pid == os.getpid():
        for key in links:
            with contextlib.suppress(OSError):
                os.unlink(f"{key}/{token}", dir_fd=bells)
            with contextlib.suppress(OSError):  # the last waiter on it takes the directory
                os.rmdir(key, dir_fd=bells)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
    links.clear()
    fds[:] = [-1, -1]


# -- polling waiters and what doctor says of them ------------------------------------------


class PollingNote:
    """A note ``bells/.polling/<pid>-<random>`` saying why this process's waiter polls,
    kept open while it waits (as a doorbell is: ``/proc/PID/fd`` shows who waits) and
    removed when it stops; a dead process's note is ignored, and removed by doctor."""

    def __init__(self, dirs: TeamDirs, reason: str) -> None:
        self.name = f"{os.getpid()}-{os.urandom(6).hex()}"
        place = open_dir(POLLING, dirs.get(BELLS), create=True)
        try:
            fd = os.open(self.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, FILE_MODE, dir_fd=place)  # fmt: skip
        except BaseException:
            os.close(place)
            raise
        os.write(fd, reason.encode("utf-8", "replace")[:400])
        self._finalizer = weakref.finalize(self, _unnote, place, fd, self.name, os.getpid())

    def close(self) -> None:
        self._finalizer()


def _unnote(place: int, fd: int, name: str, pid: int) -> None:
    if pid == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=place)
    os.close(fd)
    os.close(place)


@dataclass(frozen=True, slots=True)
class Waiting:
    """Who waits on a team now, as doctor reports it.

    Attributes:
        bells: live doorbells (one per waiting process, whatever it waits on).
        stale: doorbells and notes left by dead processes (a send or a wait clears them).
        polling: why each live polling waiter polls (one entry per waiter).
    """

    bells: int
    stale: int
    polling: tuple[str, ...]


def survey(dirs: TeamDirs) -> Waiting:
    """Count the team's live doorbells, polling waiters and dead ones' leftovers (only
    looks: a FIFO is opened without blocking, and never written)."""
    try:
        bells = dirs.get(BELLS, create=False)
        keys = os.listdir(bells)
    except Exception:  # no bells directory (a StoreError), no team: nobody waits
        return Waiting(0, 0, ())
    live: set[tuple[int, int]] = set()
    stale = 0
    polling: list[str] = []
    for key in keys:
        if key == POLLING:
            stale += _notes(bells, polling)
        elif key.startswith("."):  # a FIFO being registered, or left by a killed waiter
            pid = key[1:].partition("-")[0]
            stale += pid.isdigit() and not pid_alive(int(pid))
        else:
            with contextlib.suppress(OSError):
                stale += _doorbells(os.open(key, _DIR, dir_fd=bells), live)
    return Waiting(len(live), stale, tuple(polling))


def _doorbells(place: int, live: set[tuple[int, int]]) -> int:
    """Add the live FIFOs of one key to ``live``; return how many are dead."""
    dead = 0
    try:
        for name in os.listdir(place):
            try:
                fd = os.open(name, _RING, dir_fd=place)
            except OSError as exc:
                dead += exc.errno == errno.ENXIO
                continue
            info = os.fstat(fd)
            os.close(fd)
            live.add((info.st_dev, info.st_ino))
    finally:
        os.close(place)
    return dead


def _notes(bells: int, polling: list[str]) -> int:
    stale = 0
    with contextlib.suppress(OSError):
        place = os.open(POLLING, _DIR, dir_fd=bells)
        try:
            for name in os.listdir(place):
                pid = name.partition("-")[0]
                if not (pid.isdigit() and pid_alive(int(pid))):
                    stale += 1
                    continue
                with contextlib.suppress(OSError):
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=place)
                    try:
                        polling.append(os.read(fd, 400).decode("utf-8", "replace"))
                    finally:
                        os.close(fd)
        finally:
            os.close(place)
    return stale
