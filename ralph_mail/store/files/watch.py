"""Blocking until a team's mailbox directory changes.

On Linux a waiter blocks in ``poll(2)`` on its own inotify descriptor (through ctypes),
so the kernel wakes it the moment an inbox changes: 0.16 ms median in the bench, and no
CPU while idle. watchfiles, the dependency chosen for waiting, cannot do that: its Rust
loop sleeps in steps of at least 1 ms, which costs 1.85 ms median and about 1.4 % of a
core per idle waiter (bench/wakeup.py measures all three side by side). watchfiles stays
where it serves: polling when file events are unavailable or disabled
(``WATCHFILES_FORCE_POLLING``), and file events on systems without inotify.

An event is only a hint that something *may* have changed: the caller always reads to
the end of its inbox afterwards, because N appends can arrive as one event and events can
be lost (a full inotify queue). The caller also wakes at least every
`WATCH_SAFETY_POLL_S` seconds for the same reason.

A waiter watches its own inboxes, not the whole mailbox directory: with a directory
watch every waiter woke on every send in the team (20 idle waiters made 200k sends to
another agent 10x slower). Each inbox file gets a watch for appends, and the directory a
watch for names appearing or going (no IN_MODIFY), so an inbox replaced by gc (a new
inode renamed into place) gets its watch back and keeps waking its reader.
"""

from __future__ import annotations

import os
import select
import struct
import time
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ralph_mail.settings import (
    WATCH_DEBOUNCE_MS,
    WATCH_POLL_DELAY_MS,
    WATCH_STEP_MS,
    WATCH_STOP_CHECK_S,
)

if TYPE_CHECKING:
    from watchfiles._rust_notify import RustNotify

    from ralph_mail.store.base import StopEvent


#: Other directories a watcher looks at, each with the names of the files watched in it.
Places = Mapping[Path, list[str]]


def _force_polling() -> bool:
    value = os.environ.get("WATCHFILES_FORCE_POLLING", "")
    return bool(value) and value.lower() not in {"false", "disable", "disabled", "0"}


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

    def wait(self, timeout: float) -> bool:
        # A signal whose handler raises (Ctrl-C, the lead's SIGTERM) ends poll() with that
        # exception; one whose handler returns lets poll() go on (PEP 475).
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self._poller.poll(max(0, round(remaining * 1000))):
                return False
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


def _notify(cls: type[RustNotify], paths: list[str], polling: bool) -> RustNotify:
    # Arguments: paths, debug, force_polling, poll_delay_ms, recursive, ignore_permission_denied.
    return cls(paths, False, polling, WATCH_POLL_DELAY_MS, False, False)


class Watcher:
    """Wakes when ``names`` in ``directory`` change (anything in it with None), or the
    names ``more`` gives for other directories; started at construction.

    Changes that happen between two `wait` calls are kept (in the kernel's inotify queue,
    or watchfiles' Rust thread) and reported by the next call, so nothing that arrives
    while the caller reads is missed. Falls back to polling, with a warning, when file
    events are unavailable (the inotify watch or instance limit is reached).

    Example:
        >>> w = Watcher(Path("/tmp"))             # doctest: +SKIP
        >>> w.wait(1.0)                           # doctest: +SKIP
        True
    """

    def __init__(
        self, directory: Path, names: list[str] | None = None, more: Places | None = None
    ) -> None:
        self.polling = _force_polling()
        self._inotify: _Inotify | None = None
        self._notify: RustNotify | None = None
        self._paths = [str(directory), *map(str, more or {})]
        if not self.polling:
            try:
                self._inotify = _Inotify(directory, names, more or {})
                return
            except AttributeError:  # no inotify in this libc: watchfiles' native events
                pass
            except OSError as exc:  # the watch or instance limit is reached
                self._warn(directory, exc)
        self._start_watchfiles(directory)

    def _warn(self, directory: Path, exc: Exception) -> None:
        warnings.warn(
            f"file events unavailable for {directory} ({exc}); polling every "
            f"{WATCH_POLL_DELAY_MS} ms instead. Raise fs.inotify.max_user_watches or "
            "max_user_instances to restore instant wake-ups",
            RuntimeWarning,
            stacklevel=4,
        )
        self.polling = True

    def _start_watchfiles(self, directory: Path) -> None:
        from watchfiles._rust_notify import RustNotify  # 30 ms of import, only when needed

        try:
            self._notify = _notify(RustNotify, self._paths, self.polling)
            return
        except Exception as exc:
            if self.polling:
                self._notify = None  # last resort: plain timed polling in wait()
                return
            self._warn(directory, exc)
        try:
            self._notify = _notify(RustNotify, self._paths, True)
        except Exception:
            self._notify = None

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        """Block until a change, ``timeout`` seconds or ``stop``; True when something changed.

        Raises KeyboardInterrupt when a signal interrupted the wait, so Ctrl-C and a
        SIGTERM handler that raises end it.
        """
        if self._inotify is not None:
            if stop is None:
                return self._inotify.wait(timeout)
            # poll(2) cannot watch a threading.Event: look at it between short slices.
            deadline = time.monotonic() + timeout
            while not stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if self._inotify.wait(min(remaining, WATCH_STOP_CHECK_S)):
                    return True
            return False
        if self._notify is None:
            time.sleep(min(timeout, WATCH_POLL_DELAY_MS / 1000))
            return True
        timeout_ms = max(1, round(timeout * 1000))
        result = self._notify.watch(WATCH_DEBOUNCE_MS, WATCH_STEP_MS, timeout_ms, stop)
        if result == "signal":
            raise KeyboardInterrupt
        return isinstance(result, set)

    def close(self) -> None:
        """Stop watching: close the inotify descriptor or stop watchfiles' thread."""
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._notify is not None:
            self._notify.close()
            self._notify = None
