"""The warm server: commands run in processes forked from one that imported them already.

A command line pays the interpreter's start and its imports on every call: about 70 ms
here, of which the bare interpreter is 9 and the standard library modules the package
rests on (re, argparse, dataclasses, typing, pathlib, json) about 27, so no trimming of
imports brings a command near a bare start. ``ralph-mail warm start`` starts a server
that has imported every command once. From then on a command (`RELAYED`) is a client: it
connects, hands over its arguments, environment, working directory, umask, limits and
standard streams (the descriptors themselves, over the socket) and waits for the exit
code. A worker, forked from the server and warmed up before the command came (`POOL` of
them wait), becomes the client in all those respects, runs the command as the client
would have, answers the exit code and ends: nothing of one command is left for the next.

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
without a server, a command pays two ``lstat`` calls.
"""

from __future__ import annotations

import marshal
import os
import signal
import sys

TYPE_CHECKING = False  # not typing's: importing typing here would cost start-up time
if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence
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
#: How many workers wait, forked and warmed up, for the next commands.
POOL = 2
#: How often (commands served) a worker's warm-up drops the throwaway team's old mail.
GC_EVERY = 500
#: The signals a client passes on to its worker (and then dies by, as the worker did).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The limits a worker takes from its client (``ulimit -n 256`` holds through the relay).
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_CORE", "RLIMIT_NPROC")
#: Limits on memory a worker cannot honour as its client would (it shares the server's
#: pages): a client under one of them runs the command itself.
MEMORY_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA")

_ACCEPTED, _REFUSED = b"A", b"R"


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
    except OSError:  # a server gone (a stale socket), no working directory: run it here
        return None
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
    except OSError:
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
        if not _is_open(fd):
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
        address, directory_fd = _address(path)
        try:
            conn.connect(address)
        finally:
            if directory_fd >= 0:
                os.close(directory_fd)
        body = marshal.dumps(request)
        data = len(body).to_bytes(4, "big") + body
        streams = request.get("streams") or (None, None, None)
        fds = [fd for fd in (0, 1, 2) if streams[fd] is not None]
        sent = socket.send_fds(conn, [data], fds) if fds else conn.send(data)
        if sent < len(data):  # (an empty send to a worker that answered and left: EPIPE)
            conn.sendall(data[sent:])
        answer = _recv_exact(conn, 5)
    except BaseException:
        conn.close()
        raise
    if answer[:1] != _ACCEPTED:
        conn.close()
        return None, 0
    return conn, int.from_bytes(answer[1:], "big")


def _address(path: str) -> tuple[str, int]:
    """A socket address for ``path``, and the descriptor it needs open (-1: none): when
    the path is too long for one (108 bytes), the same file through ``/proc/self/fd``
    and a descriptor on its directory (Linux)."""
    if len(os.fsencode(path)) < 100:
        return path, -1
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the warm server hung up")
        data += chunk
    return data


def _is_open(fd: int) -> bool:
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


# -- the server -------------------------------------------------------------------------


class _Server:
    """What the server knows; each worker has a copy as it was when forked (but the
    count of commands, which all share)."""

    def __init__(self, path: str, idle: float) -> None:
        import mmap
        import time

        self.path, self.idle = path, idle
        self.pid = os.getpid()
        self.key = key()
        self.started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._served = mmap.mmap(-1, 8)  # anonymous and shared: forks see it change
        self.sources: dict[str, tuple[int, int]] = {}
        self.home = f"{path}.home"  # a throwaway team's, where each worker warms up
        self.inode = 0  # of the socket's file, once bound

    @property
    def served(self) -> int:
        """How many commands (and status calls) the server took."""
        return int.from_bytes(self._served[:8], "big")

    def took(self, count: int) -> None:
        """``count`` more commands were taken (said by the server's process alone)."""
        self._served[:8] = (self.served + count).to_bytes(8, "big")

    def still_there(self) -> bool:
        """Whether the server's path is still its socket (not removed, not replaced)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def describe(self) -> str:
        """The server, as ``name value`` lines (`warm status`)."""
        return (f"pid {self.pid}\nsocket {self.path}\nstarted {self.started}\n"
                f"served {self.served}\nidle {self.idle:g}\n")  # fmt: skip


def main() -> None:
    """The server process: ``python -c 'from ralph_mail.cli.relay import main; main()'
    PATH IDLE``, as `warm start` runs it: detached, stdin and stdout on the null device,
    stderr on its log. It writes ``ready`` once it listens, or why not, on the
    descriptor ``RALPH_WARM_FD``."""
    import contextlib
    import shutil

    path, idle = sys.argv[1], float(sys.argv[2])
    said = int(os.environ.pop("RALPH_WARM_FD"))
    for name in [name for name in os.environ if name.startswith("RALPH_")]:
        del os.environ[name]  # the warm-up's team is a throwaway one, on files
    try:
        server = _Server(path, idle)
        _import_everything(server.home)
        server.sources = _sources()
        listener = _bind(path)
        server.inode = os.stat(path).st_ino
    except Exception as exc:
        os.write(said, f"{exc}\n".encode())
        os._exit(2)
    os.write(said, b"ready\n")
    os.close(said)
    try:
        serve(server, listener)
    finally:
        if server.still_there():
            with contextlib.suppress(OSError):
                os.unlink(path)
        listener.close()
        shutil.rmtree(server.home, ignore_errors=True)
        with contextlib.suppress(OSError):  # nothing went wrong: no log left
            if os.fstat(2).st_size == 0 and os.path.samestat(os.fstat(2),
                                                             os.stat(f"{path}.log")):  # fmt: skip
                os.unlink(f"{path}.log")


def serve(server: _Server, listener: socket.socket) -> None:
    """Keep `POOL` workers waiting, each forked and warmed up before its command comes;
    until stopped (SIGTERM), idle for ``server.idle`` seconds, or gone from its path."""
    import select
    import time

    stop: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: stop.append(signum))
    told, tell = os.pipe()  # a worker that took a command says so (its pid)
    alive, life = os.pipe()  # ``life`` is this process's alone: its end ends the waiting
    woken, wake = os.pipe()  # a signal wakes the poll (SIGTERM: stop now, not in a second)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    waiting: set[int] = set()
    busy: set[int] = set()
    poller = select.poll()
    poller.register(told, select.POLLIN)
    poller.register(woken, select.POLLIN)
    last = time.monotonic()
    try:
        while not stop:
            for pid in list(waiting | busy):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    waiting.discard(pid)
                    busy.discard(pid)
            while len(waiting) < POOL:
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (told, life, woken, wake):
                        os.close(fd)
                    _wait_for_work(server, listener, tell, alive)
                waiting.add(pid)
            left = server.idle - (time.monotonic() - last)
            if (left <= 0 and not busy) or not server.still_there():
                break
            events = dict(poller.poll(max(0.0, min(left, 1.0)) * 1000))
            if woken in events:
                os.read(woken, 4096)
            if told not in events:
                continue
            data = os.read(told, 4096)
            for start in range(0, len(data) - 3, 4):
                pid = int.from_bytes(data[start : start + 4], "big")
                waiting.discard(pid)
                busy.add(pid)
            server.took(len(data) // 4)
            last = time.monotonic()
    finally:
        signal.set_wakeup_fd(-1)
        for fd in (told, tell, alive, life, woken, wake):
            os.close(fd)  # ``life`` with them: the waiting workers end (once warmed up)
        for pid in waiting:
            os.waitpid(pid, 0)


def _import_everything(home: str) -> None:
    """Every module a relayed command imports, so that no worker imports any: the
    commands' modules, and what a send, a read and a wait on a throwaway team in
    ``home`` import (each worker warms up there: `_warm_up`)."""
    import gc
    import locale  # noqa: F401 - a text stream's encoding imports it
    import shutil
    import threading

    from ralph_mail import MessageBus, create_team
    from ralph_mail.cli.app import full_app
    from ralph_mail.cli.command import parameters

    groups = [full_app()]
    while groups:  # every command's parameters, read once here rather than in each worker
        group = groups.pop()
        groups += group.groups.values()
        for fn in group.commands.values():
            parameters(fn)
    for optional in ("orjson", "ralph_mail.store.nats.backend"):
        try:  # orjson: the codec then calls it itself (the same bytes); nats: --backend
            __import__(optional)
        except ImportError:
            continue
    shutil.rmtree(home, ignore_errors=True)  # a killed server's
    create_team("warm", ["a", "b"], home=home)
    with MessageBus("warm", "a", home=home) as bus:
        bus.set_presence("idle")
        bus.send("b", "text", "warm")
        bus.history("b", 1)
    with MessageBus("warm", "b", home=home) as bus:
        bus.wait_for_messages(timeout=0.001)
        bus.wait_for_messages(timeout=0.001)
    if threading.active_count() > 1:  # a fork would copy a lock another thread holds
        raise RuntimeError("an import started a thread: the server cannot fork safely")
    gc.collect()
    gc.freeze()  # what was imported stays shared with the workers, page for page


def _sources() -> dict[str, tuple[int, int]]:
    """Each imported module file of this package, with its modification time and size."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if name and name.startswith(package + os.sep):
            try:
                status = os.stat(name)
            except OSError:
                continue
            found[name] = (status.st_mtime_ns, status.st_size)
    return found


def _stale(sources: dict[str, tuple[int, int]]) -> bool:
    """Whether a module file of ``sources`` changed (an upgrade, an edit) or went."""
    for name, (mtime, size) in sources.items():
        try:
            status = os.stat(name)
        except OSError:
            return True
        if (status.st_mtime_ns, status.st_size) != (mtime, size):
            return True
    return False


def _bind(path: str) -> socket.socket:
    """A listening socket at ``path``, made beside it and linked in: never over a live
    server's socket (a dead one's is replaced)."""
    import contextlib
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        address, directory_fd = _address(temp)
        try:
            listener.bind(address)
        finally:
            if directory_fd >= 0:
                os.close(directory_fd)
        os.chmod(temp, 0o600)
        listener.listen(64)
        for _ in range(3):
            try:
                os.link(temp, path)
                break
            except FileExistsError:
                if call("status") is not None:
                    raise FileExistsError(f"a warm server already listens on {path}") from None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a dead server's
        else:
            raise FileExistsError(f"cannot take {path}: another server is starting there")
    except BaseException:
        listener.close()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return listener


def _wait_for_work(server: _Server, listener: socket.socket, tell: int, alive: int) -> None:
    """A worker: warm up, take one command, say so, run it, end. Ends at once when the
    server does (``alive`` reads end of file). Never returns."""
    import select

    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _warm_up(server.home, server.served)
        listener.setblocking(False)
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        poller.register(alive, select.POLLIN)
        while True:
            if alive in dict(poller.poll()):
                os._exit(0)
            try:
                conn, _ = listener.accept()
                break
            except BlockingIOError:  # the other worker took it
                continue
        os.write(tell, os.getpid().to_bytes(4, "big"))
        for fd in (tell, alive):
            os.close(fd)
        listener.close()
        conn.setblocking(True)
    except BaseException as exc:
        _log(f"a waiting worker failed: {exc!r}")
        os._exit(0)
    try:
        _work(conn, server)
    finally:
        os._exit(1)  # never back into the server's loop


def _warm_up(home: str, served: int) -> None:
    """Run commands on the throwaway team as a client's would (a send, a read, a tail):
    the pages they touch are this worker's own before a client waits on them (a fork
    shares them until written, and CPython writes each object it uses). Every
    `GC_EVERY` commands served, the team's consumed mail is dropped."""
    from ralph_mail.cli import main as command

    null = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1)
    try:
        os.dup2(null, 1)
        where = ["--home", home, "--team", "warm"]
        if served % GC_EVERY == GC_EVERY - 1:
            command(["gc", *where], relay=False)
        for args in (["send", "b", "warm", "--agent", "a"], ["read", "--agent", "b"],
                     ["tail", "b", "-n", "1", "--agent", "a"]):  # fmt: skip
            command([*args, *where], relay=False)
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _work(conn: socket.socket, server: _Server) -> None:
    """The worker with its client: become it (its request, its streams), run its
    command, answer with the exit code, and end."""
    import socket

    try:
        peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = int.from_bytes(peer[4:8], sys.byteorder)
        if uid != os.getuid():
            _log(f"refused user {uid}")
            os._exit(0)  # another user's process: it hears nothing
        request, fds = _receive(conn)
        if request.get("version") != VERSION or request.get("key") != server.key:
            _log(f"refused a client of version {request.get('version')}, key "
                 f"{request.get('key')} (mine: {VERSION}, {server.key})")  # fmt: skip
            conn.sendall(_REFUSED)
            os._exit(0)
        op = request.get("op")
        if op in ("status", "stop"):
            if op == "stop":
                os.kill(server.pid, signal.SIGTERM)
            conn.sendall(_ACCEPTED + os.getpid().to_bytes(4, "big") + server.describe().encode())
            os._exit(0)
        if op != "run" or _stale(server.sources):  # changed code: the client runs it itself
            conn.sendall(_REFUSED)
            if op == "run":
                _log("a module changed on disk: the server ends")
                os.kill(server.pid, signal.SIGTERM)
            os._exit(0)
        argv = [str(arg) for arg in request["argv"]]
        _become(request, fds)
        conn.sendall(_ACCEPTED + os.getpid().to_bytes(4, "big"))
    except OSError as exc:
        _log(f"a client's request failed: {exc!r}")
        os._exit(0)
    _watch_client(conn)
    sys.argv = ["ralph-mail", *argv]
    from ralph_mail.cli import main as command

    try:
        code = command(argv, relay=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # a bug: reported as the interpreter would have
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            continue
    _answered.append(code)
    try:
        conn.sendall(bytes([code & 0xFF]))
    finally:
        os._exit(code & 0xFF)  # the command closed what it opened; the rest is the server's


def _log(text: str) -> None:
    """One line in the server's log (its stderr: ``warm-KEY.sock.log``)."""
    import time

    try:
        os.write(2, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [{os.getpid()}] {text}\n".encode())
    except OSError:
        return


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    import socket

    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < 4:
        data += _recv_exact(conn, 4 - len(data))
    size = int.from_bytes(data[:4], "big")
    body = data[4:]
    if len(body) < size:
        body += _recv_exact(conn, size - len(body))
    request = marshal.loads(body)
    if not isinstance(request, dict):
        raise ConnectionResetError("not a request")
    return request, fds


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Take the client's working directory, umask, environment, limits and streams."""
    import io
    import resource
    import time

    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    for name, (soft, hard) in request["limits"].items():
        which = getattr(resource, name)
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError):  # above this server's hard limit: as near as it may
            try:
                resource.setrlimit(which, (soft, resource.getrlimit(which)[1]))
            except (OSError, ValueError):
                continue
    given = iter(fds)
    for fd, (name, shape) in enumerate(zip(("stdin", "stdout", "stderr"), request["streams"],
                                           strict=True)):  # fmt: skip
        if shape is None:
            if _is_open(fd):
                os.close(fd)
            setattr(sys, name, None)
            continue
        received = next(given)
        os.dup2(received, fd)
        os.close(received)
        encoding, errors, line_buffering, write_through = shape
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered = io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                                  line_buffering=line_buffering,
                                  write_through=write_through)  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)  # where the terminal's width is asked


def _watch_client(conn: socket.socket) -> None:
    """Interrupt the command when its client goes (killed): nobody would see its output,
    and a read must not consume what nobody prints."""
    import threading

    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        try:
            while conn.recv(1):
                continue
        except OSError:
            pass
        if not _answered:
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, name="ralph-warm-client", daemon=True).start()


#: The worker's exit code once sent: its client's leaving is no interruption then.
_answered: list[int] = []
