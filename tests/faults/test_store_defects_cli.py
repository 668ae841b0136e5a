"""Storage defects, process level: second consumers, stopped lock holders, files that are
not what they should be (directories, FIFOs, symlinks, a home that is a file), and teams
deleted under a running process.

Every command runs as ``python -m ralph_mail`` in its own process, bounded by
``TIMEOUT_S``: a hang fails the test with ``TimeoutExpired`` (the process is killed).
Children are started through the ``procs`` fixture, which kills and reaps them whatever
happens; a child stopped with SIGSTOP is continued and killed in a ``finally``.
Handshakes are lines a child prints once it holds what the test needs ("ready" after a
claim, "locked" after a flock), or, for a ``ralph-mail wait`` that prints nothing while it
waits, the inotify descriptor it opens once it is waiting (/proc/PID/fd).

The numbers in the section titles are the issue's.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, MessageType, Team
from tests.helpers.faultkit import record, tree
from tests.helpers.processes import Processes, cli_env

#: The bound on every process a test runs or waits for.
TIMEOUT_S = 20.0
LEAD = ("--team", "demo", "--agent", "lead")
AS_WORKER = ("--team", "demo", "--agent", "worker-1")


def _mode_000_holds() -> bool:
    """Whether a directory of mode 000 is refused to this process (not so for root with
    CAP_DAC_OVERRIDE): the mode-000 faults are skipped where it is not."""
    with tempfile.TemporaryDirectory() as scratch:
        probe = Path(scratch, "probe")
        probe.mkdir(mode=0o000)
        try:
            os.listdir(probe)
        except PermissionError:
            return True
        finally:
            probe.chmod(0o700)
    return False


MODE_000_HOLDS = _mode_000_holds()


# -- helpers ------------------------------------------------------------------------------


def cli(
    home: Path, *args: str, input: bytes = b"", **env: str
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m ralph_mail ARGS`` with ``home``, bounded by TIMEOUT_S."""
    return subprocess.run(
        [sys.executable, "-m", "ralph_mail", *args],
        input=input,
        capture_output=True,
        env=cli_env(home, **env),
        timeout=TIMEOUT_S,
    )


def start(procs: Processes, home: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``python -m ralph_mail ARGS`` in the background; procs reaps it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(home),
    )
    procs.started.append(proc)
    return proc


def one_error_line(done: subprocess.CompletedProcess[bytes], code: int = 2) -> str:
    """Assert the command failed with ``code`` and one ``ralph-mail: error:`` line on
    stderr, no traceback; return that line."""
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert done.returncode == code, (done.returncode, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ralph-mail: error: "), err
    return lines[0]


def no_traceback(done: subprocess.CompletedProcess[bytes], code: int) -> None:
    """Assert exit ``code`` and no traceback on stderr."""
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert done.returncode == code, (done.returncode, err, done.stdout.decode(errors="replace"))


def expect_line(proc: subprocess.Popen[bytes]) -> bytes:
    """The first line ``proc`` prints, read within TIMEOUT_S (b"" if it exits first)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + TIMEOUT_S
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no line from process {proc.pid} within {TIMEOUT_S}s: {data!r}"
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                return data
            data += chunk
    return data[: data.index(b"\n") + 1]


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for an observable state another process reaches."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {TIMEOUT_S}s"
        time.sleep(0.005)


def is_waiting(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` is blocked in its wait: it has an inotify descriptor, its
    doorbell or its polling note (under the team's bells/) open."""
    try:
        names = os.listdir(f"/proc/{proc.pid}/fd")
    except FileNotFoundError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{proc.pid}/fd/{name}")
            if target == "anon_inode:inotify" or "/bells/" in target:
                return True
    return False


def is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")


def send(to: str = "lead", content: str = "hello", **kwargs: object) -> str:
    """Send from worker-1 through the library; return the id."""
    bus = MessageBus("demo", "worker-1")
    try:
        return bus.send(to, MessageType.TEXT, content, **kwargs).id  # type: ignore[arg-type]
    finally:
        bus.close()


def root(home: Path) -> Path:
    return home / "teams" / "demo"


def inbox(home: Path, agent: str = "lead") -> Path:
    return root(home) / "mailbox" / f"{agent}.jsonl"


def ids_in(output: bytes) -> list[str]:
    """The ids of the messages a ``--json`` command printed."""
    return [orjson.loads(line)["id"] for line in output.splitlines() if line.strip()]


# -- 6: one consumer per inbox ------------------------------------------------------------

CONSUMER = """
import sys
from ralph_mail import MessageBus
bus = MessageBus("demo", "lead")
bus.peek()
print("ready", flush=True)
sys.stdin.readline()
print(" ".join(m.id for m in bus.poll()), flush=True)
"""


def consumer(procs: Processes, home: Path) -> subprocess.Popen[bytes]:
    """A process that consumes lead's inbox (it peeked) and polls when told to."""
    proc = procs.python(CONSUMER, env=cli_env(home))
    assert expect_line(proc) == b"ready\n", proc.stderr.read() if proc.stderr else b""
    return proc


def test_a_person_reading_an_inbox_another_process_consumes_is_refused(
    team: Team, procs: Processes
) -> None:
    """While a process consumes lead's inbox, a person's 'read --agent lead' exits 2
    naming that process's pid and consumes nothing: the plan stays for the consumer."""
    holder = consumer(procs, team.home)
    plan = MessageBus("demo", "worker-1").send("lead", MessageType.PLAN_SUBMISSION, "the plan")
    line = one_error_line(cli(team.home, "read", *LEAD))
    assert str(holder.pid) in line
    out, _ = holder.communicate(b"go\n", timeout=TIMEOUT_S)
    assert out.split() == [plan.id.encode()]
    record(messages=1)


SECOND = """
import sys
from ralph_mail import MailError, MessageBus
bus = MessageBus("demo", "lead")
try:
    if sys.argv[1] == "poll":
        got = bus.poll()
    elif sys.argv[1] == "peek":
        got = bus.peek()
    else:
        got = bus.wait_for_messages(timeout=1)
    print("got", len(got))
except MailError as exc:
    print("MailError:", exc)
"""


@pytest.mark.parametrize("operation", ["poll", "peek", "wait_for_messages"])
def test_a_second_consumer_process_is_refused_naming_the_first(
    team: Team, procs: Processes, operation: str
) -> None:
    """A second process's poll, peek or wait on an inbox another process consumes raises
    MailError naming the first process's pid."""
    holder = consumer(procs, team.home)
    send()
    second = procs.python(SECOND, operation, env=cli_env(team.home))
    out, err = second.communicate(timeout=TIMEOUT_S)
    assert out.startswith(b"MailError:"), (out, err)
    assert str(holder.pid).encode() in out
    record(messages=1)


def test_two_waits_never_print_the_same_message(team: Team, procs: Processes) -> None:
    """Of two 'ralph-mail wait's on one inbox, the second exits 2 naming the first's pid,
    and a message that comes is printed once, by the first."""
    first = start(procs, team.home, "wait", "--timeout", str(TIMEOUT_S), *LEAD)
    until(lambda: is_waiting(first), "the first wait waiting")
    second = start(procs, team.home, "wait", "--timeout", str(TIMEOUT_S), *LEAD)
    until(lambda: second.poll() is not None or is_waiting(second), "the second wait settled")
    sent = send()
    out1, err1 = first.communicate(timeout=TIMEOUT_S)
    out2, err2 = second.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0 and sent.encode() in out1, (first.returncode, err1)
    assert sent.encode() not in out2, "both waits printed the message"
    line = one_error_line(subprocess.CompletedProcess(second.args, second.returncode, out2, err2))
    assert str(first.pid) in line
    record(messages=1)


def test_a_second_lead_is_refused_naming_the_first(team: Team, procs: Processes) -> None:
    """A second 'ralph-mail lead' beside a running one exits 2 naming the first's pid."""
    MessageBus("demo", "worker-1").send(
        "lead", MessageType.STATUS_UPDATE, "parsing", {"state": "working"}
    )
    first = start(procs, team.home, "lead", "--team", "demo")
    assert b"worker-1" in expect_line(first)  # it handled the status: it consumes the inbox
    line = one_error_line(cli(team.home, "lead", "--team", "demo", "--timeout", "3"))
    assert str(first.pid) in line
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=TIMEOUT_S)
    record(messages=1)


@pytest.mark.parametrize(
    "command", [("read", "--peek", *LEAD), ("tail", "lead", "--team", "demo")], ids=["peek", "tail"]
)
def test_looking_at_an_inbox_another_process_consumes_works(
    team: Team, procs: Processes, command: tuple[str, ...]
) -> None:
    """'read --peek' and 'tail' (which consume nothing) show lead's inbox while another
    process consumes it."""
    consumer(procs, team.home)
    sent = send()
    done = cli(team.home, *command)
    no_traceback(done, 0)
    assert sent.encode() in done.stdout
    record(messages=1)


@pytest.mark.parametrize("end", ["exits", "killed -9"])
def test_an_inbox_is_free_again_once_its_consumer_is_gone(
    team: Team, procs: Processes, end: str
) -> None:
    """Once the consuming process exits or is killed -9, 'read' consumes the inbox."""
    holder = consumer(procs, team.home)
    if end == "exits":
        holder.communicate(b"go\n", timeout=TIMEOUT_S)
    else:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=TIMEOUT_S)
    sent = send()
    done = cli(team.home, "read", *LEAD)
    no_traceback(done, 0)
    assert sent.encode() in done.stdout
    record(messages=1, kills=int(end != "exits"))


# -- 7: a process stopped while holding an inbox lock -------------------------------------

HOLDER = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # stopped with the lock held, as Ctrl-Z does
"""


@contextlib.contextmanager
def stopped_holder(procs: Processes, home: Path) -> Iterator[int]:
    """A process stopped (SIGSTOP) while it holds lead's inbox lock; yields its pid.
    Always continued and killed afterwards."""
    holder = procs.python(HOLDER, str(inbox(home)), env=cli_env(home))
    try:
        assert expect_line(holder) == b"locked\n"
        until(lambda: is_stopped(holder.pid), "the holder stopped")
        yield holder.pid
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=TIMEOUT_S)


def test_a_stopped_lock_holder_does_not_block_wait(team: Team, procs: Processes) -> None:
    """With a stopped process holding lead's inbox lock, 'wait --timeout 1' on an empty
    inbox exits 1 (nothing came), or 2 with a clear error, within its bound."""
    with stopped_holder(procs, team.home):
        done = cli(team.home, "wait", "--timeout", "1", *LEAD)
    if done.returncode == 2:
        one_error_line(done)
    else:
        no_traceback(done, 1)
    record(faults=1)


def test_a_stopped_lock_holder_does_not_block_read(team: Team, procs: Processes) -> None:
    """With a stopped process holding lead's inbox lock, 'read' prints what is waiting."""
    sent = [send(content=f"m{n}") for n in range(2)]
    with stopped_holder(procs, team.home):
        done = cli(team.home, "read", "--json", *LEAD)
    no_traceback(done, 0)
    assert ids_in(done.stdout) == sent
    record(messages=2, faults=1)


def test_a_stopped_lock_holder_does_not_block_tail(team: Team, procs: Processes) -> None:
    """With a stopped process holding lead's inbox lock, 'tail -n 5' prints the inbox."""
    sent = [send(content=f"m{n}") for n in range(2)]
    with stopped_holder(procs, team.home):
        done = cli(team.home, "tail", "lead", "-n", "5", "--json", "--team", "demo")
    no_traceback(done, 0)
    assert ids_in(done.stdout) == sent
    record(messages=2, faults=1)


def test_a_stopped_lock_holder_makes_gc_fail_clearly(team: Team, procs: Processes) -> None:
    """With a stopped process holding lead's inbox lock, 'gc' (which must lock it to
    compact) exits 2 with one clear error line instead of hanging."""
    send()
    MessageBus("demo", "lead").poll()  # consumed: gc has something to drop
    with stopped_holder(procs, team.home):
        done = cli(team.home, "gc", "--team", "demo")
    one_error_line(done)
    record(messages=1, faults=1)


def test_doctor_reports_a_stopped_lock_holder_by_pid(team: Team, procs: Processes) -> None:
    """With a stopped process holding lead's inbox lock, 'doctor' exits 3 naming its pid."""
    with stopped_holder(procs, team.home) as pid:
        done = cli(team.home, "doctor")
    no_traceback(done, 3)
    assert str(pid).encode() in done.stdout + done.stderr
    record(faults=1)


# -- 8: failures of the file system are one line, exit 2 ----------------------------------

COMMANDS = {
    "send": ("send", "lead", "hello", *AS_WORKER),
    "read": ("read", *LEAD),
    "read --peek": ("read", "--peek", *LEAD),
    "tail": ("tail", "lead", "--team", "demo"),
    "wait": ("wait", "--timeout", "1", *LEAD),
    "gc": ("gc", "--team", "demo"),
}


@pytest.mark.parametrize("command", ["send", "read", "tail", "wait"])
def test_an_inbox_that_is_a_directory_is_one_error_line(team: Team, command: str) -> None:
    """An inbox that is a directory: send, read, tail and wait exit 2 with one line."""
    inbox(team.home).unlink()
    inbox(team.home).mkdir(mode=0o700)
    one_error_line(cli(team.home, *COMMANDS[command]))
    record(faults=1)


def test_doctor_reports_an_inbox_that_is_a_directory(team: Team) -> None:
    """An inbox that is a directory: doctor exits 3, no traceback."""
    inbox(team.home).unlink()
    inbox(team.home).mkdir(mode=0o700)
    no_traceback(cli(team.home, "doctor"), 3)
    record(faults=1)


def break_directory(path: Path, how: str) -> None:
    """Make directory ``path`` unusable: replaced by a regular file, or mode 000."""
    if how == "a regular file":
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
        path.write_text("not a directory\n")
        path.chmod(0o600)
    else:
        path.chmod(0o000)


BREAKS = [
    "a regular file",
    pytest.param(
        "mode 000",
        marks=pytest.mark.skipif(not MODE_000_HOLDS, reason="mode 000 is not enforced (root)"),
    ),
]


@pytest.mark.parametrize("how", BREAKS)
@pytest.mark.parametrize("command", ["read", "read --peek", "wait"])
def test_a_broken_cursors_directory_is_one_error_line(team: Team, command: str, how: str) -> None:
    """cursors/ unusable (a file in its place, or unreadable): read, read --peek and wait
    exit 2 with one line, no traceback."""
    send()
    target = root(team.home) / "cursors"
    break_directory(target, how)
    try:
        one_error_line(cli(team.home, *COMMANDS[command]))
    finally:
        if how == "mode 000":
            target.chmod(0o700)
    record(faults=1)


@pytest.mark.parametrize("how", BREAKS)
@pytest.mark.parametrize("command", ["read", "tail", "gc"])
def test_a_broken_bases_directory_is_one_error_line(team: Team, command: str, how: str) -> None:
    """bases/ unusable (a file in its place, or unreadable): read, tail and gc (which need
    an inbox's base) exit 2 with one line, no traceback."""
    send()
    MessageBus("demo", "lead").poll()
    send()
    target = root(team.home) / "bases"
    break_directory(target, how)
    try:
        one_error_line(cli(team.home, *COMMANDS[command]))
    finally:
        if how == "mode 000":
            target.chmod(0o700)
    record(faults=1)


@pytest.mark.parametrize("how", BREAKS)
def test_a_send_with_a_broken_bases_directory_delivers_or_fails_in_one_line(
    team: Team, how: str
) -> None:
    """bases/ unusable: a send either delivers (exit 0) or exits 2 with one line; never a
    traceback."""
    target = root(team.home) / "bases"
    break_directory(target, how)
    try:
        done = cli(team.home, *COMMANDS["send"])
    finally:
        if how == "mode 000":
            target.chmod(0o700)
    if done.returncode == 0:
        no_traceback(done, 0)
    else:
        one_error_line(done)
    record(faults=1)


@pytest.mark.parametrize("how", BREAKS)
def test_a_torn_tail_whose_dead_letter_cannot_be_written_never_stops_sends(
    team: Team, how: str
) -> None:
    """A torn tail when deadletters/ is unusable: later sends exit 0, and read delivers
    every good message."""
    first = send(content="before the tear")
    with open(inbox(team.home), "ab") as f:
        f.write(b'{"id":"torn')
    target = root(team.home) / "deadletters"
    break_directory(target, how)
    try:
        later = []
        for n in range(2):
            done = cli(team.home, "send", "lead", f"after the tear {n}", *AS_WORKER)
            no_traceback(done, 0)
            later.append(done.stdout.decode().strip())
        done = cli(team.home, "read", "--json", *LEAD)
    finally:
        if how == "mode 000":
            target.chmod(0o700)
    no_traceback(done, 0)
    assert ids_in(done.stdout) == [first, *later]
    record(messages=3, faults=1)


@pytest.mark.parametrize("how", BREAKS)
def test_a_bad_line_whose_dead_letter_cannot_be_written_never_stops_good_ones(
    team: Team, how: str
) -> None:
    """A line that is not a message when deadletters/ is unusable: read delivers the good
    messages around it (exit 0), and the next read is not stopped by it either."""
    first = send(content="before")
    with open(inbox(team.home), "ab") as f:
        f.write(b"this is not a message\n")
    second = send(content="after")
    target = root(team.home) / "deadletters"
    break_directory(target, how)
    try:
        done = cli(team.home, "read", "--json", *LEAD)
        third = send(content="later")
        again = cli(team.home, "read", "--json", *LEAD)
    finally:
        if how == "mode 000":
            target.chmod(0o700)
    no_traceback(done, 0)
    assert ids_in(done.stdout) == [first, second]
    no_traceback(again, 0)
    assert ids_in(again.stdout) == [third]
    record(messages=3, faults=1)


@pytest.mark.parametrize(
    "command",
    [
        ("team", "list"),
        ("gc", "--all"),
        ("team", "create", "other", "--member", "lead"),
        ("send", "lead", "hello", *AS_WORKER),
    ],
    ids=["team list", "gc --all", "team create", "send"],
)
def test_a_home_that_is_a_regular_file_is_one_error_line(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """RALPH_HOME pointing at a regular file: every command exits 2 with one line."""
    home = tmp_path / "home-file"
    home.write_text("not a directory\n")
    one_error_line(cli(home, *command))
    assert home.read_text() == "not a directory\n"
    record(inputs=1)


def test_doctor_reports_a_home_that_is_a_regular_file(tmp_path: Path) -> None:
    """RALPH_HOME pointing at a regular file: doctor exits 3, no traceback."""
    home = tmp_path / "home-file"
    home.write_text("not a directory\n")
    no_traceback(cli(home, "doctor"), 3)
    record(inputs=1)


# -- 10: a FIFO in place of an inbox ------------------------------------------------------


@pytest.mark.parametrize(
    "command, body",
    [
        (("send", "lead", "small", *AS_WORKER), b""),
        (("send", "lead", "-", *AS_WORKER), b"x" * 300_000),
        (("read", *LEAD), b""),
        (("wait", "--timeout", "1", *LEAD), b""),
        (("tail", "lead", "--team", "demo"), b""),
    ],
    ids=["send small", "send big", "read", "wait", "tail"],
)
def test_a_fifo_in_place_of_an_inbox_is_refused_without_hanging(
    team: Team, command: tuple[str, ...], body: bytes
) -> None:
    """A FIFO in place of lead's inbox: the command exits 2 with one line, within its
    bound, and the FIFO is left as it was (nothing written into it)."""
    inbox(team.home).unlink()
    os.mkfifo(inbox(team.home), 0o600)
    one_error_line(cli(team.home, *command, input=body))
    assert stat.S_ISFIFO(inbox(team.home).lstat().st_mode)
    # Nothing was left in the pipe: a non-blocking read finds it empty.
    fd = os.open(inbox(team.home), os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(fd, 1) == b""
    finally:
        os.close(fd)
    record(faults=1)


def test_doctor_reports_a_fifo_in_place_of_an_inbox(team: Team) -> None:
    """A FIFO in place of lead's inbox: doctor exits 3 within its bound, no traceback."""
    inbox(team.home).unlink()
    os.mkfifo(inbox(team.home), 0o600)
    no_traceback(cli(team.home, "doctor"), 3)
    record(faults=1)


# -- 11: symlinked directories and names read back from team.json ------------------------


@pytest.mark.parametrize("command", ["send", "read", "gc"])
@pytest.mark.parametrize("planted", ["team directory", "mailbox"])
def test_a_symlinked_team_or_mailbox_directory_is_refused(
    team: Team, tmp_path: Path, planted: str, command: str
) -> None:
    """A team directory or mailbox/ that is a symlink: send, read and gc exit 2 with one
    line, and nothing is written through the link."""
    send()
    MessageBus("demo", "lead").poll()  # consumed: gc would have work
    send()
    source = root(team.home) if planted == "team directory" else root(team.home) / "mailbox"
    elsewhere = tmp_path / "elsewhere"
    os.rename(source, elsewhere)
    os.symlink(elsewhere, source)
    before = tree(elsewhere)
    line = one_error_line(cli(team.home, *COMMANDS[command]))
    assert "symlink" in line
    assert tree(elsewhere) == before
    record(inputs=1)


def test_broadcast_refuses_a_roster_member_named_outside_the_team(team: Team) -> None:
    """A member '../x' written into team.json by hand: broadcast exits 2 naming it, and
    writes nothing where mailbox/../x.jsonl leads."""
    roster = root(team.home) / "team.json"
    roster.write_text(roster.read_text().replace('"worker-2"', '"../x"'))
    target = root(team.home) / "x.jsonl"
    target.write_bytes(b"")
    line = one_error_line(cli(team.home, "broadcast", "hi", *LEAD))
    assert "../x" in line
    assert target.read_bytes() == b""
    record(inputs=1)


# -- 12: a process that outlives its team's deletion --------------------------------------

LINGERING = """
import sys
from ralph_mail import MailError, MessageBus
bus = MessageBus("demo", "lead")
peeked = bus.peek() if sys.argv[1] == "commit" else []
print("ready", flush=True)
sys.stdin.readline()
try:
    if sys.argv[1] == "commit":
        bus.commit(peeked[0])
    else:
        bus.poll()
    print("no error", flush=True)
except MailError as exc:
    print("MailError:", exc, flush=True)
"""


@pytest.mark.parametrize("operation", ["poll", "commit"])
def test_a_process_outliving_team_delete_gets_a_clear_error_and_recreates_nothing(
    team: Team, procs: Processes, operation: str
) -> None:
    """After 'team delete', a process still holding a bus gets a MailError saying the team
    was deleted from poll or commit, nothing reappears under teams/, and 'team create'
    then 'team delete' of the same name both succeed."""
    send()
    lingering = procs.python(LINGERING, operation, env=cli_env(team.home))
    assert expect_line(lingering) == b"ready\n"
    no_traceback(cli(team.home, "team", "delete", "demo", "--yes", "--agent", "lead"), 0)
    out, err = lingering.communicate(b"go\n", timeout=TIMEOUT_S)
    assert not root(team.home).exists(), "the deleted team's directory was made again"
    assert out.startswith(b"MailError:") and b"deleted" in out, (out, err)
    members = ("--member", "lead", "--member", "worker-1", "--member", "worker-2")
    no_traceback(cli(team.home, "team", "create", "demo", *members), 0)
    no_traceback(cli(team.home, "team", "delete", "demo", "--yes", "--agent", "lead"), 0)
    record(messages=1, faults=1)


# -- 5: every valid name works from the command line, on files and on NATS --------------


@pytest.mark.parametrize("kind", ["file", "nats"])
def test_the_longest_names_read_wait_and_pass_from_the_command_line(
    kind: str, home: Path, tmp_path: Path
) -> None:
    """An agent named with 64 characters reads and waits for its mail, and a channel named
    with 64 characters has its turns passed: no command says 'invalid log name'."""
    from tests.helpers.backends import backend_url

    agent, other, channel = "a" * 64, "b.." + "b" * 60 + ".", "c" * 62 + ".."
    env = {"RALPH_BACKEND": backend_url(kind, tmp_path), "RALPH_TEAM": "demo"}
    members = ("--member", "lead", "--member", agent, "--member", other)
    no_traceback(cli(home, "team", "create", "demo", *members, **env), 0)
    for me in (agent, other):
        sent = cli(home, "send", me, "hi", "--agent", "lead", **env).stdout.strip()
        read = cli(home, "read", "--agent", me, **env)
        no_traceback(read, 0)
        assert sent and sent in read.stdout
        sent = cli(home, "send", me, "again", "--agent", "lead", **env).stdout.strip()
        waited = cli(home, "wait", "--agent", me, "--timeout", str(TIMEOUT_S), **env)
        no_traceback(waited, 0)
        assert sent and sent in waited.stdout
    no_traceback(cli(home, "channel", "create", channel, "--all", "--agent", "lead", **env), 0)
    post = cli(home, "channel", "post", channel, f"@{agent} @{other} go", "--agent", "lead",
               **env).stdout.strip()  # fmt: skip
    for me in (agent, other):
        no_traceback(cli(home, "channel", "pass", channel, post.decode(), "--agent", me, **env), 0)
