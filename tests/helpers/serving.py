"""`ralph-mail serve` as a child process: started on a free port, its address read from
the line it prints once it serves, reaped by `Processes`."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.processes import BOUND_S, Processes, cli_env


@dataclass(frozen=True)
class Served:
    """A running server: its process, base URL (no trailing slash) and access token."""

    proc: subprocess.Popen[bytes]
    base: str
    token: str

    @property
    def url(self) -> str:
        return f"{self.base}/?token={self.token}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def first_line(proc: subprocess.Popen[bytes], stream: str = "stdout") -> bytes:
    """The first line ``proc`` writes on ``stream``, waited for at most BOUND_S."""
    pipe = getattr(proc, stream)
    deadline = time.monotonic() + BOUND_S
    line = b""
    while b"\n" not in line:
        left = deadline - time.monotonic()
        assert left > 0, f"no line on {stream} within {BOUND_S} s: {line!r}"
        if select.select([pipe], [], [], left)[0]:
            chunk = pipe.read1(4096) if hasattr(pipe, "read1") else pipe.read(1)
            if not chunk:
                err = proc.stderr.read() if proc.stderr and stream != "stderr" else b""
                raise AssertionError(f"{stream} closed before a line: {line!r} {err!r}")
            line += chunk
    return line.split(b"\n", 1)[0] + b"\n"  # what came after it is not looked at


def serve(procs: Processes, home: Path, *args: str, team: str = "demo") -> Served:
    """``ralph-mail serve --team TEAM --port 0 ARGS``, once it serves."""
    child = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "serve", "--team", team, "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(home),
    )  # fmt: skip
    procs.started.append(child)
    line = first_line(child).decode()
    assert line.startswith(f"serving team {team} at http://"), line
    address = line.split(" at ", 1)[1].strip()
    base, _, token = address.partition("/?token=")
    return Served(child, base, token)
