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
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._closer = weakref.finalize(self, _close, self._read, self._write)

    def set(self) -> None:
        super().set()
        with contextlib.suppress(BlockingIOError, OSError):  # full: readable already
            os.write(self._write, b"!")

    def clear(self) -> None:
        # Empty the pipe first: a set() landing in between leaves a byte behind, which
        # wakes a wait for nothing (it looks, finds the flag clear, and waits again);
        # the other order could leave the flag set with the pipe empty.
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass
        super().clear()

    def filenos(self) -> tuple[int, ...]:
        """The descriptors a ``poll(2)`` watches for it: readable while it is set."""
        return (self._read,)

    def close(self) -> None:
        """Release the pipe (also done when the flag is collected)."""
        self._closer()


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def filenos_of(event: object) -> tuple[int, ...] | None:
    """The descriptors that become readable when ``event`` is set, or None when it
    offers none (a plain `threading.Event`: a wait must look at it between slices)."""
    filenos = getattr(event, "filenos", None)
    return None if filenos is None else tuple(filenos())
