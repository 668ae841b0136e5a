"""Child processes the library runs (a plan review, a responder's command): each in a
session of its own, so a timeout kills its whole group (a pipeline, a daemon it forked)
and a Ctrl-C at the parent's terminal stays the parent's to handle."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence


def spawn(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` with pipes on its three streams, in a new session."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it leads it), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
