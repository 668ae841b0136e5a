"""Hostile input (scenario 9) and privacy (scenario 10).

Every bad input is refused with one clear line (exit 2 on the command line) before any
file is touched, anywhere: the whole temporary tree is compared before and after.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ralph_mail import MailError, MessageBus, StoreError, Team, create_team
from ralph_mail.maintenance import collect
from tests.helpers.faultkit import record, tree
from tests.helpers.processes import BOUND_S, cli_env, ralph

BAD_NAMES = [
    "",
    ".",
    "..",
    "../lead",
    "../../etc/passwd",
    "a/b",
    "/abs",
    "a\\b",
    "a\0b",
    "lead\n",
    "a\tb",
    "a b",
    " lead",
    "lead ",
    "-lead",
    "_lead",
    ".hidden",
    "x" * 65,
    "x" * 4096,
    "lead.lock",
    "team.json",
    "inbox.jsonl",
    "*",
    "lé",
    "\uff4c\uff45\uff41\uff44",  # fullwidth letters
    "lead\u202e",
    "lead\x1b[31m",
    "\udc80",
]

BAD_SENDS: list[tuple[str, dict[str, Any]]] = [
    ("type not a name", {"type": "Bo gus"}),
    ("type empty", {"type": ""}),
    ("type upper", {"type": "TEXT"}),
    ("type not str", {"type": 3}),
    ("content int", {"content": 42}),
    ("content None", {"content": None}),
    ("content bytes", {"content": b"x"}),
    ("content surrogate", {"content": "\udc80"}),
    ("content oversized", {"content": "x" * (1 << 20)}),
    ("metadata value int", {"metadata": {"n": 1}}),
    ("metadata key int", {"metadata": {1: "x"}}),
    ("metadata nested", {"metadata": {"a": {"b": "c"}}}),
    ("metadata list", {"metadata": ["a"]}),
    ("metadata surrogate", {"metadata": {"k": "\udc80"}}),
    ("id short", {"id": "abc"}),
    ("id upper", {"id": "0123456789AB"}),
    ("id long", {"id": "0123456789abc"}),
    ("id traversal", {"id": "../../etc/pw"}),
    ("reply_to bad", {"reply_to": "nope"}),
    ("reply_to int", {"reply_to": 5}),
]


def snapshot(tmp_path: Path) -> dict[str, tuple[int, int, int]]:
    return tree(tmp_path)


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_bad_names_are_refused_by_the_api_and_nothing_is_written(
    team: Team, tmp_path: Path, name: str
) -> None:
    """A bad recipient, agent or team name raises MailError and touches no file."""
    before = snapshot(tmp_path)
    calls: list[Callable[[], object]] = [
        lambda: MessageBus("demo", "worker-1").send(name, "text", "x"),
        lambda: MessageBus("demo", name),
        lambda: MessageBus(name, "lead"),
        lambda: create_team(name, ["a"]),
        lambda: create_team("fresh", [name]),
    ]
    for call in calls:
        with pytest.raises(MailError) as caught:
            call()
        assert "\n" not in str(caught.value).replace(repr(name), "")
    assert snapshot(tmp_path) == before
    record(inputs=len(calls))


@pytest.mark.parametrize("case", BAD_SENDS, ids=[case[0] for case in BAD_SENDS])
def test_bad_sends_are_refused_by_the_api_and_nothing_is_written(
    team: Team, tmp_path: Path, case: tuple[str, dict[str, Any]]
) -> None:
    """A bad type, content, metadata, id or reply_to raises MailError; no file changes."""
    arguments: dict[str, Any] = {"to": "lead", "type": "text", "content": "x"} | case[1]
    bus = MessageBus("demo", "worker-1")
    before = snapshot(tmp_path)
    with pytest.raises(MailError):
        bus.send(**arguments)
    if set(case[1]) <= {"content", "metadata", "id"}:  # the same checks guard a broadcast
        with pytest.raises(MailError):
            bus.broadcast(arguments["content"], arguments.get("metadata"), id=arguments.get("id"))
    assert snapshot(tmp_path) == before
    record(inputs=2 if set(case[1]) <= {"content", "metadata", "id"} else 1)


CLI_CASES: list[tuple[str, list[str], bytes, dict[str, str]]] = [
    ("recipient traversal", ["send", "../lead", "x"], b"", {}),
    ("recipient slash", ["send", "a/b", "x"], b"", {}),
    ("recipient unknown", ["send", "nobody", "x"], b"", {}),
    ("recipient star", ["send", "*", "x"], b"", {}),
    ("recipient control", ["send", "lead\x1b", "x"], b"", {}),
    ("recipient long", ["send", "x" * 300, "x"], b"", {}),
    ("recipient reserved", ["send", "lead.lock", "x"], b"", {}),
    ("type unknown", ["send", "lead", "x", "--type", "Bogus!"], b"", {}),
    ("meta no equals", ["send", "lead", "x", "--meta", "novalue"], b"", {}),
    ("meta empty key", ["send", "lead", "x", "--meta", "=v"], b"", {}),
    ("id bad", ["send", "lead", "x", "--id", "XYZ"], b"", {}),
    ("reply-to bad", ["send", "lead", "x", "--reply-to", "../x"], b"", {}),
    ("stdin not utf-8", ["send", "lead", "-"], b"\xff\xfe bad", {}),
    ("stdin huge", ["send", "lead", "-"], b"y" * (3 << 20), {}),
    ("body over limit", ["send", "lead", "x" * 300], b"", {"RALPH_MAX_MESSAGE_BYTES": "200"}),
    ("agent traversal", ["send", "lead", "x", "--agent", "../w"], b"", {}),
    ("agent unknown", ["send", "lead", "x", "--agent", "ghost"], b"", {}),
    ("team traversal", ["send", "lead", "x", "--team", "../demo"], b"", {}),
    ("team unknown", ["send", "lead", "x", "--team", "nope"], b"", {}),
    ("broadcast stdin not utf-8", ["broadcast", "-"], b"\xc3\x28", {}),
    ("read as stranger", ["read", "--agent", "stranger"], b"", {}),
    ("wait negative", ["wait", "--timeout", "-1"], b"", {}),
    ("wait bad type", ["wait", "--type", "No-pe", "--timeout", "0"], b"", {}),
    ("tail negative", ["tail", "lead", "-n", "-3"], b"", {}),
    ("tail unknown inbox", ["tail", "../../x"], b"", {}),
    ("create bad team", ["team", "create", "a/b", "--member", "x"], b"", {}),
    ("create bad member", ["team", "create", "t2", "--member", "../x"], b"", {}),
    (
        "create duplicate member",
        ["team", "create", "t3", "--member", "a", "--member", "a"],
        b"",
        {},
    ),
    ("create existing", ["team", "create", "demo", "--member", "a"], b"", {}),
    ("delete without yes", ["team", "delete", "demo"], b"", {}),
    ("gc unknown team", ["gc", "--team", "nope"], b"", {}),
    ("gc traversal", ["gc", "--team", ".."], b"", {}),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[case[0] for case in CLI_CASES])
def test_bad_input_on_the_command_line_exits_2_with_one_line_and_writes_nothing(
    team: Team, tmp_path: Path, case: tuple[str, list[str], bytes, dict[str, str]]
) -> None:
    """Each bad input: exit 2, exactly one line on stderr, no traceback, no file touched."""
    _, args, stdin, env = case
    before = snapshot(tmp_path)
    done = ralph(team.home, *args, input=stdin, RALPH_TEAM="demo", RALPH_AGENT="worker-1", **env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ralph-mail: error:"), lines
    assert b"Traceback" not in done.stderr
    assert snapshot(tmp_path) == before
    record(inputs=1)


def test_the_corpus_has_at_least_50_bad_inputs() -> None:
    """Scenario 9 asks for 50 or more distinct bad inputs; API and CLI together have more."""
    assert len(BAD_NAMES) * 5 + len(BAD_SENDS) + len(CLI_CASES) >= 50
    assert len(CLI_CASES) >= 30 and len(BAD_NAMES) + len(BAD_SENDS) >= 40


def test_control_characters_in_a_body_round_trip_exactly(team: Team) -> None:
    """Content is free text: NUL, escapes and newlines are kept, one line on disk."""
    text = "a\0b\x1b[31m\r\nc\u2028d"
    MessageBus("demo", "worker-1").send("lead", "text", text)
    assert (team.store.root / "mailbox" / "lead.jsonl").read_bytes().count(b"\n") == 1
    assert MessageBus("demo", "lead").poll()[0].content == text


# -- 10. privacy -------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_every_file_is_0600_and_every_directory_0700_whatever_the_umask(
    home: Path, umask: int
) -> None:
    """Team, inboxes, cursors, dead letters, bases, gc copies and gc.lock: all private."""
    old = os.umask(umask)
    try:
        create_team("priv", ["lead", "w"], home=home)
        bus, lead = MessageBus("priv", "w"), MessageBus("priv", "lead")
        bus.send("lead", "text", "x")
        lead.poll()
        with open(home / "teams" / "priv" / "mailbox" / "lead.jsonl", "ab") as f:
            f.write(b"garbage\n")
        lead.poll()
        bus.send("lead", "text", "y")
        collect("priv")
        lead.poll()
    finally:
        os.umask(old)
    entries = [home, *home.rglob("*")]
    assert len(entries) > 12
    for path in entries:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


@pytest.mark.parametrize("planted", ["cursor", "deadletter", "base", "gc.lock", "inbox"])
def test_a_planted_symlink_is_refused_never_followed(
    team: Team, tmp_path: Path, planted: str
) -> None:
    """A cursor, dead-letter, base, lock or inbox file planted as a symlink is refused with
    StoreError, and the file it points to is left as it was."""
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    paths = {
        "cursor": team.store.root / "cursors" / "lead.cursor",
        "deadletter": team.store.root / "deadletters" / "lead.jsonl",
        "base": team.store.root / "bases" / "lead.base",
        "gc.lock": team.store.root / "gc.lock",
        "inbox": team.store.root / "mailbox" / "lead.jsonl",
    }
    sender = MessageBus("demo", "worker-1")
    sender.send("lead", "text", "x")
    path = paths[planted]
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    if planted == "deadletter":
        # A dead letter that cannot be written must not stop the good lines: the bad line
        # is skipped with a warning (it stays in the inbox), the good ones are delivered.
        with open(team.store.root / "mailbox" / "lead.jsonl", "ab") as f:
            f.write(b"garbage\n")
        sender.send("lead", "text", "after")
        with pytest.warns(RuntimeWarning, match="symlink"):
            assert [m.content for m in MessageBus("demo", "lead").poll()] == ["x", "after"]
    else:
        with pytest.raises(StoreError, match="symlink"):
            lead = MessageBus("demo", "lead")
            if planted in ("cursor", "base", "inbox"):
                lead.poll()
            collect("demo")
    assert target.read_bytes() == b"precious"
    record(inputs=1)


BIG = "99999999999999999999"
#: Absurd numbers, durations and times, each with what the one error line must name.
ABSURD: list[tuple[list[str], bytes]] = [
    (["presence", "sleeping", "--until", "+99999999999d"], b"'+99999999999d'"),
    (["presence", "sleeping", "--until", "+" + "9" * 5000 + "s"], b"9999-12-31"),
    (["presence", "sleeping", "--until", "9999-99-99"], b"'9999-99-99'"),
    (["presence", "sleeping", "--until", "99999-01-01"], b"'99999-01-01'"),
    (["presence", "sleeping", "--until", "9999-12-31T23:59:59-14:00"], b"9999-12-31"),
    (["presence", "sleeping", "--until", "0500-01-01"], b"'0500-01-01'"),
    (["presence", "sleeping", "--until", "+-5m"], b"'+-5m'"),
    (["presence", "sleeping", "--until", "+\u0663m"], b"+N"),
    (["presence", "sleeping", "--until=--"], b"--until"),
    (["search", "x", "-n", BIG], b"-n/--lines"),
    (["search", "x", "-n", "9" * 5000], b"-n/--lines"),
    (["search", "x", "--since", "99999999999999d"], b"--since"),
    (["search", "x", "--since", "99999999999d"], b"--since"),
    (["search", "x", "--since", "9999-12-31T23:59:59-14:00"], b"--since"),
    (["gc", "--purge-before", "99999999999999d"], b"--purge-before"),
    (["tail", "lead", "-n", BIG], b"-n/--lines"),
    (["tail", "lead", "-n=--"], b"-n/--lines"),
    (["history", "lead", "-n", BIG], b"-n/--lines"),
    (["channel", "tail", "general", "-n", BIG], b"-n/--lines"),
    (["channel", "history", "general", "-n", BIG], b"-n/--lines"),
    (["wait", "--timeout", "1e300"], b"--timeout"),
    (["send", "lead", "x", "--wait", "1e300"], b"--wait"),
    (["send", "lead", "x", "--wait=--"], b"--wait"),
    (["ask", "lead", "x", "--timeout", "1e300"], b"--timeout"),
    (["acks", "--overdue", "1e300"], b"--overdue"),
    (["delegate", "lead", "x", "--wait", "1e300"], b"--wait"),
    (["plan", "submit", "x", "--wait", "1e300"], b"--wait"),
    (["shutdown", "request", "lead", "--wait", "1e300"], b"--wait"),
    (["shutdown", "request", "lead", "--retry", "1e300"], b"--retry"),
    (["lead", "--timeout", "1e300"], b"--timeout"),
    (["lead", "--ack-overdue", "1e300"], b"--ack-overdue"),
    (["lead", "--review-timeout", "1e300"], b"--review-timeout"),
    (["lead", "--shutdown-timeout", "1e300"], b"--shutdown-timeout"),
    (["status", "x", "--progress", "1e300"], b"progress"),
    (["run", "--jobs", BIG, "--", "cat"], b"--jobs"),
    (["run", "--timeout", "1e300", "--", "cat"], b"--timeout"),
    (["run", "--history", BIG, "--", "cat"], b"--history"),
    (["demo", "--delay", "1e300"], b"--delay"),
    (["policy", "rate", "*", BIG], b"rate"),
    (["policy", "rate", "*", "\u00b2"], b"rate"),
    (["policy", "depth", BIG], b"max_depth"),
    (["policy", "depth", "\u00b2"], b"max_depth"),
    (["team", "config", "demo", "presence_timeout", BIG], b"presence_timeout"),
    (["team", "config", "demo", "max_depth", "\u00b2"], b"max_depth"),
]


@pytest.mark.parametrize("case", ABSURD, ids=[" ".join(c[0])[:60] for c in ABSURD])
def test_absurd_numbers_and_times_are_one_line_naming_the_option(
    team: Team, tmp_path: Path, case: tuple[list[str], bytes]
) -> None:
    """A count, duration or time far past any sane bound (or no value at all): exit 2, one
    line naming the option or value and the fix, no traceback, nothing written."""
    args, fragment = case
    before = snapshot(tmp_path)
    done = ralph(team.home, *args, RALPH_TEAM="demo", RALPH_AGENT="worker-1")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ralph-mail: error:"), lines
    assert fragment in done.stderr and len(lines[0]) < 300, lines
    assert snapshot(tmp_path) == before


def test_an_argument_that_is_not_utf8_is_one_line_exit_2(team: Team, tmp_path: Path) -> None:
    """A raw byte that is not UTF-8 in an argument: exit 2, one line, nothing written."""
    before = snapshot(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "ralph_mail", "team", "create", "t9", "--member", b"a\x9bb"],
        capture_output=True, env=cli_env(team.home), timeout=BOUND_S,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
    assert b"not UTF-8" in done.stderr and b"Traceback" not in done.stderr
    assert snapshot(tmp_path) == before
