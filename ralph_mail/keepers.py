"""The keepers' fork server, from the parent's side (Linux; see `ralph_mail._keeper`).

A keeper of its own would cost each job a Python start (about 18 ms). So one server per
process is started on first use, and forks a keeper for each job it is sent: a job
starts in about a fork. The job's streams are pipes this process makes, handed to the
server with the request (``SCM_RIGHTS``); the keeper is the server's child, not this
process's, so `Kept` learns of its end from the server. A forked child of this process
starts a server of its own when it needs one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Final

#: The keeper's script (run by path, so ``ps`` shows it).
SCRIPT: Final = str(Path(__file__).with_name("_keeper.py"))
#: How long a request may wait for the server's answer before it is given up (s).
_ANSWER_S: Final = 30.0
#: How many keepers' exit codes are kept (the newest): a bound, whatever a process runs.
_ENDED_KEPT: Final = 4096


class Kept:
    """A job's keeper, as much of `subprocess.Popen` as `ralph_mail.children` uses:
    ``pid``, the three streams, `poll`, `wait`, `send_signal`, ``returncode``."""

    def __init__(self, server: Server, pid: int, streams: tuple[int, int, int]) -> None:
        self.pid = pid
        self.args = ["keeper", str(pid)]
        self.returncode: int | None = None
        self.stdin: IO[bytes] | None = os.fdopen(streams[0], "wb", buffering=0)
        self.stdout: IO[bytes] | None = os.fdopen(streams[1], "rb", buffering=0)
        self.stderr: IO[bytes] | None = os.fdopen(streams[2], "rb", buffering=0)
        self._server = server

    def poll(self) -> int | None:
        """Its exit code once it ended (minus the signal that killed it), else None."""
        if self.returncode is None:
            self.returncode = self._server.ended(self.pid, 0.0)
            if self.returncode is None and not exists(self.pid):  # reaped: word is coming
                self.returncode = self._server.ended(self.pid, _ANSWER_S)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ended (`subprocess.TimeoutExpired` after ``timeout``)."""
        if self.returncode is None:
            self.returncode = self._server.ended(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal it, unless it ended (its pid may be another's by then)."""
        if self.poll() is None:
            os.kill(self.pid, sig)


def exists(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Server:
    """One process's fork server: `spawn` sends it a job; a thread reads its answers."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", SCRIPT, "--serve", str(theirs.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )  # fmt: skip
        finally:
            theirs.close()
        self._channel = mine
        self._changed = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> the keeper's pid
        self._ended: dict[int, int] = {}  # pid -> exit code
        self._requests = 0
        self.alive = True
        self._sending = threading.Lock()
        threading.Thread(target=self._listen, name="ralph-keepers", daemon=True).start()

    def spawn(self, argv: Sequence[str], env: dict[str, str]) -> Kept:
        """Start ``argv`` under a keeper of its own, its streams pipes to this process."""
        import orjson

        ends = [os.pipe() for _ in range(3)]
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        mine = (ends[0][1], ends[1][0], ends[2][0])
        try:
            with self._changed:
                self._requests += 1
                request = self._requests
            payload = orjson.dumps({"id": request, "argv": list(argv), "env": env})
            with self._sending:
                socket.send_fds(self._channel, [payload], theirs)
        except BaseException:
            for fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        with self._changed:
            self._changed.wait_for(lambda: request in self._started or not self.alive,
                                   _ANSWER_S)  # fmt: skip
            pid = self._started.pop(request, None)
        if pid is None:
            for fd in mine:
                os.close(fd)
            raise OSError(f"the keepers' server (pid {self._process.pid}) did not answer")
        return Kept(self, pid, mine)

    def ended(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of keeper ``pid`` once it ended, waiting up to ``timeout``."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._ended or not self.alive, timeout)
            code = self._ended.get(pid)  # not popped: two threads may ask (a job, a stop)
        if code is None and not self.alive:
            return -9  # the server is gone, and with it what it knew: take it as killed
        return code

    def close(self) -> None:
        """End the server (the keepers of running jobs go on, and end with them)."""
        # shutdown, not close alone: the listening thread's recv holds the socket open,
        # and the server would wait for an end that never comes.
        with contextlib.suppress(OSError):
            self._channel.shutdown(socket.SHUT_RDWR)
        self._channel.close()
        self._process.wait()

    def _listen(self) -> None:
        while True:
            try:
                said = self._channel.recv(256).split()
            except OSError:
                said = []
            with self._changed:
                if len(said) != 3:
                    self.alive = False
                    self._changed.notify_all()
                    return
                kind, first, second = said
                if kind == b"started":
                    self._started[int(first)] = int(second)
                else:
                    self._ended[int(first)] = int(second)
                    while len(self._ended) > _ENDED_KEPT:  # the oldest: long asked for
                        del self._ended[next(iter(self._ended))]
                self._changed.notify_all()


_server: Server | None = None
_lock = threading.Lock()


def server() -> Server:
    """This process's fork server, started on first use (again, if it died)."""
    global _server
    with _lock:
        if _server is None or not _server.alive:
            _server = Server()
        return _server


def close() -> None:
    """End this process's fork server, if it has one."""
    global _server
    with _lock:
        running, _server = _server, None
    if running is not None:
        running.close()


def _forget_in_child() -> None:
    # A forked child must not share its parent's server: it closes its copy of the socket
    # (the server sees the parent's end alone) and starts its own when it needs one.
    global _server, _lock
    if _server is not None:
        _server._channel.close()
    _server, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
