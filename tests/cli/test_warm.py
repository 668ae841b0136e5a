"""The warm server (``ralph-mail warm``, ralph_mail/cli/relay.py): a command handed to
it does what it does without it, on the caller's streams, environment and limits; signals
reach it; a killed client's command ends; a changed install or an idle hour ends the
server; without a server a command pays nothing for the relay.

Each test starts its own server in a private directory and stops it, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

import ralph_mail
from ralph_mail import MessageBus, Team
from ralph_mail.cli import warm as warm_command
from tests.helpers.processes import BOUND_S, cli_env, wait_until

ME = ("--agent", "worker-1")


class Warm:
    """One warm server for a test: its directory and environment, and commands run
    through it (or, with ``RALPH_WARM=0``, without it)."""

    def __init__(self, home: Path, where: Path, pythonpath: str | None = None) -> None:
        self.where = where
        self.env = cli_env(home, RALPH_TEAM="demo", RALPH_WARM_DIR=str(where))
        self.python = [sys.executable]
        if pythonpath is not None:  # this path alone: no site (an editable install's hook)
            self.env["PYTHONPATH"] = pythonpath
            self.python.append("-S")
        self.pid = 0

    def run(self, *args: str, warm: bool = True, env: dict[str, str] | None = None,
            **more: object) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        """``python -m ralph_mail ARGS``; ``more``: subprocess.run's options (default:
        output captured, nothing on stdin)."""
        env = dict(env or self.env, **({} if warm else {"RALPH_WARM": "0"}))
        options: dict[str, object] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE,
                                      "stderr": subprocess.PIPE, "cwd": self.where.parent,
                                      **more}  # (not the checkout: -m would import it)  # fmt: skip
        if "input" in options:
            del options["stdin"]
        return subprocess.run([*self.python, "-m", "ralph_mail", *args], env=env,
                              timeout=BOUND_S, **options)  # type: ignore[call-overload]  # fmt: skip

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*self.python, "-m", "ralph_mail", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=self.env, cwd=self.where.parent)  # fmt: skip

    def start(self, *options: str) -> None:
        done = self.run("warm", "start", *options)
        assert done.returncode == 0, done.stderr
        found = re.search(rb"pid (\d+)", done.stdout)
        assert found, done.stdout
        self.pid = int(found.group(1))

    def served(self) -> int:
        done = self.run("warm", "status")
        assert done.returncode == 0, done.stderr
        found = re.search(rb"^served (\d+)$", done.stdout, re.M)
        assert found, done.stdout
        return int(found.group(1))

    def worker_of(self, client: subprocess.Popen[bytes]) -> int:
        """The server's worker running ``client``'s command: the child of the server
        whose standard output is the client's (the very pipe)."""
        assert client.stdout is not None
        return self.worker_on(f"pipe:[{os.fstat(client.stdout.fileno()).st_ino}]")

    def worker_on(self, output: str) -> int:
        """The server's worker whose standard output is ``output`` (as /proc names it: a
        pipe, a terminal), or 0 when there is none yet."""
        for pid in _children(self.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/1") == output:
                    return pid
        return 0


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) == parent:
                    found.append(int(entry))
    return found


def ended(pid: int, timeout: float = BOUND_S) -> bool:
    """Whether process ``pid`` (not necessarily our child) ends within ``timeout``."""
    return warm_command.ended(pid, timeout)


@contextlib.contextmanager
def serving(warm: Warm, *options: str) -> Iterator[Warm]:
    warm.start(*options)
    try:
        yield warm
    finally:
        if warm.run("warm", "stop").returncode == 0:
            assert ended(warm.pid)
        elif not ended(warm.pid, 0):  # a server this test started, that did not stop
            os.kill(warm.pid, signal.SIGKILL)


@pytest.fixture
def where(tmp_path: Path) -> Path:
    path = tmp_path / "warm"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def warm(team: Team, home: Path, where: Path) -> Iterator[Warm]:
    with serving(Warm(home, where)) as server:
        yield server


def _shape(done: subprocess.CompletedProcess[bytes]) -> tuple[int, bytes, bytes]:
    """Exit code and output, with message ids and times made alike."""

    def plain(data: bytes | None) -> bytes:
        data = re.sub(rb"\b[0-9a-f]{12}\b", b"ID", data or b"")
        return re.sub(rb"\d{4}-\d\d-\d\dT[\d:.]+Z", b"TIME", data)

    return done.returncode, plain(done.stdout), plain(done.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["send", "lead", "parsing done", *ME],
        ["send", "lead", "x", "--agent", "lead"],  # to itself: refused, exit 2
        ["send", "nobody", "x", *ME],  # unknown: exit 2, one line
        ["read", "--agent", "lead", "--json"],
        ["wait", "--timeout", "0", "--agent", "worker-2"],  # nothing: exit 1
        ["tail", "lead", "-n", "5", *ME],
        ["history", "lead", "-n", "5", *ME],
        ["status", "parsing", "--state", "working", *ME],
        ["presence"],
        ["send", "--help"],
        ["sned", "lead", "x"],  # a mistyped command: the cold path's answer
    ],
    ids=lambda args: "-".join(args[:2]),
)
def test_a_command_does_through_the_server_what_it_does_without_it(
    warm: Warm, args: list[str]
) -> None:
    """The same exit code, output and errors, cold and warm, and the warm one was
    served by the server (a command it does not take runs in the client)."""
    lead, worker = MessageBus("demo", "lead"), MessageBus("demo", "worker-1")
    for _ in range(5):
        worker.send("lead", "text", "one")
    lead.poll()  # five in the history, none unread
    before = warm.served()
    worker.send("lead", "text", "one")
    cold = warm.run(*args, warm=False)
    worker.send("lead", "text", "one")
    hot = warm.run(*args)
    assert _shape(hot) == _shape(cold)
    if args[0] != "sned":  # `warm status` is one more (counted as its worker starts)
        wait_until(lambda: warm.served() >= before + 2, "the command counted")


def test_stdin_environment_and_directory_are_the_callers(warm: Warm, home: Path,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """A body on stdin, another team named in the environment, a home given relative to
    the working directory: each is the client's, command after command."""
    ralph_mail.create_team("other", ["a", "b"], home=home)
    assert warm.run("send", "lead", *ME, input=b"from stdin").returncode == 0
    env = dict(warm.env, RALPH_TEAM="other", RALPH_AGENT="a")
    assert warm.run("send", "b", "to the other team", env=env).returncode == 0
    relative = os.path.relpath(home, tmp_path)
    done = warm.run("read", "--agent", "b", "--team", "other", "--home", relative,
                    cwd=tmp_path)  # fmt: skip
    assert b"to the other team" in done.stdout, done.stderr
    (message,) = MessageBus("demo", "lead", home=home).poll()
    assert message.content == "from stdin"


def test_the_clients_descriptor_limit_holds_in_the_worker(warm: Warm) -> None:
    """``ulimit -n`` of the client is the command's (a worker is forked from a server
    started under another limit)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))  # fmt: skip

    client = subprocess.Popen([sys.executable, "-m", "ralph_mail", "wait", "--timeout", "60",
                               "--agent", "worker-2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=warm.env, cwd=warm.where.parent,
                              preexec_fn=limited)  # fmt: skip
    try:
        wait_until(lambda: warm.worker_of(client), "the worker of the wait")
        limits = Path(f"/proc/{warm.worker_of(client)}/limits").read_text()
        assert re.search(r"Max open files\s+200\s", limits), limits
    finally:
        client.send_signal(signal.SIGINT)
        assert client.wait(BOUND_S) == 130
        for stream in (client.stdout, client.stderr):
            assert stream is not None
            stream.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_client_reaches_the_command(warm: Warm, signum: int) -> None:
    """Ctrl-C ends a wait with 130 as without the server; SIGTERM ends the client by
    SIGTERM; the worker ends either way."""
    client = warm.popen("wait", "--timeout", "60", "--agent", "worker-2")
    with client:
        wait_until(lambda: warm.worker_of(client), "the worker of the wait")
        worker = warm.worker_of(client)
        client.send_signal(signum)
        code = client.wait(BOUND_S)
        assert code == (130 if signum == signal.SIGINT else -signal.SIGTERM)
        assert ended(worker)


def test_ctrl_c_as_soon_as_the_worker_takes_the_command_exits_130(warm: Warm) -> None:
    """Ctrl-C passed on the moment the worker took the command, before the command line
    runs it, is held as a fresh process holds one during its start: 130, never the
    worker gone without an exit code (the client then died by SIGINT). Ten tries: the
    moment is a race, which about one try in six lost before."""
    for _ in range(10):
        client = warm.popen("wait", "--timeout", "60", "--agent", "worker-2")
        with client:
            wait_until(lambda c=client: warm.worker_of(c), "the worker of the wait")
            client.send_signal(signal.SIGINT)
            assert client.wait(BOUND_S) == 130


def test_a_killed_client_leaves_no_command_behind_to_consume_mail(warm: Warm,
                                                                  home: Path) -> None:  # fmt: skip
    """kill -9 of a waiting client interrupts its worker: the message that comes next
    is not consumed by a command nobody reads."""
    client = warm.popen("wait", "--timeout", "60", "--agent", "worker-2")
    with client:
        wait_until(lambda: warm.worker_of(client), "the worker of the wait")
        worker = warm.worker_of(client)
        client.kill()
        client.wait(BOUND_S)
        assert ended(worker)
    MessageBus("demo", "lead", home=home).send("worker-2", "text", "after the kill")
    done = warm.run("read", "--agent", "worker-2", warm=False)
    assert b"after the kill" in done.stdout


def test_a_closed_stdout_is_closed_for_the_command(warm: Warm) -> None:
    """``>&-`` reaches the command as it is: the same exit and line as without the server."""
    args = ("send", "lead", "x", *ME)
    cold = warm.run(*args, warm=False, stdout=None, preexec_fn=lambda: os.close(1))
    hot = warm.run(*args, stdout=None, preexec_fn=lambda: os.close(1))
    assert (hot.returncode, _shape(hot)[2]) == (cold.returncode, _shape(cold)[2])


def _copy_of_the_package(tmp_path: Path) -> tuple[Path, str]:
    """A copy of ralph_mail to change, and the module path that imports it (run with -S)."""
    copy = tmp_path / "install"
    shutil.copytree(Path(ralph_mail.__file__).parent, copy / "ralph_mail",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return copy, os.pathsep.join([str(copy), sysconfig.get_paths()["purelib"]])


def test_a_changed_module_sends_commands_back_to_their_clients(team: Team, home: Path,
                                                               where: Path,
                                                               tmp_path: Path) -> None:  # fmt: skip
    """After an upgrade (a module file changed), the next command runs in its client,
    right, and the server ends."""
    copy, pythonpath = _copy_of_the_package(tmp_path)
    with serving(Warm(home, where, pythonpath)) as warm:
        assert warm.run("send", "lead", "before", *ME).returncode == 0
        os.utime(copy / "ralph_mail" / "message.py", ns=(1, 1))
        done = warm.run("send", "lead", "after", *ME)
        assert done.returncode == 0, done.stderr
        assert ended(warm.pid)
        assert warm.run("warm", "status").returncode == 1
    contents = [m.content for m in MessageBus("demo", "lead", home=home).poll()]
    assert contents == ["before", "after"]


def test_start_stop_and_status_say_what_runs(team: Team, home: Path, where: Path) -> None:
    """A second start leaves the first server; stop ends it; then stop and status say
    none runs (exit 1, one line) and commands run in their clients."""
    warm = Warm(home, where)
    with serving(warm):
        again = warm.run("warm", "start")
        assert again.returncode == 0 and f"pid {warm.pid}".encode() in again.stdout
        status = warm.run("warm", "status", "--json")
        assert f'"pid":{warm.pid}'.encode() in status.stdout
    for args in (("warm", "stop"), ("warm", "status")):
        done = warm.run(*args)
        assert done.returncode == 1
        assert done.stderr.startswith(b"ralph-mail: note: no warm server runs")
        assert done.stderr.count(b"\n") == 1
    assert warm.run("send", "lead", "cold", *ME).returncode == 0
    assert not list(where.iterdir())  # the socket, the throwaway team, an empty log: gone


def test_a_directory_open_to_others_is_refused(team: Team, home: Path, where: Path) -> None:
    """Another user could reach a socket in a directory open to others: start refuses it
    in one line (exit 2)."""
    where.chmod(0o755)
    done = Warm(home, where).run("warm", "start")
    assert done.returncode == 2
    assert b"open to others" in done.stderr and done.stderr.count(b"\n") == 1


def test_an_idle_server_ends_by_itself(team: Team, home: Path, where: Path) -> None:
    """``--idle`` seconds without a command end the server, its socket with it."""
    with serving(Warm(home, where), "--idle", "0.5") as warm:
        assert ended(warm.pid)
        assert not list(where.iterdir())


def test_a_removed_socket_ends_its_server(team: Team, home: Path, where: Path) -> None:
    """A server whose socket was removed (its directory cleaned) ends: nobody can reach it."""
    with serving(Warm(home, where)) as warm:
        for path in where.glob("*.sock"):
            path.unlink()
        assert ended(warm.pid)


def test_without_a_server_the_relay_costs_a_stat(team: Team, home: Path, where: Path) -> None:
    """No server: the relay declines without importing socket (a command's start-up)."""
    code = ("import sys; from ralph_mail.cli.relay import relay; "
            "print(relay(['send', 'lead', 'x'], []), 'socket' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          env=Warm(home, where).env, timeout=BOUND_S)  # fmt: skip
    assert done.stdout == b"None False\n", done.stderr


def test_the_server_holds_no_more_descriptors_after_many_commands(team: Team, home: Path,
                                                                 where: Path) -> None:  # fmt: skip
    """A long-lived server under a 256-descriptor limit: a hundred commands later it
    holds what it held after the first."""
    warm = Warm(home, where)
    with serving(warm, "--idle", "600"):
        resource.prlimit(warm.pid, resource.RLIMIT_NOFILE, (256, 256))
        assert warm.run("send", "lead", "first", *ME).returncode == 0
        held = len(os.listdir(f"/proc/{warm.pid}/fd"))
        for n in range(100):
            assert warm.run("send", "lead", f"m{n}", *ME).returncode == 0
        assert len(os.listdir(f"/proc/{warm.pid}/fd")) == held
        assert warm.served() >= 101


def test_commands_at_once_each_get_a_worker(warm: Warm, home: Path) -> None:
    """Twelve clients at once (more than the workers waiting): each is served, once."""
    clients = [warm.popen("send", "lead", f"m{n}", *ME) for n in range(12)]
    for client in clients:
        with client:
            assert client.wait(BOUND_S) == 0
    contents = sorted(m.content for m in MessageBus("demo", "lead", home=home).poll())
    assert contents == sorted(f"m{n}" for n in range(12))


def test_workers_that_cannot_warm_up_end_the_server(team: Team, home: Path,
                                                    where: Path) -> None:  # fmt: skip
    """A throwaway team the workers cannot warm up in (here a file where its home was):
    the server ends, saying why in its log, instead of forking workers without end; the
    command under way is served and the next runs in its client."""
    with serving(Warm(home, where)) as warm:
        (throwaway,) = where.glob(f"*.{warm.pid}.home")
        throwaway.rename(where.parent / "moved")  # at once (a worker may be warming up)
        throwaway.write_text("not a home")
        assert warm.run("send", "lead", "served", *ME).returncode == 0
        assert ended(warm.pid)
        (log,) = where.glob("*.log")
        assert "ended before taking a command" in log.read_text()
        assert warm.run("send", "lead", "in the client", *ME).returncode == 0


def test_two_starts_at_once_leave_one_server(team: Team, home: Path, where: Path) -> None:
    """Two `warm start` racing: both exit 0, naming the same server, and one runs."""
    warm = Warm(home, where)
    starts = [warm.popen("warm", "start") for _ in range(2)]
    outputs = []
    for start in starts:
        with start:
            out, err = start.communicate(timeout=BOUND_S)
            assert start.returncode == 0, err
            outputs.append(out)
    pids = {int(re.search(rb"pid (\d+)", out).group(1)) for out in outputs}  # type: ignore[union-attr]
    assert len(pids) == 1
    warm.pid = pids.pop()
    assert warm.run("warm", "stop").returncode == 0
    assert ended(warm.pid)


def test_a_stopped_server_lets_its_commands_finish(warm: Warm, home: Path) -> None:
    """`warm stop` while a wait runs through the server: the wait goes on and gets its
    message."""
    client = warm.popen("wait", "--timeout", "60", "--agent", "worker-2")
    with client:
        wait_until(lambda: warm.worker_of(client), "the worker of the wait")
        assert warm.run("warm", "stop").returncode == 0
        assert ended(warm.pid)
        MessageBus("demo", "lead", home=home).send("worker-2", "text", "still here")
        out, _ = client.communicate(timeout=BOUND_S)
        assert client.returncode == 0 and b"still here" in out


def test_a_killed_server_leaves_commands_working(team: Team, home: Path, where: Path) -> None:
    """kill -9 of the server: its waiting workers end, commands run in their clients
    (its socket is left, and refuses), and `warm start` replaces it."""
    with serving(Warm(home, where)) as warm:
        workers = _children(warm.pid)
        os.kill(warm.pid, signal.SIGKILL)
        assert ended(warm.pid)
        assert all(ended(worker) for worker in workers)
        assert list(where.glob("*.sock"))
        assert warm.run("send", "lead", "in the client", *ME).returncode == 0
        warm.start()
        assert warm.run("send", "lead", "on the new server", *ME).returncode == 0


def test_a_terminal_is_a_terminal_for_the_command(warm: Warm, home: Path) -> None:
    """On a terminal (a pseudo-terminal here, 100 columns wide) a command writes what it
    writes there without the server: the same table, help wrapped at the same width."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    worker = MessageBus("demo", "worker-1", home=home)
    worker.send("lead", "text", "on a terminal " * 4)
    outputs = []
    for hot, args in ((False, ["presence"]), (True, ["presence"]), (False, ["send", "--help"]),
                      (True, ["send", "--help"])):  # fmt: skip
        main, side = pty.openpty()
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        try:
            env = {k: v for k, v in warm.env.items() if k not in ("COLUMNS", "LINES")}
            done = warm.run(*args, warm=hot, stdout=side, env=env | {"TERM": "xterm"})
            assert done.returncode == 0, done.stderr
            chunks = []
            while select.select([main], [], [], 0.5)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal's other side closed: all read
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            outputs.append(b"".join(chunks))
        finally:
            os.close(side)
            os.close(main)
    assert outputs[0] == outputs[1]
    assert "─".encode() in outputs[0]  # rich's table: the command knew it had a terminal
    assert outputs[2] == outputs[3]
    assert max(len(line) for line in outputs[2].splitlines()) > 80  # the terminal's width


@pytest.mark.parametrize("server_ends", [False, True], ids=["server-on", "server-ends"])
def test_a_stopped_worker_whose_client_was_killed_ends(warm: Warm, server_ends: bool) -> None:
    """A worker stopped (as Ctrl-Z stops it) whose client is then killed with SIGKILL:
    the server starts it again, and it ends (no stopped process is left behind); also when
    the server is sent SIGTERM at once after the kill, by its last look (once it is gone
    nobody would: its process group is orphaned from the start, so the kernel sends the
    worker nothing)."""
    client = warm.popen("wait", "--timeout", "60", "--agent", "worker-2")
    with client:
        wait_until(lambda: warm.worker_of(client), "the worker of the wait")
        worker = warm.worker_of(client)
        os.kill(worker, signal.SIGSTOP)
        client.kill()
        client.wait(BOUND_S)
        if server_ends:
            os.kill(warm.pid, signal.SIGTERM)
            assert ended(warm.pid)
        assert ended(worker)


def test_a_bug_in_a_worker_is_one_line_and_logged(team: Team, home: Path, where: Path,
                                                  tmp_path: Path) -> None:  # fmt: skip
    """A command that raises what no command should (a bug, injected here into a copy of
    the package): one line on stderr and exit 2, never a traceback; the traceback goes
    to the server's log."""
    copy, pythonpath = _copy_of_the_package(tmp_path)
    app = copy / "ralph_mail" / "cli" / "app.py"
    head = "def run(args: Sequence[str]) -> int:\n"
    bug = '    if os.environ.get("RALPH_TEST_BUG"):\n        raise RuntimeError("injected bug")\n'
    assert head in app.read_text()
    app.write_text(app.read_text().replace(head, head + bug))
    with serving(Warm(home, where, pythonpath)) as warm:
        done = warm.run("send", "lead", "x", *ME, env=dict(warm.env, RALPH_TEST_BUG="1"))
        assert done.returncode == 2
        assert done.stderr.startswith(b"ralph-mail: error: the warm server's worker failed "
                                      b"(RuntimeError: injected bug)")  # fmt: skip
        assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr
        (log,) = where.glob("*.log")
        assert "Traceback" in log.read_text() and "injected bug" in log.read_text()
        assert warm.run("send", "lead", "fine", *ME).returncode == 0


class _Shell:
    """An interactive bash with job control on a pseudo-terminal of its own, as a person
    at a terminal has: each command runs in its own process group, in the foreground, and
    Ctrl-Z stops it (bash leads the session, so the group is never orphaned)."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        import pty

        shell = shutil.which("bash")
        if shell is None:
            pytest.skip("no bash on this system")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: bash, and nothing of pytest's after this
            try:
                os.chdir(cwd)
                os.execve(shell, [shell, "--norc", "--noprofile", "-i"], env | {"PS1": "$ "})
            finally:
                os._exit(127)
        self.seen = b""

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def expect(self, pattern: bytes) -> bytes:
        """What the terminal shows up to ``pattern`` (a regex), within BOUND_S."""
        import select
        import time

        deadline = time.monotonic() + BOUND_S
        while (found := re.search(pattern, self.seen)) is None:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the terminal never showed {pattern!r}: {self.seen[-500:]!r}"
            if select.select([self.fd], [], [], remaining)[0]:
                self.seen += os.read(self.fd, 65536)
        shown, self.seen = self.seen[: found.end()], self.seen[found.end() :]
        return shown

    def close(self) -> None:
        """End bash and every job it still has: the processes of its session."""
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError, IndexError):
                if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text()
                                           .rpartition(")")[2].split()[3]) == self.pid:  # fmt: skip
                    os.kill(int(entry), signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def _state(pid: int) -> str:
    """The state letter of process ``pid`` (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_ctrl_z_stops_the_command_and_fg_goes_on(warm: Warm, home: Path) -> None:
    """At a terminal, Ctrl-Z on a command the server runs stops it (its worker too), the
    shell says so, and ``fg`` starts both again: the mail that comes then is delivered."""
    shell = _Shell(warm.env, warm.where.parent)
    try:
        shell.expect(rb"\$ ")
        shell.type(f"{sys.executable} -m ralph_mail wait --timeout 60 --agent worker-2\n"
                   .encode())  # fmt: skip
        terminal = os.readlink(f"/proc/{shell.pid}/fd/0")  # the shell's, so the command's
        wait_until(lambda: warm.worker_on(terminal), "the worker of the wait")
        worker = warm.worker_on(terminal)
        shell.type(b"\x1a")  # Ctrl-Z
        shell.expect(rb"Stopped.*\r?\n.*\$ ")
        wait_until(lambda: _state(worker) == "T", "the worker stopped")
        shell.type(b"fg\n")
        wait_until(lambda: _state(worker) != "T", "the worker started again")
        MessageBus("demo", "lead", home=home).send("worker-2", "text", "after fg")
        shell.expect(rb"after fg")
        shell.type(b"echo rc=$?\n")
        assert shell.expect(rb"rc=\d+").endswith(b"rc=0")
        assert ended(worker)
    finally:
        shell.close()
