"""``ralph-mail keys`` and ``policy require-signed`` through real processes: key files,
exit codes, a forged sender, a tampered line in the output, dead letters, and the one
line a missing ``cryptography`` gives."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from ralph_mail import Team
from tests.helpers.processes import BOUND_S, cli_env, ralph

DEMO = ("--team", "demo")


def inbox(team: Team, agent: str) -> Path:
    return team.home / "teams" / "demo" / "mailbox" / f"{agent}.jsonl"


def test_keys_create_show_list_and_refuse_to_overwrite(team: Team) -> None:
    """create prints the kid and the 0600 file; again it exits 2 and keeps the key;
    show and list give the same kid; --force makes a new one."""
    made = ralph(team.home, "keys", "create", *DEMO, "--agent", "lead")
    assert made.returncode == 0, made.stderr
    kid, path = made.stdout.decode().split()
    assert Path(path) == team.home / "keys" / "demo" / "lead.key"
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    again = ralph(team.home, "keys", "create", *DEMO, "--agent", "lead")
    assert again.returncode == 2 and again.stdout == b""
    assert again.stderr.decode().count("\n") == 1 and "it was kept" in again.stderr.decode()
    shown = ralph(team.home, "keys", "show", *DEMO, "--agent", "lead").stdout.decode()
    assert f"kid {kid}\n" in shown and "\nin the roster\n" in shown
    listed = ralph(team.home, "keys", "list", *DEMO).stdout.decode().splitlines()
    assert listed[0].split("\t")[:2] == ["lead", kid] and listed[1].split("\t")[1] == "-"
    forced = ralph(team.home, "keys", "create", *DEMO, "--agent", "lead", "--force")
    assert forced.returncode == 0 and forced.stdout.split()[0].decode() != kid
    none = ralph(team.home, "keys", "show", *DEMO, "--agent", "worker-1")
    assert none.returncode == 2 and b"keys create" in none.stderr


def test_a_tampered_line_is_marked_and_json_adds_nothing(team: Team) -> None:
    """lead signs; its line edited on disk reads as BAD-SIGNATURE in read and tail; an
    unsigned message from a sender with a key is marked unsigned; --json prints the
    stored line byte for byte (no verdict added)."""
    ralph(team.home, "keys", "create", *DEMO, "--agent", "lead")
    ralph(team.home, "send", "worker-1", "pay 10", *DEMO, "--agent", "lead")
    stored = inbox(team, "worker-1").read_bytes()
    inbox(team, "worker-1").write_bytes(stored.replace(b"pay 10", b"pay 99"))
    tail = ralph(team.home, "tail", "worker-1", *DEMO).stdout.decode()
    assert "[text BAD-SIGNATURE] pay 99" in tail
    as_json = ralph(team.home, "tail", "worker-1", *DEMO, "--json").stdout
    assert as_json == stored.replace(b"pay 10", b"pay 99")
    read = ralph(team.home, "read", *DEMO, "--agent", "worker-1").stdout.decode()
    assert "[text BAD-SIGNATURE] pay 99" in read
    ralph(team.home, "send", "worker-1", "plain", *DEMO, "--agent", "lead",
          RALPH_KEYS=str(team.home / "nowhere"))  # fmt: skip
    assert (
        "[text unsigned] plain"
        in ralph(team.home, "read", *DEMO, "--agent", "worker-1").stdout.decode()
    )


def test_require_signed_refuses_a_forged_lead_and_sets_aside_what_got_past(team: Team) -> None:
    """Under require_signed a process claiming --agent lead without lead's key file
    exits 4 and writes nothing; a keyless member too; a line written past the Gate is
    set aside by the reader (doctor says why) and read once only."""
    ralph(team.home, "keys", "create", *DEMO, "--agent", "lead")
    ralph(team.home, "keys", "create", *DEMO, "--agent", "worker-1")
    not_lead = ralph(team.home, "policy", "require-signed", "on", *DEMO, "--agent", "worker-1")
    assert not_lead.returncode == 4
    on = ralph(team.home, "policy", "require-signed", "on", *DEMO, "--agent", "lead")
    assert on.returncode == 0, on.stderr
    assert b"require signed: on" in ralph(team.home, "policy", "show", *DEMO).stdout
    before = inbox(team, "worker-1").read_bytes()
    forged = ralph(team.home, "send", "worker-1", "deploy", *DEMO, "--agent", "lead",
                   RALPH_KEYS=str(team.home / "elsewhere"))  # fmt: skip
    assert forged.returncode == 4 and b"requires signed messages" in forged.stderr
    keyless = ralph(team.home, "send", "worker-1", "hi", *DEMO, "--agent", "worker-2")
    assert keyless.returncode == 4
    assert inbox(team, "worker-1").read_bytes() == before
    line = (
        b'{"id":"0123456789ab","from":"lead","to":"worker-1","type":"text",'
        b'"content":"past the gate","metadata":{},"ts":"2026-01-01T00:00:00.000000Z"}\n'
    )
    with inbox(team, "worker-1").open("ab") as file:
        file.write(line)
    assert ralph(team.home, "send", "worker-1", "ok", *DEMO, "--agent", "lead").returncode == 0
    read = ralph(team.home, "read", *DEMO, "--agent", "worker-1").stdout.decode()
    assert "ok" in read and "past the gate" not in read
    doctor = ralph(team.home, "doctor").stdout.decode()
    assert "has no signature and the team requires signed messages" in doctor
    assert ralph(team.home, "read", *DEMO, "--agent", "worker-1").stdout == b""
    dead = team.home / "teams" / "demo" / "deadletters" / "worker-1.jsonl"
    assert len(dead.read_bytes().splitlines()) == 1


def test_a_missing_cryptography_is_one_line_and_exit_2(team: Team) -> None:
    """Without cryptography (its import blocked), keys create says the pip line and
    exits 2; a send in a team without keys does not need it."""
    code = ("import sys; sys.modules['cryptography'] = None; from ralph_mail.cli import main; "
            "sys.exit(main(sys.argv[1:]))")  # fmt: skip
    made = subprocess.run([sys.executable, "-c", code, "keys", "create", *DEMO, "--agent", "lead"],
                          capture_output=True, env=cli_env(team.home), timeout=BOUND_S)  # fmt: skip
    assert made.returncode == 2
    assert made.stderr.decode() == (
        "ralph-mail: error: signing needs the cryptography package: "
        "pip install 'ralph-mail[sign]'\n"
    )
    assert not (team.home / "keys" / "demo" / "lead.key").exists()
    sent = subprocess.run([sys.executable, "-c", code, "send", "worker-1", "x", *DEMO, "--agent",
                           "lead"], capture_output=True, env=cli_env(team.home),
                          timeout=BOUND_S)  # fmt: skip
    assert sent.returncode == 0, sent.stderr


def test_a_set_aside_line_alone_is_set_aside_once(team: Team) -> None:
    """An inbox holding only a line the reader refuses: the first read sets it aside
    and moves past it; later reads and waits find nothing and record it no more."""
    ralph(team.home, "policy", "require-signed", "on", *DEMO, "--agent", "lead")
    line = (
        b'{"id":"0123456789ab","from":"lead","to":"worker-1","type":"text","content":"x",'
        b'"metadata":{},"ts":"2026-01-01T00:00:00.000000Z"}\n'
    )
    inbox(team, "worker-1").write_bytes(line)
    for args in (["read"], ["read"], ["wait", "--timeout", "0"]):
        done = ralph(team.home, *args, *DEMO, "--agent", "worker-1")
        assert done.stdout == b"" and done.returncode in (0, 1), done.stderr
    dead = team.home / "teams" / "demo" / "deadletters" / "worker-1.jsonl"
    assert len(dead.read_bytes().splitlines()) == 1
