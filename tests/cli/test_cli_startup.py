"""What a one-message command imports: agents call ``send``, ``read``, ``wait``, ``tail``,
``status`` and ``history`` in loops, so each start counts (the bench's cli section
times them; these tests pin what they leave out)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from ralph_mail import MessageBus, Team
from ralph_mail.cli.command import terminal_columns
from tests.helpers.processes import cli_env

ME = ("--team", "demo", "--agent", "worker-1")
#: Costly imports a one-message command does without: orjson (its import is about as
#: long as the rest of the command; ralph_mail.codec writes its bytes), shutil (with bz2
#: and lzma; argparse imports it for the terminal's width), datetime (presence),
#: secrets (with hmac, hashlib, random and base64: a doorbell's name needs a few random
#: bytes, which os.urandom gives), and cryptography (only a team with signing keys needs
#: it; hashlib and base64 with it).
NOT_IMPORTED = (
    "orjson", "shutil", "bz2", "lzma", "datetime", "secrets", "random", "cryptography",
    "hashlib", "base64",
)  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["send", "lead", "x"],
        ["read"],
        ["wait", "--timeout", "0"],
        ["tail", "lead", "-n", "5"],
        ["history", "lead", "-n", "20"],
        ["status", "parsing", "--state", "working"],
    ],
    ids=lambda args: args[0],
)
def test_a_one_message_command_leaves_the_costly_imports_out(team: Team, args: list[str]) -> None:
    """Each of the commands agents loop over runs, and imports none of NOT_IMPORTED."""
    MessageBus("demo", "lead").send("worker-1", "text", "one new message")
    code = (
        "import sys; from ralph_mail.cli import main; code = main(sys.argv[1:]); "
        f"print(code, [m for m in {NOT_IMPORTED!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args, *ME],
        capture_output=True,
        env=cli_env(team.home),
        timeout=60,
    )
    assert out.stdout.splitlines()[-1] == b"0 []", out.stderr


@pytest.mark.parametrize("columns", [None, "50", "0", "-3", "wide", "200"])
def test_the_help_width_is_the_one_shutil_finds(
    monkeypatch: pytest.MonkeyPatch, columns: str | None
) -> None:
    """The terminal width argparse is given is `shutil.get_terminal_size`'s, whatever
    COLUMNS says (unset, a number, nonsense)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.delenv("LINES", raising=False)
    assert terminal_columns() == shutil.get_terminal_size().columns


def test_a_commands_help_wraps_at_the_terminal_width(team: Team) -> None:
    """``wait --help`` with COLUMNS=50: its usage and options wrap within 50 columns."""
    out = subprocess.run(
        [sys.executable, "-m", "ralph_mail", "wait", "--help"],
        capture_output=True,
        env=cli_env(team.home, COLUMNS="50"),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    usage = out.stdout.decode().split("\n\n")[0].splitlines()
    assert len(usage) > 1 and all(len(line) <= 50 for line in usage), usage
