"""Spinning before sleeping: a wait that expects its answer within microseconds looks
for it without sleeping first, because a process put to sleep and woken again pays for
it twice (see `ralph_mail.settings.SPIN_US`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final, TypeVar

_T = TypeVar("_T")

#: How long a spin runs before it checks that it had its core to itself (s).
FAIR_AFTER_S: Final = 50e-6


def spin(look: Callable[[], _T], seconds: float) -> _T:
    """Call ``look`` until it answers something true, for ``seconds`` at most; its last
    answer. Between looks the core is offered to anything else that wants it, and the
    spin ends once this thread got less than half of its core: it never takes a core
    that others are waiting for."""
    found = look()
    if found or seconds <= 0:
        return found
    start, used = time.monotonic(), time.thread_time()
    end = start + seconds
    while not found and (now := time.monotonic()) < end:
        spent = now - start
        if spent > FAIR_AFTER_S and time.thread_time() - used < spent / 2:
            break  # others want this core: sleep
        os.sched_yield()
        found = look()
    return found
