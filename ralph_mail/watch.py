"""Blocking until a team's mailbox directory changes, with watchfiles.

An event is only a hint that something *may* have changed: the caller always reads to
the end of its inbox afterwards, because N appends can arrive as one event and an event
can be lost (a full inotify queue). The waiter also wakes at least every
`WATCH_SAFETY_POLL_S` seconds for the same reason.

The whole directory is watched, not the inbox file, so that an inbox replaced by gc
(a new inode) keeps waking its reader.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from watchfiles._rust_notify import RustNotify

from ralph_mail.settings import WATCH_DEBOUNCE_MS, WATCH_POLL_DELAY_MS, WATCH_STEP_MS


class StopEvent(Protocol):
    """Anything with ``is_set()``, such as `threading.Event`: a wait returns when it is set."""

    def is_set(self) -> bool: ...


def _force_polling() -> bool:
    value = os.environ.get("WATCHFILES_FORCE_POLLING", "")
    return bool(value) and value.lower() not in {"false", "disable", "disabled", "0"}


def _notify(cls: type[RustNotify], directory: Path, polling: bool) -> RustNotify:
    # Arguments: paths, debug, force_polling, poll_delay_ms, recursive, ignore_permission_denied.
    return cls([str(directory)], False, polling, WATCH_POLL_DELAY_MS, False, False)


class Watcher:
    """Wakes when anything in ``directory`` changes; started at construction.

    Changes that happen between two `wait` calls are kept (in watchfiles' Rust thread)
    and reported by the next call, so nothing that arrives while the caller reads is
    missed. Falls back to polling, with a warning, when file events are unavailable.

    Example:
        >>> w = Watcher(Path("/tmp"))             # doctest: +SKIP
        >>> w.wait(1.0)                           # doctest: +SKIP
        True
    """

    def __init__(self, directory: Path) -> None:
        from watchfiles._rust_notify import RustNotify  # 30 ms of import, only for waiters

        self.polling = _force_polling()
        self._notify: RustNotify | None
        try:
            self._notify = _notify(RustNotify, directory, self.polling)
        except Exception as exc:  # inotify watch or instance limit reached, or no inotify
            if self.polling:
                raise
            warnings.warn(
                f"file events unavailable for {directory} ({exc}); polling every "
                f"{WATCH_POLL_DELAY_MS} ms instead. Raise fs.inotify.max_user_watches or "
                "max_user_instances to restore instant wake-ups",
                RuntimeWarning,
                stacklevel=3,
            )
            self.polling = True
            try:
                self._notify = _notify(RustNotify, directory, True)
            except Exception:
                self._notify = None  # last resort: plain timed polling in wait()

    def wait(self, timeout: float, stop: StopEvent | None = None) -> bool:
        """Block until a change, ``timeout`` seconds or ``stop``; True when something changed.

        Raises KeyboardInterrupt when a signal interrupted the wait (watchfiles checks
        for signals between its steps, so Ctrl-C and SIGTERM handlers still run).
        """
        if self._notify is None:
            time.sleep(min(timeout, WATCH_POLL_DELAY_MS / 1000))
            return True
        timeout_ms = max(1, round(timeout * 1000))
        result = self._notify.watch(WATCH_DEBOUNCE_MS, WATCH_STEP_MS, timeout_ms, stop)
        if result == "signal":
            raise KeyboardInterrupt
        return isinstance(result, set)

    def close(self) -> None:
        """Stop the watching thread."""
        if self._notify is not None:
            self._notify.close()
            self._notify = None
