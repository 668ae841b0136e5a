"""Helpers for the protocol tests: children whose output a test follows with a deadline."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ralph_mail import Message, MessageBus, MessageType
from ralph_mail.store.files import FileStore
from tests.helpers.processes import BOUND_S, NO_WARM_SERVER

PROGRAMS = Path(__file__).with_name("team_programs.py")


def ralph_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for a child using mailbox ``home`` (and no RALPH_* of ours)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env["RALPH_HOME"] = str(home)
    env["RALPH_CHANNEL_DELAY"] = "0"  # no pause between answers in tests
    env["RALPH_WARM_DIR"] = NO_WARM_SERVER
    if os.environ.get("RALPH_BACKEND"):  # a test on another backend: its children too
        env["RALPH_BACKEND"] = os.environ["RALPH_BACKEND"]
    # The script's directory (for examples: the venv's `ralph-mail`) comes first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has input (or end of file) within ``timeout`` seconds.

    poll, not select: select refuses descriptors above 1023, which a long test session
    with many open files reaches.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, round(timeout * 1000))))


class Child:
    """A started process whose standard output is read line by line with deadlines."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.lines: list[str] = []
        self._buffer = b""
        self._next = 0  # lines before this index were matched by an earlier expect
        self._eof = False

    def _read(self, timeout: float) -> bool:
        assert self.popen.stdout is not None
        if not readable(self.popen.stdout.fileno(), timeout):
            return False
        chunk = os.read(self.popen.stdout.fileno(), 65536)
        if not chunk:
            self._eof = True
            return False
        self._buffer += chunk
        *whole, self._buffer = self._buffer.split(b"\n")
        self.lines.extend(line.decode(errors="replace") for line in whole)
        return True

    def expect(self, text: str, timeout: float = BOUND_S) -> str:
        """The next output line containing ``text``; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(self._next, len(self.lines)):
                if text in self.lines[index]:
                    self._next = index + 1
                    return self.lines[index]
            remaining = deadline - time.monotonic()
            if self._eof or remaining <= 0:
                raise AssertionError(
                    f"no line with {text!r} in {timeout:g}s; output so far:\n"
                    + "\n".join(self.lines)
                    + f"\nstderr:\n{self.stderr_text() if self._eof else '(running)'}"
                )
            self._read(remaining)

    def finish(self, timeout: float = BOUND_S) -> int:
        """Wait for the exit (reading the rest of the output); return the exit code."""
        deadline = time.monotonic() + timeout
        while not self._eof and time.monotonic() < deadline:
            self._read(deadline - time.monotonic())
        return self.popen.wait(timeout=max(0.1, deadline - time.monotonic()))

    def stderr_text(self) -> str:
        """Standard error, once the process has exited."""
        if self.popen.poll() is None or self.popen.stderr is None:
            return ""
        return self.popen.stderr.read().decode(errors="replace")

    @property
    def output(self) -> str:
        """Everything read from standard output so far."""
        return "\n".join(self.lines)


class Children:
    """Starts children and always reaps them (their whole process group), even on failure."""

    def __init__(self) -> None:
        self.started: list[Child] = []

    def start(
        self,
        args: Sequence[str],
        env: dict[str, str],
        *,
        cwd: Path | None = None,
        stdin: int | None = subprocess.DEVNULL,
    ) -> Child:
        """Start ``args`` in a process group of its own, output piped."""
        popen = subprocess.Popen(
            list(args),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,  # so reaping also gets the grandchildren it started
        )
        child = Child(popen)
        self.started.append(child)
        return child

    def program(self, home: Path, *args: str, **env: str) -> Child:
        """Start ``team_programs.py ARGS`` with mailbox ``home``."""
        return self.start([sys.executable, str(PROGRAMS), *args], ralph_env(home, **env))

    def ralph(self, home: Path, *args: str, **env: str) -> Child:
        """Start ``python -m ralph_mail ARGS`` with mailbox ``home``."""
        return self.start([sys.executable, "-m", "ralph_mail", *args], ralph_env(home, **env))

    def reap(self) -> None:
        for child in self.started:
            popen = child.popen
            with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=BOUND_S)
            for stream in (popen.stdin, popen.stdout, popen.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture(name="children")
def children_fixture() -> Iterator[Children]:
    """A starter of children that are killed (with their groups) and reaped after the test."""
    started = Children()
    try:
        yield started
    finally:
        started.reap()


@pytest.fixture(autouse=True)
def close_buses(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every MessageBus a test opened: a bus keeps descriptors open until closed, and
    hundreds of one-off buses would exhaust the test process's descriptors."""
    opened: list[MessageBus] = []
    original = MessageBus.__init__

    def init(self: MessageBus, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(MessageBus, "__init__", init)
    yield
    for bus in opened:
        bus.close()


def inbox_messages(root: Path, agent: str) -> list[Message]:
    """Every message in ``agent``'s inbox, consumed or not (read through the store)."""
    from ralph_mail.message import decode

    files = FileStore(root.parent.parent, root.name)  # root: HOME/teams/TEAM
    try:
        data, _ = files.read(agent, 0)
    finally:
        files.close()
    return [decode(line) for line in data.splitlines() if line.strip()]


def of_type(messages: list[Message], kind: MessageType) -> list[Message]:
    """The messages of one type."""
    return [message for message in messages if message.type == kind]


def session_processes(session: int) -> list[int]:
    """The live (not zombie) processes of session ``session``: leftovers of a finished run."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # it ended while we looked
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state != "Z":
            found.append(int(entry.name))
    return found


class Terminal:
    """A child on a pseudo-terminal (stdin, stdout and stderr): what a person would see."""

    def __init__(self, children: Children, args: Sequence[str], env: dict[str, str]) -> None:
        import pty

        self.master, slave = pty.openpty()
        env = dict(env, TERM="xterm-256color", COLUMNS="120", LINES="40")
        self.popen = subprocess.Popen(
            list(args), stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        children.started.append(Child(self.popen))  # reaped even if the test fails
        os.close(slave)
        self.screen = ""

    def _read(self, timeout: float) -> bool:
        if not readable(self.master, timeout):
            return False
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child is gone
            return False
        # Keep the text, drop the styles and cursor movements.
        self.screen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", chunk.decode(errors="replace"))
        return bool(chunk)

    def expect(self, text: str, timeout: float = BOUND_S) -> None:
        """Wait until ``text`` has appeared on the screen."""
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (not self._read(remaining) and self.popen.poll() is not None):
                raise AssertionError(f"{text!r} never appeared; the screen:\n{self.screen}")

    def type(self, text: str) -> None:
        """Type ``text`` at the keyboard."""
        os.write(self.master, text.encode())

    def finish(self, timeout: float = BOUND_S) -> int:
        """Wait for the exit, keeping all it printed (read until the terminal's other
        end is closed, then reaped); return the exit code."""
        deadline = time.monotonic() + timeout
        while self._read(max(0.0, deadline - time.monotonic())):
            pass
        code = self.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        os.close(self.master)
        return code
