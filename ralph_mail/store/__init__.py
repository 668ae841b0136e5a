"""Storage: the interface every backend implements (`base`), and the file backend.

The file backend is split by concern: ``layout`` (where a team's files live, teams made
and removed), ``inbox`` (the inbox log), ``slots`` (the slot file behind cursors and
bases), ``posix`` (opens, writes, errors), ``watch`` (waking on file events), and
``files`` (`FileStore` and `FileBackend`, which put them together).
"""

from __future__ import annotations

from pathlib import Path

from ralph_mail.errors import MailError
from ralph_mail.store.base import Backend, Compaction, Cursor, TeamStore, Waiter
from ralph_mail.store.files import FileBackend, FileStore
from ralph_mail.store.inbox import InboxState
from ralph_mail.store.layout import teams_dir
from ralph_mail.store.posix import pid_alive, pid_stopped
from ralph_mail.store.watch import StopEvent


def backend(home: Path, url: str = "") -> Backend:
    """The backend ``url`` names (see `ralph_mail.settings.backend`): files under ``home``
    for ``""`` or ``file``, a place in this process's memory for ``memory://NAME``, a NATS
    JetStream server for ``nats://HOST:PORT`` (the ``nats`` extra)."""
    if url in ("", "file"):
        return FileBackend(home)
    if url.startswith(("nats://", "tls://")):
        try:
            from ralph_mail.store.nats import NatsBackend
        except ImportError:
            raise MailError(
                f"backend {url!r} needs the nats extra: pip install 'ralph_mail[nats]'"
            ) from None
        return NatsBackend(url)
    if url.startswith("memory://") and len(url) > len("memory://"):
        from ralph_mail.store.memory import memory_backend

        return memory_backend(url[len("memory://") :])
    raise MailError(
        f"unknown backend {url!r}: use 'file' (the default), 'nats://HOST:PORT' or "
        "'memory://NAME'; "
        "set it with --backend or RALPH_BACKEND"
    )


__all__ = [
    "Backend",
    "Compaction",
    "Cursor",
    "FileBackend",
    "FileStore",
    "InboxState",
    "StopEvent",
    "TeamStore",
    "Waiter",
    "backend",
    "pid_alive",
    "pid_stopped",
    "teams_dir",
]
