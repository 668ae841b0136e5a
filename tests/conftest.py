"""Shared fixtures: a private mailbox home per test, a team in it, and process helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ralph_mail import Team, create_team

#: The longest any test waits for another process; generous for a loaded 2-core machine.
BOUND_S = 60.0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A mailbox home under tmp_path, also set as RALPH_HOME (never the real ~/.ralph)."""
    path = tmp_path / "ralph"
    monkeypatch.setenv("RALPH_HOME", str(path))
    monkeypatch.setenv("RALPH_CHANNEL_DELAY", "0")  # no pause between answers in tests
    for name in ("RALPH_TEAM", "RALPH_AGENT", "RALPH_DURABLE", "RALPH_MAX_MESSAGE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.fixture
def team(home: Path) -> Team:
    """Team 'demo': lead, worker-1, worker-2."""
    return create_team("demo", ["lead", ("worker-1", "parses logs"), "worker-2"], home=home)


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for a ralph-mail subprocess using ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env["RALPH_HOME"] = str(home)
    env["RALPH_CHANNEL_DELAY"] = "0"
    env.update(extra)
    return env


def ralph(
    home: Path, *args: str, input: bytes | None = None, **env: str
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m ralph_mail ARGS`` with ``home``; return the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "ralph_mail", *args],
        input=input if input is not None else b"",
        capture_output=True,
        env=cli_env(home, **env),
        timeout=BOUND_S,
    )


class Processes:
    """Starts child processes and always reaps them, even when the test fails."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []

    def python(
        self, code: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``python -c code args`` with pipes on all three streams."""
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.started.append(proc)
        return proc

    def reap(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=BOUND_S)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def procs() -> Iterator[Processes]:
    """A process starter whose children are killed and reaped after the test."""
    processes = Processes()
    try:
        yield processes
    finally:
        processes.reap()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault suite's figures (messages, kills, faults, inputs, lost) when it ran."""
    from faultkit import summary

    for line in summary():
        terminalreporter.write_line(line)
