"""Stopping a long-lived command (``lead``, ``run``) by Ctrl-C or SIGTERM.

The first signal sets a `Flag` the command's loop looks at (a wait given it ends at
once), and the command stops once what it has in hand is done; a second one, or one
while ``now()`` says so (a question waiting at the terminal), raises KeyboardInterrupt
at once. A KeyboardInterrupt raised wherever the process happens to be would be unsafe
for a command that promises exit 0 when stopped: one that escapes code ``exec`` runs
from a string (a dataclass being made while a module is imported late) marks the
interpreter, and CPython then ends the process by SIGINT at exit, though the command
caught the interrupt.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ralph_mail.store.flag import Flag

#: The signals that stop a long-lived command: Ctrl-C and SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _never() -> bool:
    return False


@contextmanager
def stopped_by_signals(now: Callable[[], bool] = _never) -> Iterator[Flag]:
    """For the block, `STOP_SIGNALS` set the flag it is given (see the module
    docstring); the handlers there were come back after.

    Example:
        >>> with stopped_by_signals() as stop:  # doctest: +SKIP
        ...     orch.run(stop=stop)
    """
    stop = Flag()

    def handler(signum: int, frame: object) -> None:
        if stop.is_set() or now():
            raise KeyboardInterrupt
        stop.set()

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
