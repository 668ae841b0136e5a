"""A stop event a waiter's ``poll(2)`` can wait on.

A `threading.Event` cannot be polled: a wait given one had to look at it between
slices, so an idle ``ralph-mail run`` woke about five times a second to learn that
nobody had stopped it. A `Flag` is a `threading.Event` whose ``set`` also writes a
byte to a pipe: the file store's waiters poll that pipe beside their doorbell or
inotify descriptor, so a set flag ends a wait at once and an idle wait sleeps until
mail, its safety poll or its deadline.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ralph_mail.store.base import StopEvent


class Flag(threading.Event):
    """A `threading.Event` with `filenos`: descriptors that are readable while it is set.

    Example:
        >>> flag = Flag()
        >>> flag.set()
        >>> import select; bool(select.select(flag.filenos(), [], [], 0)[0])
        True
        >>> flag.clear(); bool(select.select(flag.filenos(), [], [], 0)[0])
        False
    """

    def __init__(self) -> None:
        super().__init__()
        self._fds = list(os.pipe())  # [read, write]; -1 once closed
        for fd in self._fds:
            os.set_blocking(fd, False)
        self._closer = weakref.finalize(self, _close, self._fds)

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # full (readable already), or closed
            if self._fds[1] >= 0:
                os.write(self._fds[1], b"!")

    def clear(self) -> None:
        # Empty the pipe first: a set() landing in between leaves a byte behind, which
        # wakes a wait for nothing (it looks, finds the flag clear, and waits again);
        # the other order could leave the flag set with the pipe empty.
        with contextlib.suppress(OSError):
            while self._fds[0] >= 0 and os.read(self._fds[0], 4096):
                pass
        super().clear()

    def filenos(self) -> tuple[int, ...]:
        """The descriptors a ``poll(2)`` watches for it: readable while it is set."""
        return (self._fds[0],) if self._fds[0] >= 0 else ()

    def close(self) -> None:
        """Release the pipe (also done when the flag is collected); a closed flag still
        sets and clears, only no poll can watch it."""
        self._closer()


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds[:] = [-1, -1]


class Either:
    """Set when either event is (``one`` may be None): a wait ends on either. When both
    offer descriptors (`Flag`), so does it: a waiter polls them all."""

    def __init__(self, one: StopEvent | None, other: Flag) -> None:
        self._one, self._other = one, other
        fds = () if one is None else filenos_of(one)
        if fds is not None:
            self.filenos = lambda: (*fds, *other.filenos())

    def is_set(self) -> bool:
        return self._other.is_set() or (self._one is not None and self._one.is_set())


def filenos_of(event: object) -> tuple[int, ...] | None:
    """The descriptors that become readable when ``event`` is set, or None when it
    offers none (a plain `threading.Event`: a wait must look at it between slices)."""
    filenos = getattr(event, "filenos", None)
    return None if filenos is None else tuple(filenos())
