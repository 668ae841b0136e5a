"""POSIX helpers of the file backend: private opens relative to a directory descriptor,
whole writes, atomic replacement, and turning an `OSError` into one `StoreError` line.

Every open is relative to a directory descriptor that was itself opened with
``O_NOFOLLOW``, so a symlink planted anywhere inside a team (its directory, ``mailbox/``,
an inbox, a cursor) is refused rather than followed, and a team deleted while a process
still holds it cannot be re-created by that process (a new entry in a deleted directory
fails with ENOENT). Opens are non-blocking and must find a regular file: a FIFO in place
of an inbox would otherwise swallow small sends and hang readers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import time

from ralph_mail.errors import StoreError
from ralph_mail.settings import DIR_MODE, FILE_MODE
from ralph_mail.store.spin import spin as spinning

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_FLAGS_BOTH = os.O_NOFOLLOW | os.O_CLOEXEC
#: This process's pid, renewed in a child after fork: kept descriptors compare it on
#: every send, where os.getpid() would be a system call each time.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def my_pid() -> int:
    """``os.getpid()``, without the system call (see `_PID`)."""
    return _PID[0]


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def store_error(exc: OSError, what: str, doing: str, fix: str = "") -> StoreError:
    """One line for an `OSError`: what was being done to which file, why, and the fix."""
    if isinstance(exc, StoreError):
        return exc
    if exc.errno == errno.ELOOP:
        return StoreError(f"{what} is a symlink: refusing to follow it; remove it", what)
    if exc.errno in (errno.ENOTDIR, errno.EISDIR) and not fix:
        fix = "it is not of the kind expected: remove or rename it"
    reason = exc.strerror or str(exc)
    return StoreError(f"cannot {doing} {what}: {reason}" + (f"; {fix}" if fix else ""), what)


def open_dir(name: str, dir_fd: int | None = None, *, create: bool = False) -> int:
    """A descriptor on directory ``name`` (relative to ``dir_fd``), never through a symlink.

    With ``create`` a missing directory is made 0700 first, whatever the umask.
    """
    if create:
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass
        else:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            os.fchmod(fd, DIR_MODE)
            return fd
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        # O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR: say what it is.
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(
            name if dir_fd is None else f"/proc/self/fd/{dir_fd}/{name}"
        ):
            raise StoreError(
                f"{name} is a symlink: refusing to follow it; remove it", name
            ) from None
        raise


def open_file(name: str, flags: int, dir_fd: int | None = None) -> int:
    """Open regular file ``name`` (relative to ``dir_fd``) without following a symlink.

    A file this call creates is 0600 whatever the umask. Anything but a regular file (a
    directory, a FIFO, a device) is refused with `StoreError`, and never blocks.
    """
    # O_NONBLOCK keeps a read-only or write-only open of a FIFO from blocking, and is
    # cleared once the file is known to be regular. An open for reading and writing
    # never blocks on a FIFO: it goes without, and without the fcntl that clears it (a
    # process woken from a long sleep pays tens of µs for each system call).
    both = flags & os.O_ACCMODE == os.O_RDWR
    fd = os.open(name, flags | (_FLAGS_BOTH if both else _FLAGS), FILE_MODE, dir_fd=dir_fd)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise StoreError(f"{name} is not a regular file: remove it", name)
        if flags & os.O_CREAT and status.st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        if not both:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data: bytes) -> None:
    """One write loop: a regular file may accept part of a buffer (a full disk, a limit)."""
    written = os.write(fd, data)
    if written == len(data):
        return
    view = memoryview(data)[written:]
    while view:
        view = view[os.write(fd, view) :]


def pread_all(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes from ``offset`` (fewer only at the end of the file)."""
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def read_file(name: str, dir_fd: int | None = None) -> bytes:
    """The whole of a small regular file."""
    fd = open_file(name, os.O_RDONLY, dir_fd)
    try:
        return pread_all(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def replace_file(name: str, data: bytes, dir_fd: int) -> None:
    """Replace ``name`` with ``data``: a temp file beside it, fsync, rename, fsync the dir.

    The temp file is ``.NAME.PID.tmp``, so `doctor` can tell a dead writer's leftover.
    """
    tmp = f".{name}.{os.getpid()}.tmp"
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def unlinked(fd: int) -> bool:
    """Whether the file or directory open on ``fd`` was deleted or replaced."""
    return os.fstat(fd).st_nlink == 0


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a temp file's writer, a lock holder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, Ctrl-Z) or traced."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def copy_range(source: int, target: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes of ``source`` from ``offset`` to the start of ``target``."""
    written = 0
    try:
        while written < length:
            copied = os.copy_file_range(source, target, length - written, offset + written)
            if not copied:
                break
            written += copied
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        while written < length:  # a file system without copy_file_range: copy by hand
            chunk = os.pread(source, min(length - written, 1 << 24), offset + written)
            if not chunk:
                break
            os.lseek(target, written, os.SEEK_SET)
            write_all(target, chunk)
            written += len(chunk)
    if written != length:
        raise StoreError(f"inbox shrank while it was copied ({written} of {length} bytes)")


#: What one read takes from a doorbell or a self-pipe (a byte is written per ring).
_DRAIN = 4096


def wait_readable(
    poller: select.poll, fd: int, timeout: float, also: tuple[int, ...] = (), spin: float = 0.0
) -> bool:
    """Block in ``poll(2)`` (``poller``, on which ``fd`` is registered) at most ``timeout``
    seconds, or until one of ``also`` (a stop flag's descriptors, left as they are) is
    readable; once ``fd``, a non-blocking pipe or FIFO, is readable, read it empty: True.
    ``spin``: poll without sleeping for that long first (see `ready`)."""
    if not ready(poller, fd, timeout, also, spin):
        return False
    # One read empties it: a fuller one is read again (a second read finding it empty would
    # cost a system call and an exception, at every wake-up).
    with contextlib.suppress(BlockingIOError):
        while len(os.read(fd, _DRAIN)) == _DRAIN:
            pass
    return True


def ready(
    poller: select.poll, fd: int, timeout: float, also: tuple[int, ...] = (), spin: float = 0.0
) -> bool:
    """Block in ``poll(2)`` at most ``timeout`` seconds; whether ``fd`` is readable (one
    of ``also`` readable ends the wait too, with False unless ``fd`` is as well).

    ``spin``: first look without sleeping, for that many seconds at most (and at most
    ``timeout``), so that what comes then wakes no sleeper (`ralph_mail.store.spin`)."""
    for other in also:
        poller.register(other, select.POLLIN)
    try:
        events = []
        if spin > 0:
            start = time.monotonic()
            events = spinning(lambda: poller.poll(0), min(spin, timeout))
            timeout -= time.monotonic() - start
        if not events:
            events = poller.poll(max(0, round(timeout * 1000)))
    finally:
        for other in also:
            poller.unregister(other)
    return any(got == fd for got, _ in events)
