"""The command line through real subprocesses: output, exit codes, errors, help."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, Team
from tests.helpers.processes import ralph

ME = ("--team", "demo", "--agent", "worker-1")


def lines(out: bytes) -> list[bytes]:
    return out.splitlines()


def test_send_prints_the_id_and_read_consumes(team: Team) -> None:
    """send prints the new id; read prints and consumes; a second read prints nothing."""
    sent = ralph(team.home, "send", "lead", "hello", *ME)
    assert sent.returncode == 0 and sent.stderr == (
        b"ralph-mail: note: lead is offline (never seen): the message waits in its inbox\n"
    )
    message_id = sent.stdout.strip().decode()
    first = ralph(team.home, "read", "--team", "demo", "--agent", "lead")
    assert first.returncode == 0 and f"#{message_id}".encode() in first.stdout
    assert b"worker-1 -> lead [text] hello" in first.stdout
    assert ralph(team.home, "read", "--team", "demo", "--agent", "lead").stdout == b""


def test_json_output_is_the_on_disk_envelope(team: Team) -> None:
    """--json prints exactly the lines stored in the inbox."""
    ralph(team.home, "send", "lead", "a", "--meta", "state=idle", "--type", "status_update", *ME)
    ralph(team.home, "send", "lead", "b", *ME)
    out = ralph(team.home, "read", "--peek", "--json", "--team", "demo", "--agent", "lead")
    assert out.stdout == (team.store.root / "mailbox" / "lead.jsonl").read_bytes()
    first = orjson.loads(lines(out.stdout)[0])
    assert (first["type"], first["metadata"]) == ("status_update", {"state": "idle"})


def test_identity_comes_from_the_environment(team: Team) -> None:
    """RALPH_TEAM and RALPH_AGENT stand in for --team and --agent."""
    out = ralph(team.home, "send", "lead", "env", RALPH_TEAM="demo", RALPH_AGENT="worker-2")
    assert out.returncode == 0
    assert MessageBus("demo", "lead").poll()[0].from_agent == "worker-2"


def test_body_from_standard_input(team: Team) -> None:
    """Without CONTENT, or with '-', the body is read from stdin, one trailing newline dropped."""
    assert ralph(team.home, "send", "lead", *ME, input=b"piped\nbody\n").returncode == 0
    assert (
        ralph(team.home, "send", "lead", "-", *ME, input="\u00e9t\u00e9\n".encode()).returncode == 0
    )
    got = [m.content for m in MessageBus("demo", "lead").poll()]
    assert got == ["piped\nbody", "\u00e9t\u00e9"]


@pytest.mark.parametrize(
    "args, stdin, fragment",
    [
        (("send", "nobody", "x", *ME), b"", b"unknown agent 'nobody'"),
        (("send", "lead", "x", "--type", "Bogus!", *ME), b"", b"invalid message type 'Bogus!'"),
        (("send", "lead", "x", "--meta", "novalue", *ME), b"", b"KEY=VALUE"),
        (("send", "lead", "x", "--id", "XYZ", *ME), b"", b"12 lowercase hex"),
        (("send", "lead", *ME), b"\xff\xfe", b"not UTF-8"),
        (("send", "lead", "x", "--team", "demo"), b"", b"RALPH_AGENT"),
        (("send", "lead", "x", "--agent", "worker-1"), b"", b"RALPH_TEAM"),
        (("send", "lead", "x", "--team", "../etc", "--agent", "a"), b"", b"invalid team name"),
        (("send", "lead", "x", "--team", "nope", "--agent", "a"), b"", b"no team 'nope'"),
        (("send",), b"", b"arguments are required: TO"),
        (("send", "lead", "x", "--bogus"), b"", b"unrecognized arguments: --bogus"),
        (("read", "--agent", "stranger", "--team", "demo"), b"", b"unknown agent 'stranger'"),
        (("wait", "--timeout", "-1", *ME), b"", b"--timeout"),
        (("tail", "-n", "-3", *ME), b"", b"-n"),
        (("team", "create", "x/y", "--member", "a"), b"", b"invalid team name"),
        (("team", "create", "demo", "--member", "a"), b"", b"already exists"),
        (("team", "delete", "demo"), b"", b"pass --yes"),
        (("nonsense",), b"", b"no command 'nonsense'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    team: Team, args: tuple[str, ...], stdin: bytes, fragment: bytes
) -> None:
    """Bad input exits 2 with one line on stderr naming the problem; no file changes."""
    before = sorted((p, p.stat().st_size) for p in team.home.rglob("*"))
    out = ralph(team.home, *args, input=stdin)
    assert out.returncode == 2
    assert out.stdout == b""
    assert len(lines(out.stderr)) == 1 and fragment in out.stderr, out.stderr
    assert b"Traceback" not in out.stderr
    assert sorted((p, p.stat().st_size) for p in team.home.rglob("*")) == before


def test_oversized_standard_input_is_refused_without_reading_it_all(team: Team) -> None:
    """A body over the limit is refused with exit 2 and nothing is written."""
    out = ralph(
        team.home, "send", "lead", *ME, input=b"x" * (2 << 20), RALPH_MAX_MESSAGE_BYTES="1000"
    )
    assert out.returncode == 2 and b"1000-byte" in out.stderr
    assert (team.store.root / "mailbox" / "lead.jsonl").read_bytes() == b""


def test_wait_exits_1_when_nothing_comes_and_0_with_mail(team: Team) -> None:
    """wait exits 1 after its timeout with no output, and 0 printing the mail that came."""
    out = ralph(team.home, "wait", "--timeout", "0.1", "--team", "demo", "--agent", "lead")
    assert (out.returncode, out.stdout, out.stderr) == (1, b"", b"")
    MessageBus("demo", "worker-1").send("lead", "text", "here")
    out = ralph(team.home, "wait", "--timeout", "5", "--json", "--team", "demo", "--agent", "lead")
    assert out.returncode == 0 and orjson.loads(out.stdout)["content"] == "here"


def test_wait_for_a_type_leaves_the_rest_unread(team: Team) -> None:
    """wait --type consumes only the message of that type."""
    bus = MessageBus("demo", "worker-1")
    bus.send("lead", "text", "first")
    bus.send("lead", "task_assignment", "do it", metadata={"taskId": "T-1"})
    out = ralph(
        team.home,
        "wait",
        "--type",
        "task_assignment",
        "--timeout",
        "5",
        "--json",
        "--team",
        "demo",
        "--agent",
        "lead",
    )
    assert orjson.loads(out.stdout)["content"] == "do it"
    assert [m.content for m in MessageBus("demo", "lead").poll()] == ["first"]


def test_tail_shows_the_last_n_without_consuming(team: Team) -> None:
    """tail -n N prints the last N messages and leaves them unread."""
    bus = MessageBus("demo", "worker-1")
    for i in range(5):
        bus.send("lead", "text", f"m{i}")
    out = ralph(team.home, "tail", "lead", "-n", "2", "--json", "--team", "demo")
    assert [orjson.loads(x)["content"] for x in lines(out.stdout)] == ["m3", "m4"]
    assert len(MessageBus("demo", "lead").poll()) == 5


def test_tail_all_merges_inboxes_and_shows_a_broadcast_once(team: Team) -> None:
    """tail --all merges every inbox by time and shows one line per broadcast."""
    MessageBus("demo", "worker-1").send("lead", "text", "to lead")
    MessageBus("demo", "lead").broadcast("to everyone")
    MessageBus("demo", "lead").send("worker-2", "text", "to w2")
    out = ralph(team.home, "tail", "--all", "--json", "--team", "demo")
    assert [orjson.loads(x)["content"] for x in lines(out.stdout)] == [
        "to lead",
        "to everyone",
        "to w2",
    ]


def test_broadcast_prints_one_id(team: Team) -> None:
    """broadcast reaches every other member under one id, which it prints."""
    out = ralph(team.home, "broadcast", "hi all", "--team", "demo", "--agent", "lead")
    message_id = out.stdout.strip().decode()
    assert [m.id for m in MessageBus("demo", "worker-1").poll()] == [message_id]
    assert [m.id for m in MessageBus("demo", "worker-2").poll()] == [message_id]


def test_team_commands(home: Path) -> None:
    """team create, list, show and delete --yes manage the roster."""
    out = ralph(
        home, "team", "create", "t", "--member", "boss", "--member", "w:does work", "--lead", "boss"
    )
    assert out.returncode == 0 and b"created team t" in out.stdout
    assert ralph(home, "team", "list").stdout.startswith(b"t\tboss\t2\t")
    shown = ralph(home, "team", "show", "t", "--json").stdout
    assert orjson.loads(shown)["members"][1] == {
        "name": "w",
        "description": "does work",
        "role": "member",
    }
    assert ralph(home, "team", "delete", "t", "--yes", "--agent", "boss").returncode == 0
    assert ralph(home, "team", "list").stdout == b""


def command_paths() -> list[list[str]]:
    from ralph_mail.cli.app import full_app
    from ralph_mail.cli.command import paths

    return [list(path) for path in paths(full_app())]


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_command_has_help_ending_with_an_example(home: Path, path: list[str]) -> None:
    """Every command's --help exits 0 and shows an example of its use."""
    out = ralph(home, *path, "--help")
    assert out.returncode == 0
    text = out.stdout.decode()
    assert "Example" in text and "ralph-mail " + path[0] in text.split("Example", 1)[1]


def test_python_dash_m_and_the_script_are_the_same_program(team: Team) -> None:
    """python -m ralph_mail runs the same command line as ralph-mail."""
    import shutil
    import subprocess
    import sys

    script = Path(sys.executable).with_name("ralph-mail")
    if not script.exists():
        script = Path(shutil.which("ralph-mail") or "ralph-mail")
    from tests.helpers.processes import cli_env

    out = subprocess.run(
        [str(script), "send", "lead", "via script", *ME],
        capture_output=True,
        env=cli_env(team.home),
        timeout=60,
    )
    assert out.returncode == 0
    assert MessageBus("demo", "lead").poll()[0].content == "via script"


def test_send_does_not_import_typer_rich_or_watchfiles(team: Team) -> None:
    """The send path stays lean: no typer, pydantic, rich or watchfiles import."""
    import subprocess
    import sys

    from tests.helpers.processes import cli_env

    code = (
        "import sys; from ralph_mail.cli import main; code = main(sys.argv[1:]); "
        "heavy = [m for m in ('typer', 'pydantic', 'rich', 'watchfiles', 'filelock') "
        "if m in sys.modules]; "
        "print(code, heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "send", "lead", "x", *ME],
        capture_output=True,
        env=cli_env(team.home),
        timeout=60,
    )
    assert out.stdout.splitlines()[-1] == b"0 []"


def test_each_command_loads_only_its_modules_and_all_of_itself() -> None:
    """The table of command modules (ralph_mail.cli.app.MODULES) names every top-level
    command, and loading a command's modules registers it whole (``team``'s commands
    come from two modules) without the rest: ``send`` does not import the lead."""
    import subprocess
    import sys

    code = (
        "import sys, json; from ralph_mail.cli.app import app_for; "
        "from ralph_mail.cli.command import paths; "
        "app = app_for(sys.argv[1:]); "
        "print(json.dumps([sorted(' '.join(p) for p in paths(app)), "
        "'ralph_mail.cli.lead' in sys.modules]))"
    )

    def registered(*args: str) -> tuple[list[str], bool]:
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, timeout=60)
        found, lead = orjson.loads(out.stdout.splitlines()[-1])
        return found, lead

    from ralph_mail.cli.app import MODULES

    everything, _ = registered()
    tops = sorted({path.split()[0] for path in everything})
    assert tops == sorted(MODULES)
    for top in tops:
        mine = [path for path in registered(top)[0] if path.split()[0] == top]
        assert mine == [path for path in everything if path.split()[0] == top], top
    assert registered("send")[1] is False
