"""A team store's maintenance: gc under the team's ``gc.lock``, and the temp files that
killed runs left behind."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ralph_mail.errors import LockTimeout, StoreError
from ralph_mail.store.base import Compaction
from ralph_mail.store.files.logs import Logs
from ralph_mail.store.files.posix import pid_alive, store_error


class Maintenance(Logs):
    """gc of a team's logs (mixed into `FileStore`)."""

    @contextlib.contextmanager
    def maintenance_lock(self, timeout: float) -> Iterator[None]:
        """Hold the team's ``gc.lock`` (filelock) for a maintenance run; `LockTimeout` after
        ``timeout`` seconds.

        filelock is right here and not on the send path: it costs 49 µs per acquire against
        0.6 µs for a raw flock, which only matters per message. The lock file is never
        unlinked: unlinking a locked file would split waiters across two inodes.
        """
        from filelock import FileLock, Timeout

        path = self.dirs.path("gc.lock")
        self.dirs.root_fd()  # the team exists and is no symlink
        if path.is_symlink():
            raise StoreError(f"{path} is a symlink: refusing to follow it; remove it", path)
        lock = FileLock(path, timeout=timeout, mode=0o600, preserve_lock_file=True)
        try:
            lock.acquire()
        except Timeout:
            raise LockTimeout(
                f"another gc of this team holds {path} (waited {timeout:g} s): "
                "let it finish, or find it with 'ralph-mail doctor'",
                path,
            ) from None
        except OSError as exc:
            raise store_error(exc, str(path), "take the gc lock") from None
        try:
            yield
        finally:
            lock.release()

    def collect(
        self, logs: list[str], min_bytes: int, drop_before: str | None, timeout: float
    ) -> tuple[tuple[Compaction, ...], tuple[Path, ...]]:
        """gc under the team's ``gc.lock``: the temp files of killed runs go, then each
        log is compacted (each under its own lock, waited for briefly)."""
        from ralph_mail import settings

        removed: list[Path] = []
        with self.maintenance_lock(timeout):
            for path in self.stale_temp_files():
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path)
            wait = settings.GC_INBOX_LOCK_WAIT_S
            compactions = tuple(
                self.compact(log, min_bytes, timeout=wait, drop_before=drop_before) for log in logs
            )
        return compactions, tuple(removed)

    def stale_temp_files(self) -> list[Path]:
        """Temp files (``.NAME.PID.gc`` or ``.tmp``) whose writer died before its rename."""
        stale = []
        for sub in ("tmp", "bases", "cursors", "state"):
            try:
                names = sorted(os.listdir(self.dirs.path(sub)))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise store_error(exc, str(self.dirs.path(sub)), "list") from None
            for name in names:
                parts = name.rsplit(".", 2)
                if not name.startswith(".") or len(parts) < 3 or parts[2] not in ("gc", "tmp"):
                    continue
                if not (parts[1].isdigit() and pid_alive(int(parts[1]))):
                    stale.append(self.dirs.path(sub, name))
        return stale
