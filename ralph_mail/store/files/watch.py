"""Blocking until a team's logs change: the waiter behind every wait of the file store.

How a waiter learns of a change is chosen by ``RALPH_WAIT`` (see `settings.wait_mechanism`):

- ``bell`` (the default on files): senders ring a FIFO the waiter registered (bells.py).
  It needs no kernel quota, so a thousand waiters on one host cost nothing while idle,
  where inotify's 128 instances a user ran out at the 129th.
- ``inotify`` (Linux): the waiter blocks in ``poll(2)`` on its own inotify descriptor
  (through ctypes); 0.16 ms median in the bench, one of the user's 128 instances each.
- ``watchfiles``: watchfiles' public ``watch()`` on a thread of its own (FSEvents on
  macOS, kqueue on the BSDs); its Rust loop sleeps in steps, so it wakes in about 2 ms
  and costs about 1.4 % of a core per idle waiter (bench/wakeup.py).
- ``poll``: the files' sizes and times looked at every 10 ms after a change, less and
  less often while nothing changes (up to every 0.5 s), so an idle poller costs a few
  stats a second.

``auto`` takes the first of these that can be had; a waiter that ends up polling warns
once and leaves a note for doctor (bells.PollingNote).

An event is only a hint that something *may* have changed: the caller always reads to
the end of its inbox afterwards, because N appends can arrive as one event and events can
be lost (a full inotify queue, a writer that does not ring). The caller also wakes at
least every `WATCH_SAFETY_POLL_S` seconds (stretched while idle) for the same reason.

An inotify waiter watches its own inboxes, not the whole mailbox directory: with a
directory watch every waiter woke on every send in the team (20 idle waiters made 200k
sends to another agent 10x slower). Each inbox file gets a watch for appends, and the
directory a watch for names appearing or going (no IN_MODIFY), so an inbox replaced by
gc (a new inode renamed into place) gets its watch back and keeps waking its reader.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ralph_mail.settings import (
    WATCH_DEBOUNCE_MS,
    WATCH_POLL_BACKOFF,
    WATCH_POLL_DELAY_MS,
    WATCH_POLL_MAX_MS,
    WATCH_STEP_MS,
    WATCH_STOP_CHECK_MAX_S,
    WATCH_STOP_CHECK_S,
    wait_mechanism,
)
from ralph_mail.store.files.posix import ready, wait_readable
from ralph_mail.store.flag import filenos_of

if TYPE_CHECKING:
    from ralph_mail.store.base import StopEvent


#: Other directories a watcher looks at, each with the names of the files watched in it.
Places = Mapping[Path, list[str]]


class Source(Protocol):
    """One way of learning that something changed (a doorbell, inotify, watchfiles, a
    poller): ``wait`` blocks at most ``timeout`` seconds, or until one of ``also`` (a stop
    flag's descriptors) is readable; True when something changed."""

    def wait(self, timeout: float, also: tuple[int, ...] = ()) -> bool: ...

    def close(self) -> None: ...


class Note(Protocol):
    """What a polling waiter leaves for doctor, until it is closed."""

    def close(self) -> None: ...


# inotify(7): what changes an inbox (appends, gc's rename) or the directory itself.
_IN_MODIFY = 0x2
_IN_CLOSE_WRITE = 0x8
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100
_IN_DELETE = 0x200
_IN_DELETE_SELF = 0x400
_IN_MOVE_SELF = 0x800
_MASK = (
    _IN_MODIFY
    | _IN_CLOSE_WRITE
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
)


#: What a directory watch of named files listens for: names appearing or going, not appends.
_DIR_MASK = _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
#: What a file watch listens for: appends and the file going away.
_FILE_MASK = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_DELETE_SELF | _IN_MOVE_SELF
_EVENT = struct.Struct("iIII")


class _Inotify:
    """One inotify descriptor watching directories (or some files in each), waited on
    with poll(2)."""

    def __init__(self, directory: Path, names: list[str] | None, more: Places) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        init, self._add_watch = libc.inotify_init1, libc.inotify_add_watch  # AttributeError
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"inotify_init1: {os.strerror(error)}")
        self.fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._everything = names is None
        # Directory watch -> (the directory, the names watched in it).
        self._dirs: dict[int, tuple[Path, set[bytes]]] = {}
        for place, wanted in [(directory, names or []), *more.items()]:
            mask = _MASK if names is None else _DIR_MASK
            encoded = {os.fsencode(name) for name in wanted}
            self._dirs[self._add(place, mask)] = (place, encoded)
            for name in wanted:
                self._add(place / name, _FILE_MASK, missing_ok=True)
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def _add(self, path: Path, mask: int, missing_ok: bool = False) -> int:
        import ctypes

        wd = int(self._add_watch(self.fd, os.fsencode(path), mask))
        if wd < 0:
            error = ctypes.get_errno()
            if missing_ok and error == 2:  # ENOENT: the read that follows reports it
                return -1
            self.close()
            raise OSError(error, f"inotify_add_watch: {os.strerror(error)}", str(path))
        return wd

    def wait(self, timeout: float, also: tuple[int, ...] = ()) -> bool:
        # A signal whose handler raises (Ctrl-C, the lead's SIGTERM) ends poll() with that
        # exception; one whose handler returns lets poll() go on (PEP 475).
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not ready(self._poller, self.fd, remaining, also):
                return False  # the time is up, or a stop flag was set
            if self._relevant():
                return True
            if time.monotonic() >= deadline:
                return False

    def _relevant(self) -> bool:
        """Drain the queue; whether any event concerns the files watched."""
        data = b""
        try:
            while chunk := os.read(self.fd, 65536):
                data += chunk
        except BlockingIOError:
            pass
        if self._everything:
            return True
        relevant = False
        position = 0
        while position + _EVENT.size <= len(data):
            wd, mask, _, length = _EVENT.unpack_from(data, position)
            name = data[position + _EVENT.size : position + _EVENT.size + length].rstrip(b"\0")
            position += _EVENT.size + length
            place = self._dirs.get(wd)
            if place is None:
                relevant = True  # a watched file changed, or the queue overflowed (wd -1)
            elif not name or name in place[1]:
                relevant = True  # the directory itself went, or a file was replaced
                if name and mask & (_IN_MOVED_TO | _IN_CREATE):
                    self._add(place[0] / os.fsdecode(name), _FILE_MASK, missing_ok=True)
        return relevant

    def close(self) -> None:
        self._finalizer()


class _Watchfiles:
    """watchfiles' public ``watch()`` on a thread, which writes a byte into a pipe for each
    batch of changes to the names watched; a wait is a ``poll(2)`` on that pipe."""

    def __init__(self, directory: Path, names: list[str] | None, more: Places) -> None:
        import watchfiles  # 30 ms of import, only when this way is chosen

        wanted = {str(directory / n) for n in names or []}
        for place, files in more.items():
            wanted.update(str(place / n) for n in files)
        paths = [str(directory), *map(str, more)]
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = threading.Event()
        started = threading.Event()
        failure: list[BaseException] = []

        def keep(_: object, path: str) -> bool:
            return names is None or path in wanted

        def run() -> None:
            try:
                changes = watchfiles.watch(
                    *paths,
                    watch_filter=keep,
                    debounce=WATCH_DEBOUNCE_MS,
                    step=WATCH_STEP_MS,
                    stop_event=_Started(started, self._closed),
                    rust_timeout=0,
                    force_polling=False,
                    recursive=False,
                    raise_interrupt=False,
                )
                for _ in changes:
                    with contextlib.suppress(BlockingIOError):
                        os.write(self._write, b"\0")
            except Exception as exc:  # reported to the constructor
                failure.append(exc)
                started.set()

        self._thread = threading.Thread(target=run, name="ralph-watchfiles", daemon=True)
        self._thread.start()
        started.wait(_WATCHFILES_START_S)
        if failure or not started.is_set():
            self.close()
            raise OSError(f"watchfiles: {failure[0] if failure else 'did not start'}")
        self._poller = select.poll()
        self._poller.register(self._read, select.POLLIN)

    def wait(self, timeout: float, also: tuple[int, ...] = ()) -> bool:
        return wait_readable(self._poller, self._read, timeout, also)

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_WATCHFILES_START_S)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read = self._write = -1


#: How long a watchfiles thread may take to start watching (s).
_WATCHFILES_START_S = 10.0


class _Started:
    """The stop event given to watchfiles: it asks ``is_set()`` once it watches, then at
    every step, so the first call says that it started."""

    def __init__(self, started: threading.Event, closed: threading.Event) -> None:
        self._started, self._closed = started, closed

    def is_set(self) -> bool:
        self._started.set()
        return self._closed.is_set()


class _Poll:
    """Looks at the watched files' inode, size and time: every WATCH_POLL_DELAY_MS after
    a change, then less and less often while nothing changes (up to WATCH_POLL_MAX_MS)."""

    def __init__(self, directory: Path, names: list[str] | None, more: Places) -> None:
        self._places = [(directory, names), *((p, list(n)) for p, n in more.items())]
        self._delay = WATCH_POLL_DELAY_MS / 1000
        self._seen = self._look()

    def _look(self) -> list[tuple[int, int, int] | None]:
        seen: list[tuple[int, int, int] | None] = []
        for place, names in self._places:
            for name in sorted(os.listdir(place)) if names is None else names:
                try:
                    info = os.stat(place / name, follow_symlinks=False)
                    seen.append((info.st_ino, info.st_size, info.st_mtime_ns))
                except OSError:
                    seen.append(None)
            with contextlib.suppress(OSError):  # names appearing or going, the place deleted
                info = os.stat(place, follow_symlinks=False)
                seen.append((info.st_ino, info.st_nlink, info.st_mtime_ns))
        return seen

    def wait(self, timeout: float, also: tuple[int, ...] = ()) -> bool:
        deadline = time.monotonic() + timeout
        pause = select.poll()  # sleeps between looks, and ends for a stop flag
        for fd in also:
            pause.register(fd, select.POLLIN)
        while True:
            seen = self._look()
            if seen != self._seen:
                self._seen, self._delay = seen, WATCH_POLL_DELAY_MS / 1000
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if pause.poll(round(min(self._delay, remaining) * 1000)):  # polling is this way
                return False
            self._delay = min(self._delay * WATCH_POLL_BACKOFF, WATCH_POLL_MAX_MS / 1000)

    def close(self) -> None:
        pass


#: Which ways each setting tries, in order; the last resort of every one is polling.
_CHAINS = {
    "auto": ("bell", "inotify", "watchfiles", "poll"),
    "bell": ("bell", "poll"),
    "inotify": ("inotify", "poll"),
    "watchfiles": ("watchfiles", "poll"),
    "poll": ("poll",),
}


class Watcher:
    """Wakes when ``names`` in ``directory`` change (anything in it with None), or the
    names ``more`` gives for other directories; started at construction.

    ``bell`` makes the doorbell of a waiter (the file store gives it; without one the
    way after it is taken), ``note`` leaves the note of a waiter that polls, saying why;
    ``before`` runs before each wait (the file store's look at the kept cursors and inboxes).
    Changes that happen between two `wait` calls are kept (a rung FIFO, the kernel's
    inotify queue, watchfiles' thread) and reported by the next call, so nothing that
    arrives while the caller reads is missed. A waiter that must poll warns once.

    Attributes:
        mechanism: the way it learns of changes: bell, inotify, watchfiles or poll.
        polling: whether that way is polling.
        reason: why it polls (None when it does not).

    Example:
        >>> w = Watcher(Path("/tmp"))             # doctest: +SKIP
        >>> w.wait(1.0)                           # doctest: +SKIP
        True
    """

    def __init__(
        self,
        directory: Path,
        names: list[str] | None = None,
        more: Places | None = None,
        *,
        bell: Callable[[], Source] | None = None,
        note: Callable[[str], Note] | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        more = more or {}
        self._before = before
        chosen = wait_mechanism()
        makers: dict[str, Callable[[], Source]] = {
            "inotify": lambda: _Inotify(directory, names, more),
            "watchfiles": lambda: _Watchfiles(directory, names, more),
            "poll": lambda: _Poll(directory, names, more),
        }
        if bell is not None:
            makers["bell"] = bell
        failures: list[str] = []
        for way in _CHAINS[chosen]:
            if way not in makers:
                continue
            try:
                self._source = makers[way]()
            except AttributeError:  # no inotify in this libc
                failures.append(f"{way}: not on this system")
                continue
            except Exception as exc:  # a limit reached, a file system without FIFOs
                failures.append(f"{way}: {exc}")
                continue
            self.mechanism = way
            break
        else:
            raise OSError(f"cannot watch {directory}: {'; '.join(failures)}")
        self.polling = self.mechanism == "poll"
        self.reason: str | None = None
        self._note: Note | None = None
        if self.polling:
            self.reason = "; ".join(failures) or _why_polling(chosen)
            if failures:
                self._warn(directory, self.reason)
            if note is not None:
                with contextlib.suppress(Exception):  # a note is for doctor, never in the way
                    self._note = note(self.reason)

    def _warn(self, directory: Path, why: str) -> None:
        warnings.warn(
            f"file events unavailable for {directory} ({why}); polling from every "
            f"{WATCH_POLL_DELAY_MS} ms instead. Raise fs.inotify.max_user_watches or "
            "max_user_instances, or use RALPH_WAIT=bell, to restore instant wake-ups",
            RuntimeWarning,
            stacklevel=5,
        )

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        """Block until a change, ``timeout`` seconds or ``stop``; True when something changed.

        Raises KeyboardInterrupt when a signal interrupted the wait, so Ctrl-C and a
        SIGTERM handler that raises end it.
        """
        if self._before is not None:
            self._before()
        if stop is None:
            return self._source.wait(timeout)
        also = filenos_of(stop)
        if also is not None:  # a Flag: poll(2) watches it beside the source
            return not stop.is_set() and self._source.wait(timeout, also)
        # poll(2) cannot watch a threading.Event: look at it between slices, which grow
        # while nothing happens (an idle waiter with a stop event wakes about once a second).
        deadline = time.monotonic() + timeout
        step = WATCH_STOP_CHECK_S
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._source.wait(min(remaining, step)):
                return True
            step = min(step * 2, WATCH_STOP_CHECK_MAX_S)
        return False

    def caught_up(self) -> bool:
        return False  # (an event says a file changed, not what came: the read comes first)

    def close(self) -> None:
        """Stop watching: unregister the doorbell, close the inotify descriptor, stop
        watchfiles' thread."""
        self._source.close()
        if self._note is not None:
            self._note.close()
            self._note = None


def _why_polling(chosen: str) -> str:
    if chosen == "poll" and not os.environ.get("RALPH_WAIT", "").strip():
        return "WATCHFILES_FORCE_POLLING is set"
    return f"RALPH_WAIT={chosen}"
