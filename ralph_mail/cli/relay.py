"""The warm server: commands run in processes forked from one that imported them already.

A command line pays the interpreter's start and its imports on every call: about 70 ms
here, of which the bare interpreter is 9 and the standard library modules the package
rests on (re, argparse, dataclasses, typing, pathlib, json) about 27, so no trimming of
imports brings a command near a bare start. ``ralph-mail warm start`` starts a server
that has imported every command once. From then on a command (`RELAYED`) is a client: it
connects, hands over its arguments, environment, working directory, umask, limits and
standard streams (the descriptors themselves, over the socket) and waits for the exit
code. A worker, forked from the server and warmed up before the command came
(`ralph_mail.cli.forkserver`), becomes the client in all those respects, runs the
command as the client would have, answers the exit code and ends: nothing of one
command is left for the next.

The client forwards SIGINT, SIGTERM, SIGHUP and Ctrl-Z to its worker, and dies by the
signal that ended it; a worker whose client died (kill -9) is interrupted, so a read
never consumes what nobody prints. Without a server, or with one that cannot take the
command, the client runs the command itself: the relay is never a reason for a command
to fail. ``RALPH_WARM=0`` turns it off.

Where: ``$RALPH_WARM_DIR``, else ``$XDG_RUNTIME_DIR/ralph-mail``, else
``/tmp/ralph-mail-UID``: a directory of the user's own, mode 0700 (a client ignores any
other), holding ``warm-KEY.sock``; KEY names the interpreter, the package's directory and
the module path, so each install has its own server. The server serves its own user only
(``SO_PEERCRED``), and ends when a module of the package changed on disk (an upgrade: the
client then runs the command itself), when its socket is removed, and after an idle hour
(``warm start --idle``). What goes wrong is written to ``warm-KEY.sock.log``.

The client half imports nothing a bare interpreter lacks until a server's socket exists:
without a server, a command pays one ``lstat``: about 30 µs in all.
"""

from __future__ import annotations

import marshal
import os
import signal
import sys

TYPE_CHECKING = False  # not typing's: importing typing here would cost start-up time
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Sequence
    from typing import Any

#: The commands a client hands to the server: the short ones. Not the long-lived faces
#: (`run`, `lead`, `mcp`, `serve`, `top`, `demo`: they start processes or own a
#: terminal), not completion, not `warm` itself.
RELAYED = frozenset((
    "ack", "acks", "agents", "approvals", "approve", "ask", "assign", "broadcast", "channel",
    "delegate", "deny", "doctor", "gc", "history", "keys", "nats", "plan", "policy",
    "presence", "read", "receipt", "reply", "search", "send", "shutdown", "status", "tail",
    "task", "tasks", "team", "thread", "usage", "wait",
))  # fmt: skip
#: The protocol's version: a server and a client of other versions do not talk.
VERSION = 1
#: The signals a client passes on to its worker (and then dies by, as the worker did).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The limits a worker takes from its client (``ulimit -n 256`` holds through the relay).
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_CORE", "RLIMIT_NPROC")
#: Limits on memory a worker cannot honour as its client would (it shares the server's
#: pages): a client under one of them runs the command itself.
MEMORY_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA")

ACCEPTED, REFUSED = b"A", b"R"


# -- where ------------------------------------------------------------------------------


def directory() -> str:
    """The directory of this user's warm servers (see the module docstring)."""
    chosen = os.environ.get("RALPH_WARM_DIR")
    if chosen:
        return chosen
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "ralph-mail")
    return f"/tmp/ralph-mail-{os.getuid()}"


def key() -> str:
    """What a server must share with its client: the interpreter, this package's
    directory and the module path but its first entry (the script's directory or the
    working directory): a server of another install is another server."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = "\0".join([sys.executable, package, sys.version, *sys.path[1:]])
    digest = 0xCBF29CE484222325  # FNV-1a, 64 bits: zlib's import would cost more
    for byte in text.encode("utf-8", "surrogateescape"):
        digest = ((digest ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{digest:016x}"


def socket_path() -> str:
    """The socket of this install's server."""
    return os.path.join(directory(), f"warm-{key()}.sock")


def private(path: str) -> str | None:
    """Why ``path`` is not a directory of this user's alone, or None when it is."""
    import stat

    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    if not stat.S_ISDIR(status.st_mode):
        return f"{path} is not a directory"
    if status.st_uid != os.getuid():
        return f"{path} belongs to user {status.st_uid}, not to you"
    if status.st_mode & 0o077:
        return f"{path} is open to others (mode {status.st_mode & 0o777:o}): chmod 700 it"
    return None


# -- the client -------------------------------------------------------------------------


def relay(args: Sequence[str], held: list[int]) -> int | None:
    """Run command ``args`` on this install's warm server and return its exit code; None
    when there is no server to take it (run it here). ``held``: the Ctrl-Cs that came
    while starting, passed on once the worker runs."""
    if not args or args[0] not in RELAYED or os.environ.get("RALPH_WARM") == "0":
        return None
    try:
        path = socket_path()
        if not _is_socket(path) or private(os.path.dirname(path)) is not None:
            return None
        conn, worker = _open(path, _request(args))
    except (OSError, ValueError):  # a server gone (a stale socket), no working directory
        return None  # (or an unwritable request): the command runs here
    if conn is None:
        return None
    with conn:
        return _follow(conn, worker, held)


def call(op: str) -> str | None:
    """Ask this install's server for ``op`` ("status" or "stop"); its answer, or None
    when no server answers."""
    path = socket_path()
    try:
        if not _is_socket(path):
            return None
        conn, _ = _open(path, {"version": VERSION, "key": key(), "op": op})
        if conn is None:
            return None
        with conn:
            chunks = []
            while chunk := conn.recv(4096):
                chunks.append(chunk)
    except (OSError, ValueError):
        return None
    return b"".join(chunks).decode()


def _is_socket(path: str) -> bool:
    import stat

    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(status.st_mode) and status.st_uid == os.getuid()


def _request(args: Sequence[str]) -> dict[str, Any]:
    """What the worker needs to be this process (its streams go beside, as descriptors)."""
    import resource

    for name in MEMORY_LIMITS:
        if resource.getrlimit(getattr(resource, name))[0] != resource.RLIM_INFINITY:
            raise OSError(f"{name} is set: the command runs here")
    mask = os.umask(0o077)
    os.umask(mask)
    limits = {name: resource.getrlimit(getattr(resource, name))
              for name in LIMITS if hasattr(resource, name)}  # fmt: skip
    streams: list[tuple[str, str, bool, bool] | None] = []
    for fd, stream in enumerate((sys.stdin, sys.stdout, sys.stderr)):
        if not is_open(fd):
            streams.append(None)  # closed (<&-, >&-): closed in the worker too
            continue
        streams.append((getattr(stream, "encoding", None) or "utf-8",
                        getattr(stream, "errors", None) or "strict",
                        bool(getattr(stream, "line_buffering", False)),
                        bool(getattr(stream, "write_through", False))))  # fmt: skip
    return {"version": VERSION, "key": key(), "op": "run", "argv": list(args),
            "cwd": os.getcwd(), "umask": mask, "env": dict(os.environ), "limits": limits,
            "streams": streams}  # fmt: skip


def _open(path: str, request: dict[str, Any]) -> tuple[socket.socket | None, int]:
    """Connect, send ``request`` (with the open standard streams of a command), and read
    the server's word: the connection and the worker's pid, or (None, 0) when refused."""
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        at(path, conn.connect)
        body = marshal.dumps(request)
        data = len(body).to_bytes(4, "big") + body
        streams = request.get("streams") or (None, None, None)
        fds = [fd for fd in (0, 1, 2) if streams[fd] is not None]
        sent = socket.send_fds(conn, [data], fds) if fds else conn.send(data)
        if sent < len(data):  # (an empty send to a worker that answered and left: EPIPE)
            conn.sendall(data[sent:])
        answer = recv_exact(conn, 5)
    except BaseException:
        conn.close()
        raise
    if answer[:1] != ACCEPTED:
        conn.close()
        return None, 0
    return conn, int.from_bytes(answer[1:], "big")


def at(path: str, act: Callable[[str], object]) -> None:
    """Call ``act`` (a socket's ``connect`` or ``bind``) with the address of ``path``: the
    path itself, or when it is too long for a socket's address (108 bytes) the same file
    through ``/proc/self/fd`` and a descriptor on its directory (Linux)."""
    if len(os.fsencode(path)) < 100:
        act(path)
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        act(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the warm server hung up")
        data += chunk
    return data


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _follow(conn: socket.socket, worker: int, held: list[int]) -> int:
    """Wait for the worker's exit code, passing signals on; die by the one that ended it."""
    passed: list[int] = []

    def tell(signum: int) -> None:
        try:
            os.kill(worker, signum)
        except ProcessLookupError:  # it ended meanwhile
            return

    def forward(signum: int, frame: object) -> None:
        passed.append(signum)
        tell(signum)

    def suspend(signum: int, frame: object) -> None:  # Ctrl-Z: stop the worker, then me
        tell(signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)
        signal.signal(signal.SIGTSTP, suspend)  # going on (SIGCONT): the worker too
        tell(signal.SIGCONT)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.signal(signal.SIGTSTP, suspend)
    if held:
        forward(signal.SIGINT, None)
    try:
        code = conn.recv(1)
    except OSError:
        code = b""
    if code:
        return code[0]
    if passed:  # the worker ended by a signal passed on: end as the command would have
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), passed[-1])
    sys.stderr.write(
        "ralph-mail: error: the warm server's worker ended without an exit status "
        "(killed?): run the command again, with RALPH_WARM=0 to run it without the server\n"
    )
    return 2
