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

A sender remembers the FIFOs it rang (their names, for 4,096 keys; the last 16 open) and
rings them again without listing while the key's directory keeps the time it had when
listed (`_Rings`): a link changes it, and the sender looks at it (one stat, after
ringing the FIFOs it remembered) after its append, so the argument holds.

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
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from ralph_mail.settings import FILE_MODE, SPIN_QUICK_S
from ralph_mail.store.files.layout import TeamDirs
from ralph_mail.store.files.posix import my_pid, open_dir, pid_alive, wait_readable

#: The team's directory of doorbells, and the one of notes left by polling waiters.
BELLS = "bells"
POLLING = ".polling"

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RING = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL

#: How many FIFOs one process keeps open to ring again (see `_Rings`).
RINGS_KEPT: Final = 16
#: How many keys' listings one process remembers by name (see `_Rings`).
RINGS_NAMED: Final = 4096
#: A listing is kept only of a directory last changed at least this long before (ns):
#: longer than the clock a file system stamps times with ticks. Most (ext4, xfs, btrfs,
#: tmpfs) stamp with a kernel tick of 1-10 ms; a time in whole seconds may come from one
#: that counts seconds (ext4 with small inodes, HFS+) or two (FAT).
_SETTLED_NS: Final = 100_000_000
_SETTLED_WHOLE_NS: Final = 3_000_000_000


def ring(dirs: TeamDirs, key: str) -> None:
    """Wake every process waiting on log ``key`` of the team (after an append to it).

    Never raises: a bell that cannot be rung leaves its waiter to its safety poll.
    """
    try:
        root = dirs.root_fd()
        _RINGS.ring(root, f"{BELLS}/{key}", (root, key))
    except Exception:  # the team is gone, or the directory went meanwhile
        return


class _Listing:
    """The FIFOs of one key as its directory was when listed: their names, and, while
    they are among the last rung, their descriptors open for ringing."""

    __slots__ = ("fds", "inode", "mtime", "names", "poller")

    def __init__(self, inode: int, mtime: int, names: list[str], fds: list[int]) -> None:
        self.inode, self.mtime, self.names = inode, mtime, names
        self.fds: list[int] = []
        self.poller: select.poll | None = None
        if fds:
            self.hold(fds)

    def hold(self, fds: list[int]) -> None:
        self.fds = fds
        self.poller = select.poll()
        for fd in fds:
            self.poller.register(fd, select.POLLOUT)

    def release(self) -> int:
        """Close the descriptors (the names stay); how many there were."""
        count = len(self.fds)
        _close_all(self.fds)
        self.fds, self.poller = [], None
        return count


class _Rings:
    """The FIFOs a process rang, remembered so that ringing the same waiters again is a
    poll and a write each and a stat, not a lookup, a listing and an open and close of
    every FIFO. The last rung stay open (`RINGS_KEPT` descriptors in all, the least
    recently rung closed first); the others are remembered by name (`RINGS_NAMED`
    keys), and ringing one of those opens its FIFOs by name, with no listing: a sender
    that wakes a thousand agents in turn looks up no directory on the way.

    A listing is kept under the team directory's descriptor and the key (a descriptor
    closed and reused for another team finds another inode). It is used while its
    directory's inode and time stay as they were when listed: a waiter that links its
    FIFO changes the time. A file system stamps that time with a coarse clock (a kernel
    tick, or a whole second), so a directory changed less than `_SETTLED_NS` before its
    listing (`_SETTLED_WHOLE_NS` for a time in whole seconds) is listed again at every
    ring. A FIFO whose waiter died (no reader left: POLLERR, or ENXIO when opened) has
    the key listed again, which unlinks it.
    """

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[int, str], _Listing] = OrderedDict()
        self._open: OrderedDict[tuple[int, str], _Listing] = OrderedDict()  # with fds
        self._fds = 0
        self._pid = my_pid()
        # A kept descriptor is used and closed under this lock: a thread never writes to
        # a descriptor another closed (or that was reused for another file).
        self._lock = threading.Lock()

    def ring(self, root: int, where: str, name: tuple[int, str]) -> None:
        # faccessat: the usual answer (nobody waits) without an exception, under 1 µs.
        if name not in self._kept and not os.access(where, os.F_OK, dir_fd=root,
                                                    follow_symlinks=False):  # fmt: skip
            return
        with self._lock:
            if self._pid != my_pid():  # inherited through fork: not ours to close
                self._kept.clear()
                self._open.clear()
                self._fds, self._pid = 0, my_pid()
            listing = self._kept.get(name)
            if listing is not None:
                # Ring first, so the wake-up goes now; then see whether the listing still
                # holds (still after the append). A waiter it missed is rung by the
                # listing made again, and the others get a second byte: a spare wake-up.
                if listing.fds:
                    rung = _ring_kept(listing)
                else:
                    rung = self._ring_named(root, where, name, listing)
                try:
                    status = os.stat(where, dir_fd=root, follow_symlinks=False)
                except OSError:  # nobody waits any more
                    self._drop(name)
                    return
                if rung and (listing.inode, listing.mtime) == (status.st_ino, status.st_mtime_ns):
                    self._kept.move_to_end(name)
                    if listing.fds:
                        self._open.move_to_end(name)
                    return
                self._drop(name)
            listing = _ring_listing(root, where)
            if listing is not None and listing.names:
                self._kept[name] = listing
                if listing.fds:
                    self._hold(name, listing)
                while len(self._kept) > RINGS_NAMED:
                    self._drop(next(iter(self._kept)))

    def _ring_named(self, root: int, where: str, name: tuple[int, str], listing: _Listing
                    ) -> bool:  # fmt: skip
        """Ring the FIFOs of a listing remembered by name; keep them open (it is the last
        rung now). False when one is gone or has lost its reader (list again)."""
        fds: list[int] = []
        for fifo in listing.names:
            fd = _ring_one(root, f"{where}/{fifo}")
            if fd < 0:
                _close_all(fds)
                return False
            fds.append(fd)
        if len(fds) > RINGS_KEPT:  # more than may stay open: by name again next time
            _close_all(fds)
        else:
            listing.hold(fds)
            self._hold(name, listing)
        return True

    def _hold(self, name: tuple[int, str], listing: _Listing) -> None:
        self._open[name] = listing
        self._fds += len(listing.fds)
        while self._fds > RINGS_KEPT and len(self._open) > 1:
            self._fds -= self._open.popitem(last=False)[1].release()

    def _drop(self, name: tuple[int, str]) -> None:
        listing = self._kept.pop(name)
        if self._open.pop(name, None) is not None:
            self._fds -= listing.release()


def _ring_kept(listing: _Listing) -> bool:
    """Ring each FIFO of a kept listing; False when one has lost its reader (list again)."""
    assert listing.poller is not None
    try:
        if any(events & _GONE for _, events in listing.poller.poll(0)):
            return False
        for fd in listing.fds:
            with contextlib.suppress(BlockingIOError):  # full, so rung already
                os.write(fd, b"\0")
    except OSError:  # its waiter died since the poll
        return False
    return True


def _ring_listing(root: int, where: str) -> _Listing | None:
    """List the key's FIFOs and ring each; the listing, with its FIFOs open, when it may
    be kept (see `_Rings`), else None (and they are closed)."""
    fds: list[int] = []
    names: list[str] = []
    try:
        listing = os.open(where, _DIR, dir_fd=root)
    except OSError:
        return None
    try:
        status = os.fstat(listing)  # before the listing: a link made after changes it
        listed = time.time_ns()
        for name in os.listdir(listing):
            fd = _ring_one(listing, name)
            if fd >= 0:
                fds.append(fd)
                names.append(name)
    except OSError:
        _close_all(fds)
        return None
    finally:
        os.close(listing)
    settled = _SETTLED_NS if status.st_mtime_ns % 1_000_000_000 else _SETTLED_WHOLE_NS
    if status.st_mtime_ns > listed - settled:
        _close_all(fds)
        return None
    if len(fds) > RINGS_KEPT:  # remembered by name only
        _close_all(fds)
        fds = []
    return _Listing(status.st_ino, status.st_mtime_ns, names, fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_RINGS = _Rings()


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
            fd = _ring_one(listing, name)
            if fd >= 0:
                os.close(fd)
    except OSError:
        pass
    finally:
        os.close(listing)


def _ring_one(listing: int, name: str) -> int:
    """Ring FIFO ``name``; its descriptor, open for writing, or -1 when it is not a live
    doorbell (a dead waiter's is unlinked, once)."""
    try:
        fd = os.open(name, _RING, dir_fd=listing)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader: its waiter died without unlinking it
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=listing)
        return -1
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # anything else is not ours to write
            os.close(fd)
            return -1
        os.write(fd, b"\0")
    except BlockingIOError:  # full, so rung already
        pass
    except OSError:
        os.close(fd)
        return -1
    return fd


class Bell:
    """One process's doorbell for ``keys``: a FIFO linked under ``bells/<key>/`` for each.

    Example:
        >>> bell = Bell(store.dirs, ["lead"])   # doctest: +SKIP
        >>> bell.wait(30.0)                     # True once a sender rang it
        True
    """

    def __init__(self, dirs: TeamDirs, keys: list[str], spin: float = 0.0) -> None:
        self.token = f"{os.getpid()}-{os.urandom(6).hex()}"
        self._spin = spin  # how long a wait spins first (see `wait`)
        self._quick = False  # whether the last wait was rung within SPIN_QUICK_S
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
        rung (and drained).

        A wait after one that was rung within `SPIN_QUICK_S` (a quick conversation
        going on) first spins for the bell's ``spin`` (see `ralph_mail.store.spin`): an
        idle waiter, or one whose mail comes further apart, never spins."""
        start = time.monotonic()
        spin = self._spin if self._quick else 0.0
        rung = wait_readable(self._poller, self.fd, timeout, also, spin)
        self._quick = rung and time.monotonic() - start <= SPIN_QUICK_S
        return rung

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
