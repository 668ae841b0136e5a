"""Storage: the seam every backend implements (`base`), the records written once over its
primitives (`records`), and the one factory that picks a backend from a URL (`backend`).

Nothing above this package imports a backend module: it asks `backend` for one. The
backends live in a folder each: ``files/`` (the default: JSONL inboxes under a home),
``nats/`` (NATS JetStream, the ``nats`` extra) and ``memory.py`` (one process's memory,
for tests and embedding).
"""

from __future__ import annotations

from pathlib import Path

from ralph_mail.errors import MailError
from ralph_mail.store.base import (
    Backend,
    Compaction,
    Cursor,
    Primitives,
    StopEvent,
    TeamStore,
    Waiter,
)


def backend(home: Path, url: str = "") -> Backend:
    """The backend ``url`` names (see `ralph_mail.settings.backend`): files under ``home``
    for ``""`` or ``file``, a place in this process's memory for ``memory://NAME``, a NATS
    JetStream server for ``nats://HOST:PORT`` (the ``nats`` extra)."""
    if url in ("", "file"):
        from ralph_mail.store.files import FileBackend

        return FileBackend(home)
    if url.startswith(("nats://", "tls://")):
        try:
            from ralph_mail.store.nats import NatsBackend
        except ImportError:
            raise MailError(
                f"backend {url!r} needs the nats extra: pip install 'ralph_mail[nats]'"
            ) from None
        return NatsBackend(url, home)
    if url.startswith("memory://") and len(url) > len("memory://"):
        from ralph_mail.store.memory import memory_backend

        return memory_backend(url[len("memory://") :])
    raise MailError(
        f"unknown backend {url!r}: use 'file' (the default), 'nats://HOST:PORT' or "
        "'memory://NAME'; "
        "set it with --backend or RALPH_BACKEND"
    )


def preload() -> None:
    """Import every backend this install can use (files; NATS with the ``nats`` extra),
    so that a process forked later finds them imported (the warm server: cli/forkserver)."""
    import ralph_mail.store.files

    try:
        import ralph_mail.store.nats  # noqa: F401
    except ImportError:  # no nats extra
        return


__all__ = [
    "Backend",
    "Compaction",
    "Cursor",
    "Primitives",
    "StopEvent",
    "TeamStore",
    "Waiter",
    "backend",
]
