"""The NATS store's writes made in the background: index entries and commit times, which
a caller need not wait for (the message they point at, the cursor they follow, are
stored already), made in the order they came on one thread of the process's own; a read
that must see them (`flush`) waits for them first. A store sends what it queued meanwhile
in one write (`Logs._send_out`). Cursors are not among them: a commit sends its cursor
on its own thread's connection, and reads the answer there (see `claims`).

The writes are spaced: the first after a quiet spell goes at once, and one that comes
sooner than `SPACING_S` after the last waits out the rest of it, gathering what comes
meanwhile. A busy process (a replier answering asks back to back) so makes a write every
few messages, not two for each: each write to the server costs both sides CPU time
that, on a small machine, the messages themselves wait for. A `flush` does not wait
for the spacing."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ralph_mail.store.nats.wire import REQUEST_S

#: The least time between two background writes while they keep coming (see above).
SPACING_S = 0.003

#: Writes this process has under way in the background (index entries, commit times),
#: made in order on one thread of their own.
_PENDING: list[concurrent.futures.Future[Any]] = []
_PENDING_LOCK = threading.Lock()


class _Background:
    """One daemon thread making writes in the order they came, spaced (see above). Not
    an executor's: at exit the interpreter would wait for every write still queued (10 s
    each, with the server away); what `close` did not see done is left, as a crash
    would leave it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hurry = threading.Condition()
        self._hurried = 0  # flushes waiting: no spacing meanwhile
        self._last: float | None = None  # when the last write ended (monotonic)

    def submit(self, write: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, lambda: write(*args)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ralph-nats-write",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        return future

    @contextlib.contextmanager
    def hurried(self) -> Iterator[None]:
        """No spacing while the block runs (a `flush` waiting)."""
        with self._hurry:
            self._hurried += 1
            self._hurry.notify_all()
        try:
            yield
        finally:
            with self._hurry:
                self._hurried -= 1

    def _spaced(self) -> None:
        """Wait out `SPACING_S` after the last write, unless a flush waits."""
        if self._last is None:
            return
        due = self._last + SPACING_S
        with self._hurry:
            self._hurry.wait_for(lambda: self._hurried > 0 or time.monotonic() >= due,
                                 max(0.0, due - time.monotonic()))  # fmt: skip

    def _run(self) -> None:
        while True:
            future, write = self._queue.get()
            self._spaced()
            try:
                future.set_result(write())
            except BaseException as exc:
                future.set_exception(exc)
            self._last = time.monotonic()


_BACKGROUND = _Background()


def _forked() -> None:
    """A child starts with no writes of its parent's (their thread did not come along)."""
    global _BACKGROUND, _PENDING_LOCK
    _BACKGROUND, _PENDING_LOCK = _Background(), threading.Lock()
    _PENDING.clear()


os.register_at_fork(after_in_child=_forked)


def pending_lock() -> threading.Lock:
    """The lock of what is under way (a child's own after a fork): it also guards the
    index entries a store has queued for its next write."""
    return _PENDING_LOCK


def later(write: Callable[..., Any], *args: Any) -> None:
    """Make ``write(*args)`` on the process's background thread, after the writes
    started before it; `flush` waits for it."""
    with _PENDING_LOCK:
        _PENDING[:] = [future for future in _PENDING if not future.done()]
        _PENDING.append(_BACKGROUND.submit(write, *args))


def flush() -> None:
    """Wait for the writes this process is still making in the background (any store's:
    a bus reads what another bus of the process wrote, as on files)."""
    with _PENDING_LOCK:
        pending, _PENDING[:] = list(_PENDING), []
        background = _BACKGROUND
    deadline = time.monotonic() + REQUEST_S  # for them all (a server away: not each)
    with background.hurried():
        for future in pending:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                import warnings

                why = str(exc) or f"not done within {REQUEST_S:g} s"
                warnings.warn(f"a background write failed ({why}): an index entry or a "
                              "commit time is missing (history, threads or a receipt may "
                              "miss it)", RuntimeWarning, stacklevel=3)  # fmt: skip
