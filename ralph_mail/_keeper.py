"""The keeper a command runs under on Linux (see `ralph_mail.children`).

Run as ``python -I -S _keeper.py COMMAND [ARG...]``, or ``--from-fd N`` to be told the
command later (see `request`): standard library only, and as little of it as will do, so
it starts in about 18 ms, ctypes and signal most of it. It makes itself a child subreaper, so every
process the command starts (a daemon that left its session with ``setsid`` or a double
fork included) stays below it; passes its three streams on to the command and lets go of
them (the parent sees end-of-file once the command's tree is gone); waits for the
command; then kills and reaps what is left of the tree, and exits with the command's
status (dying of the same signal when it was killed). SIGTERM ends the command and its
tree at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

#: prctl(2) option: orphaned descendants are reparented to this process, not to init.
_PR_SET_CHILD_SUBREAPER = 36
#: How long the keeper tries to kill what is left (a setuid process may refuse) (s).
_CLEANUP_S = 5.0


class _Stop(Exception):
    """SIGTERM: end the command and its tree now."""


def _stop(*_: object) -> None:
    raise _Stop


def descendants() -> list[int]:
    """Every process below this one, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as stat_file:
                    stat = stat_file.read()
                parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(name))
    found, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def request(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and its environment: ``argv`` itself, or with ``--from-fd N`` a JSON
    request ``{"argv": [...], "env": {...}}`` read from descriptor N to its end. A keeper
    started that way ahead of its job (`ralph_mail.children`) has all of its own start-up
    behind it when the job comes; an empty request (its parent went away) ends it."""
    if argv[:1] != ["--from-fd"]:
        return argv, dict(os.environ)
    import json

    control, chunks = int(argv[1]), []
    while chunk := os.read(control, 1 << 16):
        chunks.append(chunk)
    os.close(control)
    if not chunks:
        os._exit(0)
    wanted = json.loads(b"".join(chunks))
    return [str(arg) for arg in wanted["argv"]], {str(k): str(v) for k, v in wanted["env"].items()}


def main(argv: list[str]) -> None:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    argv, env = request(argv)
    signal.signal(signal.SIGTERM, _stop)
    status: int | None = None
    command = -1
    try:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            command = os.posix_spawnp(argv[0], argv, env,
                                      setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))  # fmt: skip
        except OSError as exc:
            os.write(2, f"cannot run {argv[0]!r}: {exc.strerror or exc}\n".encode())
            os._exit(127)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        while status is None:
            pid, code = os.waitpid(-1, 0)  # orphans of the tree are reaped on the way
            if pid == command:
                status = code
    except (_Stop, ChildProcessError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    give_up = time.monotonic() + _CLEANUP_S
    while time.monotonic() < give_up:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child: nothing below (an orphan would be one)
            break
        if pid:  # one more reaped (the command, if it was stopped): look again
            if pid == command and status is None:
                status = code
            continue
        left = descendants()
        for pid in left:
            try:  # noqa: SIM105 (contextlib: 5 ms more per job)
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone, or not ours to kill (setuid)
                pass
        reaped = False
        try:
            while True:
                pid, code = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                reaped = True
                if pid == command and status is None:
                    status = code
        except ChildProcessError:
            if not left:
                break
        if not reaped:
            time.sleep(0.005)
    exit_code = os.waitstatus_to_exitcode(status) if status is not None else -signal.SIGKILL
    if exit_code < 0:  # killed by a signal: die of it too, so the parent sees the same
        signal.signal(-exit_code, signal.SIG_DFL)
        os.kill(os.getpid(), -exit_code)
    os._exit(exit_code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
