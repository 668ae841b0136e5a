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

The whole directory is watched, not the inbox file, so that an inbox replaced by gc
(a new inode) keeps waking its reader.
"""

from __future__ import annotations

import os
import select
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ralph_mail.settings import (
    WATCH_DEBOUNCE_MS,
    WATCH_POLL_DELAY_MS,
    WATCH_STEP_MS,
    WATCH_STOP_CHECK_S,
)

if TYPE_CHECKING:
    from watchfiles._rust_notify import RustNotify


class StopEvent(Protocol):
    """Anything with ``is_set()``, such as `threading.Event`: a wait returns when it is set."""

    def is_set(self) -> bool: ...


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


class _Inotify:
    """One inotify descriptor watching one directory, waited on with poll(2)."""

    def __init__(self, directory: Path) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        init, add_watch = libc.inotify_init1, libc.inotify_add_watch  # AttributeError: none
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"inotify_init1: {os.strerror(error)}")
        if add_watch(fd, os.fsencode(directory), _MASK) < 0:
            error = ctypes.get_errno()
            os.close(fd)
            raise OSError(error, f"inotify_add_watch: {os.strerror(error)}", str(directory))
        self.fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._finalizer = weakref.finalize(self, os.close, fd)

    def wait(self, timeout: float) -> bool:
        # A signal whose handler raises (Ctrl-C, the lead's SIGTERM) ends poll() with that
        # exception; one whose handler returns lets poll() go on (PEP 475).
        if not self._poller.poll(max(0, round(timeout * 1000))):
            return False
        try:
            while os.read(self.fd, 65536):  # drain: one wake-up per batch of events
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        self._finalizer()


def _notify(cls: type[RustNotify], directory: Path, polling: bool) -> RustNotify:
    # Arguments: paths, debug, force_polling, poll_delay_ms, recursive, ignore_permission_denied.
    return cls([str(directory)], False, polling, WATCH_POLL_DELAY_MS, False, False)


class Watcher:
    """Wakes when anything in ``directory`` changes; started at construction.

    Changes that happen between two `wait` calls are kept (in the kernel's inotify queue,
    or watchfiles' Rust thread) and reported by the next call, so nothing that arrives
    while the caller reads is missed. Falls back to polling, with a warning, when file
    events are unavailable (the inotify watch or instance limit is reached).

    Example:
        >>> w = Watcher(Path("/tmp"))             # doctest: +SKIP
        >>> w.wait(1.0)                           # doctest: +SKIP
        True
    """

    def __init__(self, directory: Path) -> None:
        self.polling = _force_polling()
        self._inotify: _Inotify | None = None
        self._notify: RustNotify | None = None
        if not self.polling:
            try:
                self._inotify = _Inotify(directory)
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
            self._notify = _notify(RustNotify, directory, self.polling)
            return
        except Exception as exc:
            if self.polling:
                self._notify = None  # last resort: plain timed polling in wait()
                return
            self._warn(directory, exc)
        try:
            self._notify = _notify(RustNotify, directory, True)
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
