"""The keepers a job's command runs under on Linux (see `ralph_mail.keepers`).

Run as ``python -I -S _keeper.py --serve FD``: the server that forks a keeper for each
job (see `serve`), so a job pays a fork, not a Python start; standard library only. It
reads /proc to find a job's leftover processes: processes, not the team's mail, which
only ``store/`` touches. A keeper makes itself a child subreaper, so every process the
command starts (a daemon that left its session with ``setsid`` or a double fork
included) stays below it; passes its three streams on to the command and lets go of them
(the parent sees end-of-file once the command's tree is gone); waits for the command;
then kills and reaps what is left of the tree, and exits with the command's status
(dying of the same signal when it was killed). SIGTERM ends the command and its tree at
once.
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


def keep(argv: list[str], env: dict[str, str]) -> None:
    """Run ``argv`` as a child subreaper (its streams this process's 0, 1 and 2), wait for
    it, kill and reap what is left of its tree, and exit with its status."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
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


def serve(fd: int) -> None:
    """The keepers' fork server (`ralph_mail.children`): started once, it forks a keeper
    for each job it is sent, so a job's start costs a fork, not a Python start.

    Over the SOCK_SEQPACKET socket ``fd``, a request is one message, JSON
    ``{"id": N, "argv": [...], "env": {...}}``, with the job's three streams as its
    descriptors; it answers ``started ID PID``, and ``exit PID CODE`` once that keeper
    has ended (CODE as `subprocess` gives it: minus the signal that killed it). It ends
    when the socket does (its parent went away)."""
    import json
    import select
    import socket

    channel = socket.socket(fileno=fd)

    def _said(channel: socket.socket, text: str) -> bool:
        """Send ``text`` to the parent; False when it is gone (its end closed)."""
        try:
            channel.send(text.encode())
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    wake_read, wake_write = os.pipe()
    for end in (wake_read, wake_write):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    while True:
        ready = select.select([channel.fileno(), wake_read], [], [])[0]
        if wake_read in ready:
            while True:
                try:
                    os.read(wake_read, 512)
                except BlockingIOError:
                    break
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if not _said(channel, f"exit {pid} {os.waitstatus_to_exitcode(status)}"):
                return  # the parent went away (Ctrl-C ends it first): so do we
        if channel.fileno() not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(channel, 1 << 22, 3)
        if not data:
            return
        wanted = json.loads(data)
        pid = os.fork()
        if pid == 0:  # the job's keeper
            try:
                channel.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for end in (wake_read, wake_write):
                    os.close(end)
                for target, source in enumerate(fds):
                    os.dup2(source, target)
                for source in fds:
                    if source > 2:
                        os.close(source)
                os.setsid()
                keep([str(arg) for arg in wanted["argv"]],
                     {str(k): str(v) for k, v in wanted["env"].items()})  # fmt: skip
            finally:
                os._exit(127)
        for source in fds:
            os.close(source)
        if not _said(channel, f"started {int(wanted['id'])} {pid}"):
            return


if __name__ == "__main__":  # python -I -S _keeper.py --serve FD (ralph_mail.keepers)
    serve(int(sys.argv[2]))
