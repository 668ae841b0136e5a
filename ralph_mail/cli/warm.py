"""``ralph-mail warm``: start, stop and show this install's warm server (`relay`)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

from ralph_mail.cli import EXIT_NOTHING, EXIT_USAGE, error_line, say
from ralph_mail.cli.app import JsonRecords, app
from ralph_mail.cli.command import Exit, Group, Option

#: How long `warm start` waits for the server to listen, and `warm stop` for it to end (s).
START_S = 60.0

warm_app = Group(
    help=(
        "A server that has imported every command once, so that a command line starts "
        "in a third of the time: each short command (send, read, wait, ask, ...) hands "
        "itself to it, and it runs the command in a fresh fork, on the caller's streams, "
        "environment and directory. RALPH_WARM=0 turns the relay off.\n\n"
        "Example:\n  ralph-mail warm start\n  ralph-mail warm status\n  ralph-mail warm stop"
    )
)
app.add_group(warm_app, "warm")


@warm_app.command("start")
def warm_start(
    idle: Annotated[
        float, Option("--idle", help="End after this many seconds without a command "
                      "[default: 3600].", metavar="SECONDS")
    ] = 3600.0,
) -> None:  # fmt: skip
    """Start this install's warm server in the background (one per user and install);
    prints its pid and socket. A server already running is left as it is.

    \b
    Example:
      ralph-mail warm start --idle 600
    """
    from ralph_mail.cli import relay

    if not idle > 0:
        error_line(f"--idle {idle:g}: give a number of seconds above 0")
        raise Exit(EXIT_USAGE)
    path = relay.socket_path()
    where = os.path.dirname(path)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
    except OSError as exc:
        error_line(
            f"cannot make {where}: {exc.strerror}: set RALPH_WARM_DIR to a directory of yours"
        )
        raise Exit(EXIT_USAGE) from None
    why = relay.private(where)
    if why is not None:
        error_line(f"{why}: set RALPH_WARM_DIR to a directory of yours (mode 700)")
        raise Exit(EXIT_USAGE)
    running = relay.call("status")
    if running is None:
        pid = _spawn(path, idle)
        if pid:
            say(f"warm server started: pid {pid}, socket {path}\n")
            return
        running = relay.call("status") or ""  # another start won the race
    say(f"a warm server already runs: pid {_fields(running).get('pid', '?')}, socket {path}\n")


@warm_app.command("stop")
def warm_stop() -> None:
    """Stop this install's warm server; commands under way finish. Exit 1 when none runs.

    \b
    Example:
      ralph-mail warm stop
    """
    from ralph_mail.cli import relay

    answer = relay.call("stop")
    if answer is None:
        error_line(f"no warm server runs for this install ({relay.socket_path()})", "note")
        raise Exit(EXIT_NOTHING)
    pid = int(_fields(answer)["pid"])
    if not ended(pid, START_S):
        error_line(f"the warm server {pid} is still running after {START_S:g} s: kill {pid}")
        raise Exit(EXIT_USAGE)
    say(f"warm server stopped: pid {pid}\n")


@warm_app.command("status")
def warm_status(json: JsonRecords = False) -> None:
    """Show this install's warm server: pid, socket, when started, commands served, idle
    timeout. Exit 1 when none runs.

    \b
    Example:
      ralph-mail warm status --json
    """
    from ralph_mail.cli import relay

    answer = relay.call("status")
    if answer is None:
        error_line(f"no warm server runs for this install ({relay.socket_path()})", "note")
        raise Exit(EXIT_NOTHING)
    if json:
        from ralph_mail.cli.render import print_json_lines

        fields = _fields(answer).items()
        print_json_lines([{name: int(value) if value.isdigit() else value
                           for name, value in fields}])  # fmt: skip
        return
    say(answer)


def _fields(answer: str) -> dict[str, str]:
    """A server's ``name value`` lines (`relay.call`'s answer) as a dict."""
    return dict(line.partition(" ")[::2] for line in answer.splitlines())


def _spawn(path: str, idle: float) -> int:
    """Start the server detached (its own session, stdin and stdout on the null device,
    stderr on its log); its pid once it listens, 0 when another start took the socket
    first. One line and exit 2 when it cannot start."""
    read, write = os.pipe()
    os.set_inheritable(write, True)
    argv = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-c",
            "from ralph_mail.cli.forkserver import main; main()", path, f"{idle:g}"]  # fmt: skip
    env = dict(os.environ, RALPH_WARM_FD=str(write))
    null = os.devnull
    actions = [(os.POSIX_SPAWN_OPEN, fd, null, os.O_RDWR, 0) for fd in (0, 1)]
    log = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
    actions.append((os.POSIX_SPAWN_OPEN, 2, f"{path}.log", log, 0o600))  # what went wrong
    try:
        pid = os.posix_spawn(sys.executable, argv, env, file_actions=actions, setsid=True)
    except OSError as exc:
        error_line(f"cannot start the warm server: {exc.strerror or exc}")
        raise Exit(EXIT_USAGE) from None
    finally:
        os.close(write)
    try:
        said = _read_all(read, START_S).strip()
    finally:
        os.close(read)
    if said == "ready":
        return pid
    os.waitpid(pid, 0)  # it ended: reaped here
    if said == "running":
        return 0
    why = said or "it ended before it listened (see the log beside the socket)"
    error_line(f"the warm server did not start: {why}")
    raise Exit(EXIT_USAGE)


def _read_all(fd: int, timeout: float) -> str:
    import select
    import time

    deadline = time.monotonic() + timeout
    data = b""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while time.monotonic() < deadline:
        if not poller.poll((deadline - time.monotonic()) * 1000):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        if data.endswith(b"\n"):
            break
    return data.decode(errors="replace")


def ended(pid: int, timeout: float) -> bool:
    """Wait until process ``pid`` (not a child of ours) ends: True, or False after ``timeout``."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)
