"""Running ralph-mail and Python as child processes: bounded, in a private home, reaped."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The longest any test waits for another process; generous for a loaded 2-core machine.
BOUND_S = 60.0
#: Where a test's commands look for a warm server (ralph_mail/cli/relay.py): a directory
#: nobody makes, so a server the user runs never serves the tests (test_warm.py makes
#: its own).
NO_WARM_SERVER = os.path.join(tempfile.gettempdir(), f"ralph-tests-no-warm-server-{os.getpid()}")


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for a ralph-mail subprocess using ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RALPH_")}
    env["RALPH_HOME"] = str(home)
    env["RALPH_CHANNEL_DELAY"] = "0"
    env["RALPH_WARM_DIR"] = NO_WARM_SERVER
    for name in ("RALPH_BACKEND", "RALPH_WAIT"):  # a run on another backend or wait: children too
        if os.environ.get(name):
            env[name] = os.environ[name]
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


def wait_until(condition: object, what: str) -> None:
    """Poll ``condition()`` until it holds, at most BOUND_S seconds."""
    deadline = time.monotonic() + BOUND_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Whether process ``pid`` no longer exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def runner(
    procs: Processes, home: Path, agent: str, script: str, *options: str, team: str = "demo"
) -> subprocess.Popen[bytes]:
    """``ralph-mail run --agent AGENT OPTIONS -- sh -c SCRIPT``, once it is online."""
    env = cli_env(home, RALPH_TEAM=team)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    child = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "run", "--agent", agent, *options, "--",
         "sh", "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    procs.started.append(child)
    assert child.stderr is not None
    line = first_line(child.stderr.fileno())
    assert line.startswith(f"ralph-mail: note: {agent} answers with sh".encode()), line
    return child


def first_line(fd: int) -> bytes:
    """The next line from descriptor ``fd``, read a byte at a time: what follows it stays
    in the pipe for `Popen.communicate`, which reads the descriptor itself (a buffered
    ``readline`` would keep the lines after it, and they would be lost)."""
    line = b""
    while not line.endswith(b"\n") and (byte := os.read(fd, 1)):
        line += byte
    return line


def ask(home: Path, to: str, question: str, *options: str) -> subprocess.CompletedProcess[bytes]:
    """``ralph-mail ask TO QUESTION`` from the lead of team demo, bounded at 30 s."""
    return ralph(home, "ask", to, question, "--timeout", "30", "--team", "demo", "--agent",
                 "lead", *options)  # fmt: skip


def on_terminal(home: Path, *args: str) -> bytes:
    """What ``ralph-mail ARGS`` writes to a terminal (a pseudo-terminal), whole."""
    import pty

    master, slave = pty.openpty()
    env = dict(cli_env(home, RALPH_TEAM="demo", RALPH_AGENT="lead"), TERM="xterm-256color",
               COLUMNS="400", LINES="40")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "ralph_mail", *args], stdin=slave,
                            stdout=slave, stderr=slave, env=env)  # fmt: skip
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child is gone and its output read
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        proc.wait(timeout=BOUND_S)
    return out


def held_job(where: Path, answer: str) -> tuple[str, int, int]:
    """A shell script that says it started (a line in a pipe the test reads), then
    prints ``answer`` once the test lets it go (a line in a second pipe): the script, the
    descriptor to read "started" from and the one to write the go-ahead to (both the
    test's to close). No clock: the test knows the job runs, and decides when it ends."""
    started, go = where / "started", where / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    # Opened here first, never blocking: the script's writes and reads then find them.
    said = os.open(started, os.O_RDONLY | os.O_NONBLOCK)
    let_go = os.open(go, os.O_RDWR)
    script = f"echo started > '{started}'; head -n1 '{go}' >/dev/null; echo '{answer}'"
    return script, said, let_go


def signal_until_ended(proc: subprocess.Popen[bytes], signum: int) -> int:
    """Send ``signum`` to ``proc`` again and again (signals sent at once may merge into
    one) until it ends, at most BOUND_S seconds; its exit code."""
    deadline = time.monotonic() + BOUND_S
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    return proc.wait(timeout=BOUND_S)
