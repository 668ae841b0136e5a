"""The warm server's process (`ralph_mail.cli.relay` is its client and says what it does).

The server imports every command once, warms a throwaway team up, and keeps `POOL`
workers forked and waiting on its socket. A worker takes one connection, tells the
server (which forks the next), becomes its client (`_become`), runs the command and
ends with its exit code. The server counts commands in a page shared with every worker,
and ends at SIGTERM (`warm stop`), after its idle time, when its socket is removed, or
when a worker finds a module file changed.
"""

from __future__ import annotations

import marshal
import os
import signal
import sys

from ralph_mail.cli import hold_interrupts
from ralph_mail.cli.relay import (
    ACCEPTED,
    REFUSED,
    VERSION,
    at,
    is_open,
    key,
    recv_exact,
)
from ralph_mail.keepers import exists

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

#: How many workers wait, forked and warmed up, for the next commands.
POOL = 2
#: How often (commands served) a worker's warm-up drops the throwaway team's old mail.
GC_EVERY = 500
#: Workers in a row that end before taking a command (their warm-up fails: a full disk)
#: before the server gives up, rather than fork them again and again.
FAILURES = 5


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
        # A throwaway team's home, where each worker warms up: this server's own (two
        # servers may start at once; one of them will not stay).
        self.home = f"{path}.{self.pid}.home"
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
    """The server process: ``python -c 'from ralph_mail.cli.forkserver import main;
    main()' PATH IDLE``, as `warm start` runs it: detached, stdin and stdout on the null
    device, stderr on its log. It writes ``ready`` once it listens, ``running`` when
    another server took PATH first, or why it cannot, on the descriptor ``RALPH_WARM_FD``."""
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
    except _Taken:
        shutil.rmtree(server.home, ignore_errors=True)
        os.write(said, b"running\n")
        os._exit(0)
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
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the poll: reap now
    told, tell = os.pipe()  # a worker that took a command says so (its pid)
    alive, life = os.pipe()  # ``life`` is this process's alone: its end ends the waiting
    woken, wake = os.pipe()  # a signal wakes the poll (SIGTERM: stop now, not in a second)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    waiting: set[int] = set()
    busy: dict[int, int] = {}  # a worker running a command: its client's pid
    poller = select.poll()
    poller.register(told, select.POLLIN)
    poller.register(woken, select.POLLIN)
    last = time.monotonic()
    failed = 0  # workers in a row that ended while waiting (a warm-up that fails)
    try:
        while not stop:
            for pid in list(waiting | busy.keys()):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    failed += pid in waiting  # it ended before any command came
                    waiting.discard(pid)
                    busy.pop(pid, None)
            _resume_orphans(busy)
            if failed >= FAILURES:
                _log(f"{failed} workers in a row ended before taking a command: the server ends")
                break
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
            for start in range(0, len(data) - 7, 8):
                pid = int.from_bytes(data[start : start + 4], "big")
                waiting.discard(pid)
                busy[pid] = int.from_bytes(data[start + 4 : start + 8], "big")
            server.took(len(data) // 8)
            failed = 0
            last = time.monotonic()
    finally:
        _resume_orphans(busy)  # the last look: nobody looks after this process ends
        signal.set_wakeup_fd(-1)
        for fd in (told, tell, alive, life, woken, wake):
            os.close(fd)  # ``life`` with them: the waiting workers end (once warmed up)
        for pid in waiting:
            os.waitpid(pid, 0)


def _resume_orphans(busy: dict[int, int]) -> None:
    """Go on with each worker (``busy``: its client) whose client is gone: one stopped by
    Ctrl-Z whose client was then killed would stay stopped for good; going on, it sees
    its client's end and ends. (Its process group, the server's, is orphaned from the
    start, so the kernel sends no SIGCONT of its own when the server ends.)"""
    import contextlib

    for pid, client in busy.items():
        if _gone(client):
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGCONT)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended: it does not exist, or is a zombie nobody reaped yet
    (its parent killed with it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc here
        return not exists(pid)


def _import_everything(home: str) -> None:
    """Every module a relayed command imports, so that no worker imports any: the
    commands' modules, and what a send, a read and a wait on a throwaway team in
    ``home`` import (each worker warms up there: `_warm_up`)."""
    import contextlib
    import gc
    import locale  # noqa: F401 - a text stream's encoding imports it
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
    from ralph_mail import store

    store.preload()  # the backends, NATS included (--backend nats://...)
    with contextlib.suppress(ImportError):
        import orjson  # noqa: F401 - the codec then calls it itself: the same bytes
    _forget_the_dead(home)
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


def _forget_the_dead(home: str) -> None:
    """Remove the throwaway homes beside ``home`` of servers that died (kill -9)."""
    import glob
    import shutil

    stem = home.rsplit(".", 2)[0]  # PATH of PATH.PID.home
    for other in glob.glob(f"{glob.escape(stem)}.*.home"):
        pid = other[len(stem) + 1 : -len(".home")]
        if pid.isdigit() and not exists(int(pid)):
            shutil.rmtree(other, ignore_errors=True)


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


def _listens(path: str) -> bool:
    """Whether a server listens on ``path`` (one starting up too: it may not answer yet)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            at(path, probe.connect)
        except OSError:
            return False
    return True


class _Taken(Exception):
    """Another server listens on the path (two `warm start` at once)."""


def _bind(path: str) -> socket.socket:
    """A listening socket at ``path``, made beside it and linked in: never over a live
    server's socket (a dead one's is replaced)."""
    import contextlib
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        at(temp, listener.bind)
        os.chmod(temp, 0o600)
        listener.listen(64)
        for _ in range(3):
            try:
                os.link(temp, path)
                break
            except FileExistsError:
                if _listens(path):
                    raise _Taken(path) from None
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
        import socket

        peer = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)  # pid, uid, gid
        client, uid = (int.from_bytes(peer[i : i + 4], sys.byteorder) for i in (0, 4))
        os.write(tell, os.getpid().to_bytes(4, "big") + client.to_bytes(4, "big"))
        for fd in (tell, alive):
            os.close(fd)
        listener.close()
        conn.setblocking(True)
    except BaseException as exc:
        _log(f"a waiting worker failed: {exc!r}")
        os._exit(0)
    try:
        _work(conn, server, uid)
    finally:
        os._exit(1)  # never back into the server's loop


def _warm_up(home: str, served: int) -> None:
    """Run commands on the throwaway team as a client's would (a send, a read, a tail):
    the pages they touch are this worker's own before a client waits on them (a fork
    shares them until written, and CPython writes each object it uses). Every
    `GC_EVERY` commands served, the team's consumed mail is dropped. Raises when one of
    them fails: such a worker is of no use."""
    from ralph_mail.cli import main as command

    null = os.open(os.devnull, os.O_WRONLY)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)  # (a note that the throwaway's other member is offline)
        where = ["--home", home, "--team", "warm"]
        steps = [["send", "b", "warm", "--agent", "a"], ["read", "--agent", "b"],
                 ["tail", "b", "-n", "1", "--agent", "a"]]  # fmt: skip
        if served % GC_EVERY == GC_EVERY - 1:
            steps.insert(0, ["gc"])
        for args in steps:
            code = command([*args, *where], relay=False)
            if code:
                raise RuntimeError(f"warm-up: {args[0]} on {home} exited {code}")
        sys.stdout.flush()
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def _work(conn: socket.socket, server: _Server, uid: int) -> None:
    """The worker with its client (of user ``uid``): become it (its request, its
    streams), run its command, answer with the exit code, and end."""
    _log_fd[0] = os.dup(2)  # the server's log, while fd 2 becomes the client's stderr
    try:
        if uid != os.getuid():
            _log(f"refused user {uid}")
            os._exit(0)  # another user's process: it hears nothing
        request, fds = _receive(conn)
        if request.get("version") != VERSION or request.get("key") != server.key:
            _log(f"refused a client of version {request.get('version')}, key "
                 f"{request.get('key')} (mine: {VERSION}, {server.key})")  # fmt: skip
            conn.sendall(REFUSED)
            os._exit(0)
        op = request.get("op")
        if op in ("status", "stop"):
            if op == "stop":
                os.kill(server.pid, signal.SIGTERM)
            conn.sendall(ACCEPTED + os.getpid().to_bytes(4, "big") + server.describe().encode())
            os._exit(0)
        if op != "run" or _stale(server.sources):  # changed code: the client runs it itself
            conn.sendall(REFUSED)
            if op == "run":
                _log("a module changed on disk: the server ends")
                os.kill(server.pid, signal.SIGTERM)
            os._exit(0)
        argv = [str(arg) for arg in request["argv"]]
        _become(request, fds)
        # The client passes Ctrl-C on once it has my pid: until the command runs, it
        # is held (a KeyboardInterrupt here would end me with no exit code to answer).
        hold_interrupts()
        conn.sendall(ACCEPTED + os.getpid().to_bytes(4, "big"))
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
    except BaseException as exc:  # a bug: one line to the client, the details logged
        import traceback

        _log("".join(traceback.format_exception(exc)).rstrip())
        from ralph_mail.cli import EXIT_USAGE, error_line

        error_line(f"the warm server's worker failed ({type(exc).__name__}: {exc}): run the "
                   "command again with RALPH_WARM=0, and see the server's log")  # fmt: skip
        code = EXIT_USAGE
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


#: Where `_log` writes: the server's stderr (its log), kept apart in a worker whose fd 2
#: became its client's.
_log_fd = [2]


def _log(text: str) -> None:
    """One line (or a report) in the server's log, ``warm-KEY.sock.log``."""
    import time

    try:
        os.write(_log_fd[0], f"{time.strftime('%Y-%m-%dT%H:%M:%S')} [{os.getpid()}] {text}\n"
                 .encode())  # fmt: skip
    except OSError:
        return


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    import socket

    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if not data:  # a probe (`_listens`): it only wanted to know a server listens
        os._exit(0)
    if len(data) < 4:
        data += recv_exact(conn, 4 - len(data))
    size = int.from_bytes(data[:4], "big")
    body = data[4:]
    if len(body) < size:
        body += recv_exact(conn, size - len(body))
    request = marshal.loads(body)
    if not isinstance(request, dict):
        raise ConnectionResetError("not a request")
    return request, fds


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """Take the client's working directory, umask, environment, limits and streams."""
    import contextlib
    import io
    import locale
    import resource
    import time

    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    with contextlib.suppress(locale.Error):  # LANG, LC_ALL: as the client's interpreter did
        locale.setlocale(locale.LC_CTYPE, "")
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
            if is_open(fd):
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
