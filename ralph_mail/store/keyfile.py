"""Private key files: one agent's signing key, kept on its own host, outside the team's
data (``$RALPH_KEYS``, else ``<home>/keys``, then ``<team>/<agent>.key``).

Whatever backend keeps the team's mail, a private key is a local file: on NATS the
server never sees it. The file is written whole or not at all (a temp file beside it,
mode 0600 from its creation, fsync, then a hard link that fails if the key exists, or a
rename with ``force``), and read by the process that signs, never passed to a child.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ralph_mail import settings
from ralph_mail.errors import MailError, StoreError


def root(home: str | os.PathLike[str] | None = None) -> Path:
    """Where the keys are kept: ``$RALPH_KEYS``, else ``keys`` under the home."""
    env = os.environ.get("RALPH_KEYS")
    return Path(env).expanduser() if env else settings.home(home) / "keys"


def path(team: str, agent: str, home: str | os.PathLike[str] | None = None) -> Path:
    """The private key file of ``agent`` in ``team`` (names are checked by the caller)."""
    return root(home) / team / f"{agent}.key"


def read(where: Path) -> bytes | None:
    """The key file's bytes, or None when there is none."""
    try:
        with open(where, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot read key file {where}: {exc.strerror or exc}") from None


def write(where: Path, data: bytes, *, force: bool = False) -> None:
    """Save a new key file, mode 0600, atomically; `MailError` when one exists and not
    ``force`` (the old key is kept)."""
    try:
        for folder in (where.parent.parent, where.parent):  # the root, the team's: 0700
            folder.mkdir(mode=settings.DIR_MODE, parents=True, exist_ok=True)
            if folder.stat().st_mode & 0o777 != settings.DIR_MODE:
                folder.chmod(settings.DIR_MODE)
        tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, settings.FILE_MODE)
        try:
            os.fchmod(fd, settings.FILE_MODE)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if force:
                os.replace(tmp, where)
            else:
                os.link(tmp, where)  # fails if a key is there: never half a key, never two
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except FileExistsError:
        raise MailError(
            f"a key exists at {where}: it was kept (--force replaces it, and messages "
            "signed with the old one then fail verification)"
        ) from None
    except OSError as exc:
        raise StoreError(f"cannot write key file {where}: {exc.strerror or exc}") from None
