"""Child processes the library runs (a plan review, a responder's command).

Each runs in a session of its own, so a Ctrl-C at the parent's terminal stays the
parent's to handle. On Linux a small *keeper* (`ralph_mail._keeper`) stands between
the parent and the command: a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every
process the command starts, a daemon that left its session with ``setsid`` included,
stays below it. When the command exits, or the keeper gets SIGTERM (`end`), the keeper
kills what is left of that tree, reaps it, and exits with the command's status.
Elsewhere the command is the child itself, and `end` kills its process group.

A keeper is forked for each job by one server per process (`ralph_mail.keepers`), so a
job's start costs a fork, not a Python start (`prepare` starts the server ahead of the
first job; `close` ends it).

`communicate` reads what the command prints until it exits; after that, only a short
bounded drain: a background job that keeps the pipes open never holds the answer up.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Final, NamedTuple, Protocol

#: Whether commands run under a keeper (a subreaper needs Linux's prctl and /proc).
KEEPER: Final = sys.platform.startswith("linux")
#: How long the pipes are read after the command exited, for what is still in them (s).
DRAIN_S: Final = 0.5
#: The most read from a pipe in one go once the drain is over (bytes): what a pipe holds.
_LAST_READ: Final = 4 << 20
#: How long `end` waits for a keeper to clean up before killing its group outright (s).
_KEEPER_GRACE_S: Final = 5.0


class Finished(NamedTuple):
    """How a child ended: ``code`` (None: it ran past its time and was ended), the
    first ``limit`` bytes of its stdout, whether more came, the end of its stderr."""

    code: int | None
    out: bytes
    cut: bool
    err: bytes


class Child(Protocol):
    """A child as `communicate` and `end` use it: a `subprocess.Popen`, or a job's keeper
    forked by the keepers' server (`ralph_mail.keepers.Kept`)."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


def spawn(argv: Sequence[str], env: dict[str, str]) -> Child:
    """Start ``argv`` with pipes on its three streams, in a new session (under a keeper
    where there is one: see the module docstring)."""
    if not KEEPER:
        return subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env,
                                start_new_session=True)  # fmt: skip
    if any("\0" in text for text in (*argv, *env, *env.values())):
        raise ValueError("embedded null byte")  # as subprocess says it: nothing is run
    from ralph_mail import keepers

    return keepers.server().spawn(argv, env)


def prepare() -> None:
    """Start the keepers' server now rather than with the first job (Linux; else nothing)."""
    if KEEPER:
        from ralph_mail import keepers

        keepers.server()


def close() -> None:
    """End the keepers' server (the keepers of running jobs end with their jobs)."""
    if KEEPER:
        from ralph_mail import keepers

        keepers.close()


def kill_group(child: Child) -> None:
    """SIGKILL the child's process group (it leads it), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def stop(child: Child) -> None:
    """Tell ``child`` to end now, and everything it started, without waiting for it: its
    keeper kills the tree (SIGTERM), or, without a keeper, its process group is killed.
    Whoever waits on the child (`communicate`) sees it end and reaps it."""
    if KEEPER:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
    else:
        kill_group(child)


def end(child: Child) -> None:
    """End ``child`` and everything it started, and reap it: its keeper kills the tree
    (SIGTERM; its group is killed outright if it has not within a few seconds), or,
    without a keeper, its process group is killed."""
    if KEEPER and child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=_KEEPER_GRACE_S)
    kill_group(child)  # without a keeper, or one that did not answer
    child.wait()


def communicate(child: Child, stdin: bytes, timeout: float, limit: int, err_limit: int) -> Finished:
    """Feed ``stdin`` to ``child`` and read its output until it exits, ending it (and
    its tree) after ``timeout`` seconds. Keeps the first ``limit`` bytes of stdout and
    the last ``err_limit`` of stderr, reading the rest away so the child never blocks.
    Once the child has exited, the pipes are read for at most `DRAIN_S` more: what was
    printed is in them, and a background job holding them open is not waited for."""
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    stdout, stderr, writer = child.stdout.fileno(), child.stderr.fileno(), child.stdin.fileno()
    out, err = bytearray(), bytearray()
    total, err_limit = 0, max(1, err_limit)

    def keep(fd: int, chunk: bytes) -> None:
        nonlocal total
        if fd == stdout:
            total += len(chunk)
            out.extend(chunk[: max(0, limit - len(out))])
        else:
            err.extend(chunk)
            if len(err) > 2 * err_limit:
                del err[:-err_limit]

    def stop_feeding() -> None:
        if writer in selector.get_map():
            selector.unregister(writer)
        _close(child.stdin)

    code: int | None = None
    timed_out = False
    deadline = time.monotonic() + timeout
    drain_until: float | None = None  # set once the child has exited (or was ended)
    pending = memoryview(stdin)
    selector = selectors.DefaultSelector()
    waker = _pidfd(child.pid)
    try:
        for fd in (stdout, stderr):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        os.set_blocking(writer, False)
        selector.register(writer, selectors.EVENT_WRITE)
        if waker is not None:
            selector.register(waker, selectors.EVENT_READ)
        while stdout in selector.get_map() or stderr in selector.get_map():
            now = time.monotonic()
            if drain_until is None:
                code = child.poll()
                timed_out = code is None and now >= deadline
                if timed_out:
                    end(child)  # the command and its tree: the pipes close with them
                if code is not None or timed_out:
                    drain_until = now + DRAIN_S
                    stop_feeding()
                    if waker is not None:
                        selector.unregister(waker)
            elif now >= drain_until:
                break
            until = deadline if drain_until is None else drain_until
            step = until - now if waker is not None else min(until - now, 0.05)
            for key, _ in selector.select(max(0.0, step)):
                if key.fd == waker:
                    continue  # it exited: seen at the top of the loop
                if key.fd == writer:
                    with contextlib.suppress(BlockingIOError):
                        try:
                            pending = pending[os.write(writer, pending[: 1 << 16]) :]
                        except OSError:  # it stopped reading its input: fine
                            pending = pending[:0]
                    if not pending:
                        stop_feeding()
                    continue
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if chunk:
                    keep(key.fd, chunk)
                else:
                    selector.unregister(key.fd)
        for fd in (stdout, stderr):  # what is in the pipes now, and no more
            if fd in selector.get_map():
                read = 0
                with contextlib.suppress(OSError):
                    while read < _LAST_READ and (chunk := os.read(fd, 1 << 16)):
                        read += len(chunk)
                        keep(fd, chunk)
    finally:
        selector.close()
        if waker is not None:
            os.close(waker)
        for stream in (child.stdin, child.stdout, child.stderr):
            _close(stream)
    if drain_until is None:  # it closed its output and runs on
        try:
            code = child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end(child)
            timed_out = True
    return Finished(None if timed_out else code, bytes(out), total > limit,
                    bytes(err[-err_limit:]))  # fmt: skip


@contextlib.contextmanager
def report_file(prefix: str) -> Iterator[Path]:
    """An empty file (0600) for one job to write back to (its path goes in the job's
    environment), removed once the job is done."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix=prefix, suffix=".json")
    os.close(fd)
    try:
        yield Path(name)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def read_back(path: Path, limit: int) -> bytes:
    """What a job wrote to its `report_file`: at most ``limit + 1`` bytes (so a caller
    sees that it wrote too much), b"" when the file is gone."""
    try:
        with open(path, "rb") as file:
            return file.read(limit + 1)
    except FileNotFoundError:
        return b""


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def _close(stream: object) -> None:
    with contextlib.suppress(OSError):
        stream.close()  # type: ignore[attr-defined]
