"""The command line's last mile: whole summaries and defaults in its help, "did you mean"
for a slip, header rows on a terminal only, and read-only views that need no --agent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ralph_mail import Team
from tests.helpers.processes import on_terminal, ralph

ME = ("--team", "demo", "--agent", "worker-1")


def summaries(text: str) -> dict[str, str]:
    """The commands of a group's help and their summaries, continuation lines joined."""
    found: dict[str, str] = {}
    name = ""
    for line in text.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines():
        if line.startswith("  ") and not line.startswith(" " * 14):
            name, _, first = line.strip().partition("  ")
            found[name] = first.strip()
        else:
            found[name] += " " + line.strip()
    return found


@pytest.mark.parametrize("group", [(), ("team",), ("channel",), ("policy",), ("task",)])
def test_each_summary_is_the_docstrings_first_sentence_whole(
    home: Path, group: tuple[str, ...]
) -> None:
    """A group's --help lists each command with the first sentence of its help, whole:
    it ends a sentence, and it is that sentence, not its first line."""
    from ralph_mail.cli.app import full_app
    from ralph_mail.cli.command import _help_text, _strip_b

    out = ralph(home, *group, "--help")
    assert out.returncode == 0
    listed = summaries(out.stdout.decode())
    node = full_app()
    for name in group:
        node = node.groups[name]
    helps = {name: _help_text(fn) for name, fn in node.commands.items()}
    helps |= {name: _strip_b(sub.help) for name, sub in node.groups.items()}
    assert listed.keys() == helps.keys()
    for name, first in listed.items():
        assert re.search(r"[.!?]$", first), (name, first)
        assert " ".join(helps[name].split()).startswith(first), (name, first)
        assert "." not in first[:-1].replace("...", "").replace(".jsonl", ""), (name, first)


@pytest.mark.parametrize(
    "command, shown",
    [
        (("tail",), "How many messages. [default: 10]"),
        (("ask",), "[default: 120]"),
        (("send",), "[default: text]"),
        (("run",), "[default: 4]"),
    ],
)
def test_an_options_default_is_in_its_help(
    home: Path, command: tuple[str, ...], shown: str
) -> None:
    """An option with a real default says it; flags and options without one do not."""
    text = " ".join(ralph(home, *command, "--help").stdout.decode().split())
    assert shown in text
    assert "[default: False]" not in text and "[default: None]" not in text


def test_every_default_in_every_help_is_real() -> None:
    """No help says a default of None, False or an empty value."""
    from ralph_mail.cli.app import full_app
    from ralph_mail.cli.command import build_parser, paths

    app = full_app()
    for path in paths(app):
        node = app
        for name in path[:-1]:
            node = node.groups[name]
        text = build_parser(node.commands[path[-1]], " ".join(path)).format_help()
        for bad in ("[default: None]", "[default: False]", "[default: ]", "[default: []]"):
            assert bad not in " ".join(text.split()), path


@pytest.mark.parametrize(
    "args, line",
    [
        (("sned", "lead", "x"), "unknown command 'sned': did you mean 'send'?"),
        (("team", "creat", "x"), "unknown command 'creat': did you mean 'create'?"),
        (("tail", "--agnet", "worker-1"), "unknown option '--agnet': did you mean --agent?"),
        (("tail", "--agnet=worker-1"), "unknown option '--agnet': did you mean --agent?"),
    ],
)
def test_a_slip_is_one_line_naming_what_was_meant(
    team: Team, args: tuple[str, ...], line: str
) -> None:
    """A mistyped command or option: exit 2, one line saying what it likely meant."""
    out = ralph(team.home, *args)
    assert out.returncode == 2 and out.stdout == b""
    assert out.stderr.count(b"\n") == 1 and line.encode() in out.stderr, out.stderr


def files(home: Path) -> list[tuple[Path, int, int]]:
    return sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in home.rglob("*"))


@pytest.mark.parametrize(
    "args, first",
    [
        (("agents",), "lead\t"),
        (("presence",), "lead\t"),
        (("tail",), ""),
        (("tasks",), ""),
        (("thread", "3f2a9c1d4b5e"), ""),
    ],
)
def test_read_only_views_need_no_agent(team: Team, args: tuple[str, ...], first: str) -> None:
    """thread, presence, tail, tasks and agents work with a team and no --agent (agents
    then lists the whole team, tail every inbox); they write nothing."""
    ralph(team.home, "send", "lead", "hello", *ME)
    ralph(team.home, "thread", "3f2a9c1d4b5e", *ME)  # its (empty) index exists already
    before = files(team.home)
    out = ralph(team.home, *args, "--team", "demo")
    assert out.returncode == 0 and out.stderr == b"", out.stderr
    assert out.stdout.decode().startswith(first)
    if args == ("agents",):
        assert [line.split("\t")[0] for line in out.stdout.decode().splitlines()] == [
            "lead", "worker-1", "worker-2"
        ]  # fmt: skip
    if args == ("tail",):
        assert b"hello" in out.stdout
    assert files(team.home) == before


def test_agents_with_an_identity_still_leaves_me_out(team: Team) -> None:
    """With --agent, agents lists my teammates, not me."""
    out = ralph(team.home, "agents", *ME)
    assert [line.split("\t")[0] for line in out.stdout.decode().splitlines()] == [
        "lead", "worker-2"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "args, header",
    [
        (("agents",), b"last seen"),
        (("presence",), b"last seen"),
        (("team", "show", "demo"), b"description"),
        (("policy", "show"), b"permission"),
    ],
)
def test_listings_have_a_header_row_on_a_terminal_only(
    team: Team, args: tuple[str, ...], header: bytes
) -> None:
    """A table has its header row on a terminal; piped it is tab-separated rows alone,
    for scripts, and --json has records alone."""
    if args[0] == "policy":
        ralph(team.home, "policy", "allow", "worker-1", "worker-2", "--team", "demo",
              "--agent", "lead")  # fmt: skip
    assert header in on_terminal(team.home, *args)
    piped = ralph(team.home, *args, RALPH_TEAM="demo", RALPH_AGENT="lead")
    assert piped.returncode == 0 and header not in piped.stdout and b"\t" in piped.stdout


def test_policy_remove_drops_one_rule_as_the_lead(team: Team) -> None:
    """policy remove FROM TO drops that pair's rule, keeps the others; a missing rule is
    one line, exit 2; anyone but the lead is refused, exit 4, nothing changed."""
    lead = ("--team", "demo", "--agent", "lead")
    ralph(team.home, "policy", "deny", "*", "worker-2", *lead)
    ralph(team.home, "policy", "allow", "worker-1", "*", "--approval", *lead)
    assert ralph(team.home, "policy", "remove", "worker-1", "*", *ME).returncode == 4
    assert ralph(team.home, "policy", "remove", "worker-1", "*", *lead).returncode == 0
    shown = ralph(team.home, "policy", "show", "--json", "--team", "demo").stdout
    assert b'"worker-2"' in shown and b'"worker-1"' not in shown
    again = ralph(team.home, "policy", "remove", "worker-1", "*", *lead)
    assert again.returncode == 2 and again.stderr.count(b"\n") == 1
    assert b"no rule from worker-1 to *" in again.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("send", "worker-1", ""),
        ("broadcast", ""),
        ("ask", "worker-1", "", "--timeout", "0"),
        ("delegate", "worker-1", ""),
        ("channel", "post", "room", ""),
    ],
)
def test_an_empty_body_is_refused_in_one_line(team: Team, args: tuple[str, ...]) -> None:
    """An empty message (an argument or a pipe with nothing in it): exit 2, one line,
    nothing written."""
    me = ("--team", "demo", "--agent", "lead")
    assert (
        ralph(team.home, "channel", "create", "room", "--member", "worker-1", *me).returncode == 0
    )
    sizes = [team.store.size(name) for name in team.names]
    done = ralph(team.home, *args, *me)
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
    assert b"empty message" in done.stderr
    piped = ralph(team.home, *args[:-1] if args[-1] == "" else args, *me, input=b"\n")
    if args[-1] == "":
        assert piped.returncode == 2 and b"empty message" in piped.stderr
    assert [team.store.size(name) for name in team.names] == sizes


def test_a_task_may_finish_with_an_empty_result(team: Team) -> None:
    """`task done ID ''` is a result like any other (a command that printed nothing)."""
    from ralph_mail import MessageBus

    MessageBus("demo", "worker-1", team.home).set_presence("idle")  # online: may be given work
    me = ("--team", "demo")
    made = ralph(team.home, "delegate", "worker-1", "tidy up", *me, "--agent", "lead")
    task_id = made.stdout.decode().split()[0]
    done = ralph(team.home, "task", "done", task_id, "", *me, "--agent", "worker-1")
    assert done.returncode == 0, done.stderr
