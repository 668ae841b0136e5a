"""The fixtures every test may ask for: a private mailbox home, a team in it, a reaped
process starter, nats-servers killed after the test, a team on every backend; and the
fault suite's figures at the end. Helpers that tests import live in tests/helpers."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ralph_mail import Team, create_team
from tests.helpers.backends import BACKENDS, backend_url
from tests.helpers.cluster import Server
from tests.helpers.faultkit import summary
from tests.helpers.processes import Processes


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


@pytest.fixture
def procs() -> Iterator[Processes]:
    """A process starter whose children are killed and reaped after the test."""
    processes = Processes()
    try:
        yield processes
    finally:
        processes.reap()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Makes nats-server children (`Server`, not started; options as nats-server takes
    them) that are killed after the test, whatever happens."""
    made: list[Server] = []

    def make(*options: str) -> Server:
        made.append(Server(tmp_path / f"nats-{len(made)}", options))
        return made[-1]

    try:
        yield make
    finally:
        for server in made:
            server.stop(signal.SIGKILL)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault suite's figures (messages, kills, faults, inputs, lost) when it ran."""
    for line in summary():
        terminalreporter.write_line(line)


@pytest.fixture(params=BACKENDS)
def team_on_every_backend(
    request: pytest.FixtureRequest, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Team:
    """Team 'demo' (lead, worker-1, worker-2) on each backend in turn; RALPH_BACKEND is
    set, so buses made without ``backend=`` and child processes use it too."""
    url = backend_url(request.param, tmp_path)
    if url:
        monkeypatch.setenv("RALPH_BACKEND", url)
    return create_team("demo", ["lead", ("worker-1", "parses logs"), "worker-2"], home=home)
