"""What a store does while its server is away (a network backend's; files have none).

By default a round trip keeps trying for a bounded time (`ralph_mail.store.nats`: 10 s),
then raises: a one-off command fails in one line. A long-lived process (``ralph-mail
run``, ``ralph-mail wait``) is `patient` instead: its round trips keep trying, with a
growing pause (`BACKOFF_S` up to `BACKOFF_MAX_S`), until the server is back, the
patience's own deadline passes or its stop is set; it says so once when the server goes
away, and once when it is back (a server away again within `QUIET_S` of coming back is
the same outage, not said again).

One small piece of global state (the process's patience), guarded; `patient` sets it
for a block and puts the previous one back after.

Example:
    >>> with patient(say=print):                     # doctest: +SKIP
    ...     bus.wait_for_messages()                  # outlives a server restart
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from ralph_mail.store.base import StopEvent

#: The first pause before a round trip tries a server that went away again (s).
BACKOFF_S: Final = 0.2
#: The longest pause between two tries of a server that is away (s).
BACKOFF_MAX_S: Final = 5.0
#: How often a pause looks at the patience's stop (s).
_STOP_CHECK_S: Final = 0.05
#: A server away again this soon after it came back is the same outage (JetStream
#: still recovering after a restart): not said again (s).
QUIET_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class Patience:
    """How long this process outlasts a server that is away.

    Attributes:
        stop: once set, round trips stop trying (None: never set).
        until: a `time.monotonic` deadline after which they stop trying (None: none).
        say: called with one line when a server goes away and when it is back.
    """

    stop: StopEvent | None = None
    until: float | None = None
    say: Callable[[str], object] | None = None

    def lasts(self) -> bool:
        """Whether round trips should go on trying now."""
        if self.stop is not None and self.stop.is_set():
            return False
        return self.until is None or time.monotonic() < self.until


_lock = threading.Lock()
_current: Patience | None = None
_away: dict[str, bool] = {}  # the servers away now: whether that was said
_back_at: dict[str, float] = {}  # when each was last said to be back (monotonic)


@contextlib.contextmanager
def patient(
    stop: StopEvent | None = None,
    until: float | None = None,
    say: Callable[[str], object] | None = None,
) -> Iterator[Patience]:
    """For the block, this process's round trips outlast a server that is away (see the
    module docstring); the previous patience (none, by default) comes back after."""
    global _current
    mine = Patience(stop, until, say)
    with _lock:
        previous, _current = _current, mine
    try:
        yield mine
    finally:
        with _lock:
            _current = previous


def reset() -> None:
    """Forget the patience and the servers said to be away (for tests)."""
    global _current
    with _lock:
        _current = None
        _away.clear()
        _back_at.clear()


class Tries:
    """The tries of one round trip at a server that does not answer: until ``deadline``
    (a `time.monotonic` time) at short steps, as any round trip; past it, while the
    process is `patient`, with a growing pause, saying once that ``where`` is away."""

    def __init__(self, deadline: float, where: str) -> None:
        self.deadline, self.where = deadline, where
        self._pause = BACKOFF_S

    def again(self, why: str) -> bool:
        """Pause, then True to try again; False to give up (raise) now."""
        now = time.monotonic()
        if now + BACKOFF_S < self.deadline:
            time.sleep(BACKOFF_S)
            return True
        patience = _current
        if patience is None or not patience.lasts():
            return False
        with _lock:
            first = self.where not in _away
            if first:  # (said, unless it came back moments ago: the same outage)
                back = _back_at.get(self.where)
                _away[self.where] = first = back is None or now - back >= QUIET_S
        if first and patience.say is not None:
            patience.say(f"{self.where} is away ({why}): trying again until it is back")
        pause, self._pause = self._pause, min(self._pause * 2, BACKOFF_MAX_S)
        end = time.monotonic() + pause
        while time.monotonic() < end:
            if not patience.lasts():
                return False
            time.sleep(min(_STOP_CHECK_S, max(0.0, end - time.monotonic())))
        return patience.lasts()


def answered(where: str) -> None:
    """A round trip to ``where`` went through: say it is back if it was said away."""
    if where in _away:  # (a look without the lock: the common case costs nothing)
        with _lock:
            said = _away.pop(where, False)
            if said:
                _back_at[where] = time.monotonic()
            patience = _current
        if said and patience is not None and patience.say is not None:
            patience.say(f"{where} is back")
