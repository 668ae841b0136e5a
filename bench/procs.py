"""Child processes for the cross-process measurements: spawn, handshake, start gun, reap.

Writers and waiters are real processes started with ``python -m bench.child``, not
threads, because the GIL would serialise exactly what is being measured. Every wait
on a child is bounded, and :func:`running` always reaps, so a stuck child never
outlives the bench.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from bench.common import child_env

#: How long a child may take to start (imports on a loaded 2-core machine).
START_TIMEOUT_S: Final = 60.0
#: Grace period for a child to exit on its own before it is killed.
EXIT_TIMEOUT_S: Final = 30.0


class ChildError(RuntimeError):
    """A child did not answer in time or said something unexpected."""


class Child:
    """One ``python -m bench.child`` process with a line protocol on its stdout."""

    def __init__(self, args: Sequence[str], pass_fds: Sequence[int] = ()) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.child", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            pass_fds=tuple(pass_fds),
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buf = b""

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def readline(self, timeout: float) -> str:
        """The next line the child prints, waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"child {self.args[0]} said nothing for {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    raise ChildError(f"child {self.args[0]} exited: {self.stderr_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def expect(self, word: str, timeout: float = START_TIMEOUT_S) -> str:
        """Read one line that must start with ``word``; return the rest of it."""
        line = self.readline(timeout)
        head, _, rest = line.partition(" ")
        if head != word:
            raise ChildError(f"child {self.args[0]} said {line!r}, expected {word!r}")
        return rest

    def stderr_tail(self) -> str:
        """The end of the child's stderr, once it has exited (for error messages)."""
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")[-800:]

    def cpu_sample(self) -> CpuSample:
        """The child's CPU time so far, for `cpu_between`."""
        with open(f"/proc/{self.pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        threads: dict[str, int] = {}
        try:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{tid}/schedstat", "rb") as f:
                    threads[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            threads = {}
        return CpuSample(ticks / os.sysconf("SC_CLK_TCK"), threads)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU used by a process so far: ``coarse`` seconds from /proc/<pid>/stat (all threads,
    even ended ones, in 10 ms ticks) and ``threads``, ns per live thread from schedstat.
    """

    coarse: float
    threads: dict[str, int]


def cpu_between(before: CpuSample, after: CpuSample) -> float:
    """CPU seconds used between two samples, as precisely as the samples allow.

    Per-thread schedstat is exact to the ns, but forgets a thread that ended; so it is used
    when the same threads lived through the window, and the 10 ms-tick total otherwise.
    """
    if before.threads and before.threads.keys() == after.threads.keys():
        return sum(after.threads[t] - before.threads[t] for t in after.threads) / 1e9
    return after.coarse - before.coarse


class StartGun:
    """Release many children at the same instant.

    Each child blocks reading a pipe; closing the only write end gives every one of
    them EOF at once. No polling, no sleep, and a child that dies early cannot hang
    the others.
    """

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    def fire(self) -> None:
        """Let every child go."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1

    def close(self) -> None:
        """Release both ends (firing if not yet fired)."""
        self.fire()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


def reap(children: Sequence[Child], timeout: float = EXIT_TIMEOUT_S) -> None:
    """Wait for every child up to ``timeout`` in total, then kill what is left."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.send_signal(signal.SIGKILL)
            child.proc.wait()
        for stream in (child.proc.stdout, child.proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def running(children: list[Child], timeout: float = EXIT_TIMEOUT_S) -> Iterator[list[Child]]:
    """Yield the list the caller fills with children; always reap them on the way out.

    On an error the children are killed at once: they may be blocked on a start gun
    or a message that will never come.
    """
    try:
        yield children
    except BaseException:
        reap(children, 0.0)
        raise
    reap(children, timeout)
