"""Many waiting agents on one host: ``python -m bench.hive SPEC`` forks one process per agent.

The hive imports ralph_mail once, then forks each agent from it, so a thousand agents
share the interpreter's pages (copy-on-write) and start in seconds; each child is a
process of its own with its own bus and waiter, as a separately started agent would be.

SPEC (JSON): ``kind`` "ralph" (each child waits in ``MessageBus.wait_for_messages``) or
"pipe" (each child blocks reading its own FIFO: the kernel's wake-up floor for the same
number of processes), ``agents`` (names), ``home`` and ``team`` (ralph), ``fifos`` (a
directory, pipe); optional for ralph: ``tree`` (a checkout whose ralph_mail the hive
imports, for `bench.builds`), ``busy_us`` (CPU µs each agent spends on a message before
it waits again), ``cpu`` (the one CPU the agents run on). Each child prints on the
hive's stdout, one line per ``os.write`` (whole lines up to PIPE_BUF never interleave):

- ``ready I PID`` once it waits (its waiter made);
- ``lat I NS`` for each message: its CLOCK_MONOTONIC minus the stamp the message carries;
- the child exits on the message ``stop``.

The hive exits once every child has; kill its process group to end it early. The
parent's side is `Hive`; `counters` and `memory` read what the agents did from /proc.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

#: The directory the hive runs from (``-m bench.hive`` finds the package there).
ROOT = Path(__file__).resolve().parent.parent


def _say(line: str) -> None:
    os.write(1, line.encode() + b"\n")


def _ralph_agent(index: int, spec: dict[str, object]) -> None:
    from ralph_mail import MessageBus

    if spec.get("cpu") is not None:
        os.sched_setaffinity(0, {int(spec["cpu"])})  # type: ignore[call-overload]
    busy_ns = int(spec.get("busy_us", 0)) * 1000  # type: ignore[call-overload]
    bus = MessageBus(str(spec["team"]), str(spec["agents"][index]), home=str(spec["home"]))  # type: ignore[index]
    bus.wait_for_messages(timeout=0.001)  # the waiter starts here
    _say(f"ready {index} {os.getpid()}")
    while True:
        for message in bus.wait_for_messages(timeout=None):
            now = time.monotonic_ns()
            if message.content == "stop":
                return
            _say(f"lat {index} {now - int(message.content)}")
            until = time.thread_time_ns() + busy_ns
            while time.thread_time_ns() < until:  # the work an agent does with its mail
                pass


def _pipe_agent(index: int, spec: dict[str, object]) -> None:
    path = os.path.join(str(spec["fifos"]), f"{index}.fifo")
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR)  # a reader for as long as it lives; blocking reads
    _say(f"ready {index} {os.getpid()}")
    while True:
        data = os.read(fd, 64)
        now = time.monotonic_ns()
        if data.startswith(b"stop"):
            return
        _say(f"lat {index} {now - int(data.split()[0])}")


def _warm_up() -> None:
    """Wait once on a throwaway team, so that every module a waiting agent imports is
    imported before the forks and shared by all of them (copy-on-write)."""
    import shutil

    from ralph_mail import MessageBus, create_team

    home = tempfile.mkdtemp(prefix="ralph-hive-")
    try:
        create_team("warm", ["a", "b"], home=home)
        bus = MessageBus("warm", "a", home=home)
        bus.wait_for_messages(timeout=0.001)
        bus.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str]) -> int:
    """Fork one waiting agent per name in SPEC; wait for them all."""
    spec = orjson.loads(argv[0])
    import resource  # the agents live under the default limit of descriptors, 1,024

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    agent = _ralph_agent if spec["kind"] == "ralph" else _pipe_agent
    if spec.get("tree"):
        sys.path.insert(0, spec["tree"])  # before the checkout the hive runs from
    if spec["kind"] == "ralph":
        _warm_up()
    children = []
    for index in range(len(spec["agents"])):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                agent(index, spec)
            except BaseException as exc:  # a child must never return into the hive's loop
                sys.stderr.write(f"agent {index}: {type(exc).__name__}: {exc}\n")
                code = 1
            os._exit(code)
        children.append(pid)
    failed = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return 1 if failed else 0


class Hive:
    """The parent's side: start a hive, read its agents' lines, kill it whole.

    Example:
        >>> with Hive({"kind": "pipe", "agents": ["a", "b"], "fifos": "/tmp/f"}) as hive:
        ...     pids = hive.ready(60.0)          # doctest: +SKIP
    """

    def __init__(self, spec: Mapping[str, object], env: Mapping[str, str] | None = None) -> None:
        self.size = len(spec["agents"])  # type: ignore[arg-type]
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hive", orjson.dumps(spec).decode()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            cwd=ROOT,
            env=None if env is None else dict(env),
            start_new_session=True,  # its own process group: killed whole by close()
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buffer = b""
        self.pids: dict[int, int] = {}

    def __enter__(self) -> Hive:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def line(self, timeout: float) -> list[str]:
        """The next line any agent printed, split in words."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"the hive said nothing for {timeout:.0f} s{self.errors()}")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise RuntimeError(f"the hive exited{self.errors()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().split()

    def ready(self, timeout: float) -> dict[int, int]:
        """Wait until every agent waits; its index -> pid."""
        deadline = time.monotonic() + timeout
        while len(self.pids) < self.size:
            words = self.line(deadline - time.monotonic())
            if words[0] == "ready":
                self.pids[int(words[1])] = int(words[2])
        return self.pids

    def latency(self, timeout: float) -> tuple[int, int]:
        """The next wake-up an agent reported: (its index, ns from the stamp)."""
        words = self.line(timeout)
        if words[0] != "lat":
            raise RuntimeError(f"unexpected line from the hive: {' '.join(words)}")
        return int(words[1]), int(words[2])

    def errors(self) -> str:
        """What the agents said on stderr (for a failure's message)."""
        self._errors.seek(0)
        text = self._errors.read()[-600:].decode(errors="replace")
        return f": {text}" if text else ""

    def close(self) -> None:
        """Kill the hive and every agent (its process group), and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._errors.close()


@dataclass(frozen=True, slots=True)
class Counters:
    """What one process did so far, from /proc: ``cpu_ns`` on a CPU (schedstat) and
    ``wakeups``, the times it blocked and was woken (voluntary context switches)."""

    cpu_ns: int
    wakeups: int


def counters(pids: Sequence[int]) -> dict[int, Counters]:
    """Each live process's CPU time and wake-ups (all its threads)."""
    found = {}
    for pid in pids:
        cpu = woken = 0
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    cpu += int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
                    for row in f:
                        if row.startswith(b"voluntary_ctxt_switches:"):
                            woken += int(row.split()[1])
            found[pid] = Counters(cpu, woken)
    return found


def memory(pid: int) -> tuple[float, float]:
    """A process's resident set and the part of it that is its own (MiB): VmRSS, and
    Private_Clean + Private_Dirty from smaps_rollup (what it costs beside the others)."""
    rss = private = 0
    with open(f"/proc/{pid}/status", "rb") as f:
        for row in f:
            if row.startswith(b"VmRSS:"):
                rss = int(row.split()[1])
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        for row in f:
            if row.startswith((b"Private_Clean:", b"Private_Dirty:")):
                private += int(row.split()[1])
    return rss / 1024, private / 1024


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
