"""Child processes the library runs (a plan review, a responder's command).

Each runs in a session of its own, so a Ctrl-C at the parent's terminal stays the
parent's to handle. On Linux a small *keeper* (`ralph_mail._keeper`) stands between
the parent and the command: a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every
process the command starts, a daemon that left its session with ``setsid`` included,
stays below it. When the command exits, or the keeper gets SIGTERM (`end`), the keeper
kills what is left of that tree, reaps it, and exits with the command's status.
Elsewhere the command is the child itself, and `end` kills its process group.

A keeper costs a Python start (18 ms), so keepers are started ahead of the jobs: `spawn`
hands the command to a keeper already waiting for it and starts another, which boots
while the job runs (`prepare` starts them; `close` ends those still waiting).

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
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NamedTuple

#: Whether commands run under a keeper (a subreaper needs Linux's prctl and /proc).
KEEPER: Final = sys.platform.startswith("linux")
#: How long the pipes are read after the command exited, for what is still in them (s).
DRAIN_S: Final = 0.5
#: The most read from a pipe in one go once the drain is over (bytes): what a pipe holds.
_LAST_READ: Final = 4 << 20
#: How long `end` waits for a keeper to clean up before killing its group outright (s).
_KEEPER_GRACE_S: Final = 5.0

#: The keeper's script (run by path, so ``ps`` shows it and the command it keeps).
_KEEPER_SCRIPT: Final = str(Path(__file__).with_name("_keeper.py"))


class Finished(NamedTuple):
    """How a child ended: ``code`` (None: it ran past its time and was ended), the
    first ``limit`` bytes of its stdout, whether more came, the end of its stderr."""

    code: int | None
    out: bytes
    cut: bool
    err: bytes


def spawn(argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` with pipes on its three streams, in a new session (under a keeper
    where there is one: see the module docstring)."""
    if not KEEPER:
        return _start(list(argv), env)
    if any("\0" in text for text in (*argv, *env, *env.values())):
        raise ValueError("embedded null byte")  # as subprocess says it: nothing is run
    with _lock:
        child, control = _waiting.popleft() if _waiting else _start_keeper()
    try:
        import orjson

        os.write(control, orjson.dumps({"argv": list(argv), "env": env}))
    finally:
        os.close(control)  # the keeper reads to the end: this is the end
    prepare()  # the next one boots while this job runs
    return child


def prepare() -> None:
    """Have `WAITING` keepers started ahead of the next jobs (Linux; else nothing)."""
    if KEEPER:
        with _lock:
            while len(_waiting) < WAITING:
                _waiting.append(_start_keeper())


def close() -> None:
    """End the keepers waiting for a job (each exits when it finds no request)."""
    with _lock:
        waiting = list(_waiting)
        _waiting.clear()
    for child, control in waiting:
        os.close(control)
        for stream in (child.stdin, child.stdout, child.stderr):
            _close(stream)
        child.wait()


#: The keepers started ahead of the next jobs, each with the descriptor its request goes
#: to: two, so that jobs coming one after another each find one that has booted.
WAITING: Final = 2
_waiting: deque[tuple[subprocess.Popen[bytes], int]] = deque()
_lock = threading.Lock()


def _forget_in_child() -> None:
    # A forked child must not hand its parent's keepers a job, nor keep them from seeing
    # the end of their request: it lets go of the descriptors, and starts its own.
    global _lock
    for _, control in _waiting:
        with contextlib.suppress(OSError):
            os.close(control)
    _waiting.clear()
    _lock = threading.Lock()


if KEEPER:
    os.register_at_fork(after_in_child=_forget_in_child)
    import atexit

    atexit.register(close)


def _start_keeper() -> tuple[subprocess.Popen[bytes], int]:
    read, write = os.pipe()
    try:
        child = _start([sys.executable, "-I", "-S", _KEEPER_SCRIPT, "--from-fd", str(read)],
                       None, (read,))  # fmt: skip
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return child, write


def _start(
    args: list[str], env: dict[str, str] | None, keep: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        pass_fds=keep,
    )


def kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it leads it), if anything of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def end(child: subprocess.Popen[bytes]) -> None:
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


def communicate(
    child: subprocess.Popen[bytes], stdin: bytes, timeout: float, limit: int, err_limit: int
) -> Finished:
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
