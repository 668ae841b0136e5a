"""The command line where its output or input goes wrong: closed or full streams, a reader
that leaves, hostile text, bad values; and start-up paths (Ctrl-C, --version)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ralph_mail import MessageBus, Team
from tests.helpers.processes import BOUND_S, cli_env, on_terminal, ralph

ME = ("--team", "demo", "--agent", "worker-1")
LEAD = ("--team", "demo", "--agent", "lead")


def run_shell(home: Path, script: str) -> subprocess.CompletedProcess[bytes]:
    """``bash -c script`` with ralph-mail on the PATH and ``home`` as RALPH_HOME."""
    env = cli_env(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=BOUND_S)


def fill(count: int, size: int = 10) -> list[str]:
    sender = MessageBus("demo", "worker-1")
    return [sender.send("lead", "text", f"{n}:" + "x" * size).id for n in range(count)]


def unread(agent: str = "lead") -> list[str]:
    return [m.id for m in MessageBus("demo", agent).peek()]


def test_read_into_a_closed_pipe_consumes_nothing(team: Team) -> None:
    """read whose reader has already gone exits 141 and leaves every message unread."""
    ids = fill(5)
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run(
        [sys.executable, "-m", "ralph_mail", "read", *LEAD],
        stdout=write_end, stderr=subprocess.PIPE, env=cli_env(team.home), timeout=BOUND_S,
    )  # fmt: skip
    os.close(write_end)
    assert done.returncode == 141 and b"Traceback" not in done.stderr
    assert unread() == ids


def test_read_piped_to_head_consumes_only_what_went_out(team: Team) -> None:
    """read | head -n 1 with lines bigger than the pipe: the line head took is consumed,
    the rest stays unread: nothing is lost, and nothing shown is delivered again."""
    ids = fill(5, size=200_000)
    done = run_shell(
        team.home,
        "ralph-mail read --json --team demo --agent lead | head -n 1 | wc -l; "
        "echo ${PIPESTATUS[0]}",
    )
    assert done.stdout.split() == [b"1", b"141"] and b"Traceback" not in done.stderr
    assert unread() == ids[1:]


def test_read_piped_to_head_that_takes_part_of_a_line_consumes_nothing(team: Team) -> None:
    """A reader that leaves in the middle of the first line: that line did not go out
    whole, so nothing is consumed."""
    ids = fill(3, size=200_000)
    run_shell(team.home, "ralph-mail read --json --team demo --agent lead | head -c 10")
    assert unread() == ids


def test_read_into_a_full_disk_is_one_error_and_consumes_nothing(team: Team) -> None:
    """read > /dev/full: one error line, exit 2, every message still unread."""
    ids = fill(3)
    done = run_shell(team.home, "ralph-mail read --team demo --agent lead > /dev/full")
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1
    assert b"ralph-mail: error:" in done.stderr and b"Traceback" not in done.stderr
    assert unread() == ids


@pytest.mark.parametrize("command", [("wait", "--timeout", "5"), ("read",), ("tail",)])
def test_a_closed_stdout_is_one_error_and_consumes_nothing(
    team: Team, command: tuple[str, ...]
) -> None:
    """wait, read and tail with standard output closed: one error line, exit 2, nothing
    consumed."""
    ids = fill(2)
    done = run_shell(team.home, f"ralph-mail {' '.join(command)} --team demo --agent lead >&-")
    assert done.returncode == 2 and b"standard output is closed" in done.stderr
    assert b"Traceback" not in done.stderr and unread() == ids


def test_wait_for_a_type_with_a_closed_stdout_keeps_the_message(team: Team) -> None:
    """wait --type with standard output closed leaves the matched message unread."""
    [first] = fill(1)
    done = run_shell(
        team.home, "ralph-mail wait --type text --timeout 5 --team demo --agent lead >&-"
    )
    assert done.returncode == 2 and unread() == [first]


def test_a_delivered_send_exits_0_even_when_stdout_is_closed(team: Team) -> None:
    """send, broadcast and status with stdout closed deliver once and exit 0: a retry loop
    must not send twice."""
    script = (
        "ralph-mail send lead hi --team demo --agent worker-1 >&- && "
        "ralph-mail broadcast all --team demo --agent worker-1 >&- && "
        "ralph-mail status busy --team demo --agent worker-1 >&-"
    )
    done = run_shell(team.home, script)
    assert done.returncode == 0 and b"error" not in done.stderr  # (notes: lead is offline)
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["hi", "all", "busy"]


@pytest.mark.parametrize(
    "command",
    ["send lead", "broadcast", "plan submit", "assign worker-2 T-1", "status -"],
)
def test_a_closed_stdin_is_one_error_and_sends_nothing(team: Team, command: str) -> None:
    """A body to read from a closed standard input: one error line, exit 2, nothing sent."""
    done = run_shell(team.home, f"ralph-mail {command} --team demo --agent worker-1 <&-")
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1
    assert b"Traceback" not in done.stderr
    assert all(not MessageBus("demo", a).peek() for a in ("lead", "worker-2"))


@pytest.mark.parametrize("command", [("team", "list"), ("gc", "--all"), ("doctor",)])
def test_a_home_that_is_a_file_is_one_error(tmp_path: Path, command: tuple[str, ...]) -> None:
    """RALPH_HOME pointing at a regular file: one error line naming it, no traceback."""
    home = tmp_path / "not-a-dir"
    home.write_text("x")
    done = ralph(home, *command)
    assert done.returncode in (2, 3) and b"Traceback" not in done.stderr
    assert str(home).encode() in done.stderr + done.stdout


ESCAPES = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\r\u202e"


@pytest.mark.parametrize("command", [("read",), ("tail", "lead")])
def test_escape_sequences_never_reach_the_terminal_raw(
    team: Team, command: tuple[str, ...]
) -> None:
    """Control characters in a message are shown escaped; a newline in metadata does not
    forge a second message line."""
    MessageBus("demo", "worker-1").send("lead", "text", f"hi{ESCAPES}there", {"k": "a\nforged"})
    out = ralph(team.home, *command, *LEAD).stdout
    assert b"\x1b" not in out and b"\x07" not in out and b"\r" not in out
    assert "\u202e".encode() not in out and b"\\x1b[2J" in out
    assert out.count(b"\n") == 1


def test_json_output_keeps_the_exact_envelope(team: Team) -> None:
    """--json prints the message exactly, escapes and all (JSON-escaped by the encoder)."""
    MessageBus("demo", "worker-1").send("lead", "text", f"hi{ESCAPES}")
    out = ralph(team.home, "tail", "lead", "--json", *LEAD).stdout
    assert out == (team.store.root / "mailbox" / "lead.jsonl").read_bytes()


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (("wait", "--timeout", "nan"), {}, b"not a finite number"),
        (("wait", "--timeout", "inf"), {}, b"not a finite number"),
        (("send", "lead", "x"), {"RALPH_MAX_MESSAGE_BYTES": "abc"}, b"RALPH_MAX_MESSAGE_BYTES"),
        (("send", "lead", "x", "--meta", "k=1", "--meta", "k=2"), {}, b"given twice"),
        (("send", "lead", "x", "--type", "status_update", "--meta", "state=bogus"), {},
         b"invalid state 'bogus'"),
        (("send", "lead", "x", "--type", "plan_approval"), {}, b"approved=true"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_in_one_line(
    team: Team, args: tuple[str, ...], env: dict[str, str], fragment: bytes
) -> None:
    """nan timeouts, a bad size in the environment, a key twice, bad protocol metadata:
    one error line naming the value, exit 2, nothing sent."""
    done = ralph(team.home, *args, *ME, **env)
    assert done.returncode == 2 and fragment in done.stderr, done.stderr
    assert done.stderr.count(b"\n") == 1 and unread() == []


def test_version_prints_the_version(home: Path) -> None:
    """--version prints 'ralph-mail X.Y.Z' and exits 0."""
    from importlib.metadata import version

    done = ralph(home, "--version")
    assert done.returncode == 0 and done.stdout == f"ralph-mail {version('ralph_mail')}\n".encode()


def test_ctrl_c_at_any_moment_of_start_up_exits_130_quietly(team: Team) -> None:
    """SIGINT landing anywhere in a wait's own start-up (its imports included, orjson's
    among them): exit 130, never a traceback or a crash. A signal that lands while the
    interpreter itself starts (before any line of ralph_mail runs) is Python's, not ours:
    those tries are told apart by the interpreter's own message and not counted."""
    ours = 0
    for attempt in range(40):
        proc = subprocess.Popen(
            [sys.executable, "-m", "ralph_mail", "wait", "--timeout", "5", *LEAD],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(team.home),
        )  # fmt: skip
        # Spread the signal over the start-up: 0 to ~120 ms after the start.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=attempt * 0.003)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=BOUND_S)
        # The interpreter's own start-up (site, runpy, the import machinery before the
        # first line of ralph_mail runs) is not ralph_mail's to guard.
        interpreters_own = err and b"ralph_mail/" not in err
        if interpreters_own or proc.returncode == -signal.SIGINT:
            continue  # the interpreter had not started to run ralph_mail yet
        ours += 1
        assert proc.returncode == 130 and b"Traceback" not in err, (proc.returncode, err)
    assert ours >= 10


def test_declining_team_delete_exits_3(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answering no at the delete prompt keeps the team and exits 3 (the answer was no)."""
    from ralph_mail.cli import command, main

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(command, "confirm", lambda question: False)
    monkeypatch.setattr("ralph_mail.cli.mail.confirm", lambda question: False)
    assert main(["team", "delete", "demo", "--agent", "lead"]) == 3
    assert MessageBus("demo", "lead").peek() == []  # the team is still there


#: Hostile stored text: a clear screen, an OSC window title and clipboard write, a C1
#: CSI, a bare carriage return, a bidi override, and rich markup that would draw a link.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\x9b31m\rX\u202e[link=http://x]y[/link]"


def hostile_team(team: Team) -> None:
    """Plant HOSTILE in what commands print: a description, a presence record, a task, an
    approval's reason and a team setting."""
    import orjson

    from ralph_mail.govern import approvals
    from ralph_mail.govern.policy import Policy, Rule
    from ralph_mail.govern.presence import record
    from ralph_mail.team import update_team

    update_team("demo", team.home, member="worker-1", description=f"parses{HOSTILE}")
    team.store.save_presence("worker-2", record("sleeping", f"2999{HOSTILE}", "2026"))
    with MessageBus("demo", "worker-1") as worker:
        worker.set_presence("working")  # online: a task can be given to it
    with MessageBus("demo", "lead") as lead:
        lead.delegate("worker-1", f"do{HOSTILE}")
    policy = Policy((Rule("worker-2", "*", "allow", True),), {})
    team.store.save_state("policy", policy.to_json())
    with MessageBus("demo", "worker-2") as asker:
        asker.send("worker-1", "text", "hi")  # held for the lead
    (line,) = team.store.log_read(approvals.LOG).splitlines()
    planted = orjson.loads(line)
    planted["envelope"]["id"] = "0123456789ab"
    team.store.log_append(approvals.LOG, approvals.held(
        planted["envelope"], "lead", f"why{HOSTILE}", planted["ts"]))  # fmt: skip
    roster = team.store.root / "team.json"
    data = orjson.loads(roster.read_bytes())
    data.setdefault("config", {})["channel_delay"] = f"5{HOSTILE}"
    roster.write_bytes(orjson.dumps(data))


def assert_escaped(out: bytes) -> None:
    """No control character of HOSTILE reaches the output raw; the escapes show."""
    for raw in (b"\x1b[2J", b"\x1b]", b"\x07", b"\r", "\x9b".encode(), "\u202e".encode()):
        assert raw not in out, (raw, out)
    assert b"\\x1b[2J" in out and b"[link=http://x]" in out


@pytest.mark.parametrize(
    "command",
    [("agents",), ("team", "show"), ("presence",), ("tasks",), ("approvals",),
     ("team", "config", "demo")],
)  # fmt: skip
def test_stored_text_is_escaped_in_every_listing(team: Team, command: tuple[str, ...]) -> None:
    """Descriptions, presence, tasks, approvals' reasons and settings other processes wrote
    are printed with their control characters escaped, each record on one line."""
    hostile_team(team)
    done = ralph(team.home, *command, RALPH_TEAM="demo", RALPH_AGENT="lead")
    assert done.returncode == 0, done.stderr
    assert_escaped(done.stdout)


@pytest.mark.parametrize("command", [("agents",), ("team", "show"), ("approvals",)])
def test_stored_text_is_escaped_on_a_terminal_too(team: Team, command: tuple[str, ...]) -> None:
    """On a terminal (rich tables) stored text is escaped and never read as markup: no
    OSC sequence (title, clipboard, hyperlink) and no clear screen is written."""
    hostile_team(team)
    out = on_terminal(team.home, *command)
    assert b"\x1b]" not in out and b"\x1b[2J" not in out and "\x9b".encode() not in out
    assert b"\\x1b[2J" in out.replace(b"\r\n", b"\n"), out


def test_doctor_escapes_the_paths_it_names(tmp_path: Path) -> None:
    """doctor's findings quote paths: a home whose name holds escapes is shown escaped."""
    home = tmp_path / f"home{HOSTILE.replace('/', '')}"
    assert ralph(home, "team", "create", "demo", "--member", "lead").returncode == 0
    done = ralph(home, "doctor")
    assert done.returncode in (0, 3), done.stderr
    for raw in (b"\x1b[2J", b"\x1b]", b"\x07", "\x9b".encode(), "\u202e".encode()):
        assert raw not in done.stdout
    assert b"\\x1b[2J" in done.stdout
