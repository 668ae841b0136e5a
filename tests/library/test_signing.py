"""Signed senders in the library: key files, who may publish a key, held messages and
channel posts signed, the verification the views show, and what is never imported."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ralph_mail import MailError, MessageBus, PermissionDenied, Team
from ralph_mail.govern import keys
from ralph_mail.store import keyfile
from ralph_mail.talk.history import History
from tests.helpers.processes import cli_env


def make_key(agent: str) -> str:
    with MessageBus("demo", agent) as bus:
        kid, _ = keys.create(bus)
    return kid


def test_the_key_file_is_0600_outside_the_team_and_never_overwritten(team: Team) -> None:
    """The private key is a 0600 file under HOME/keys/TEAM (a 0700 folder), not in the
    team's data; creating again keeps it unless forced, and force makes a new one that
    the roster then has."""
    kid = make_key("lead")
    path = team.home / "keys" / "demo" / "lead.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not (team.home / "teams" / "demo" / "keys").exists()
    before = path.read_bytes()
    with MessageBus("demo", "lead") as bus:
        with pytest.raises(MailError, match="it was kept"):
            keys.create(bus)
        assert path.read_bytes() == before
        new_kid, _ = keys.create(bus, force=True)
        assert new_kid != kid and path.read_bytes() != before
        assert bus.send("worker-1", "text", "new key").to_dict()["kid"] == new_kid
    assert [m.verified for m in MessageBus("demo", "worker-1").poll()] == [True]
    assert list(path.parent.iterdir()) == [path]  # no temp file left


def test_a_key_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """Two writers of one new key file: exactly one wins, the other is refused, and the
    file holds the winner's bytes whole."""
    where = tmp_path / "k" / "a.key"
    keyfile.write(where, b"first")
    with pytest.raises(MailError, match="it was kept"):
        keyfile.write(where, b"second")
    assert where.read_bytes() == b"first"
    keyfile.write(where, b"third", force=True)
    assert where.read_bytes() == b"third"
    assert stat.S_IMODE(where.stat().st_mode) == 0o600


def test_ralph_keys_moves_the_keys_elsewhere(team: Team, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``RALPH_KEYS`` puts the key files in another folder (the agent's own host)."""
    monkeypatch.setenv("RALPH_KEYS", str(tmp_path / "elsewhere"))
    make_key("worker-1")
    assert (tmp_path / "elsewhere" / "demo" / "worker-1.key").exists()
    assert not (team.home / "keys").exists()


def test_who_may_publish_a_key(team: Team) -> None:
    """A member publishes its own first key; another member's, or replacing a published
    one, is the lead's act; the lead may forget a key."""
    make_key("worker-1")
    published = team.store.roster()
    with MessageBus("demo", "worker-2") as other, pytest.raises(PermissionDenied, match="lead"):
        keys.forget(other, "worker-1")
    path = keyfile.path("demo", "worker-1")
    path.unlink()  # worker-1 lost its key file: a new key replaces a published one
    with MessageBus("demo", "worker-1") as w1:
        with pytest.raises(PermissionDenied, match="replacing or removing worker-1's public key"):
            keys.create(w1)
        assert not path.exists() and team.store.roster() == published  # nothing changed
    with MessageBus("demo", "lead") as lead:
        keys.forget(lead, "worker-1")
        assert lead.refresh_team().member("worker-1").key is None
    make_key("worker-1")


def test_an_approved_message_keeps_its_senders_signature(team: Team) -> None:
    """worker-1 is supervised: its message is held, signed by it; the lead approves it
    and it is delivered unchanged, still verifying as worker-1's."""
    make_key("worker-1")
    make_key("lead")
    with MessageBus("demo", "lead") as lead:
        lead.set_member("worker-1", mode="supervised")
        MessageBus("demo", "worker-1").send("worker-2", "text", "may I?")
        (request,) = lead.poll()
        assert request.type == "approval_request" and request.verified is True
        lead.approve(request.metadata["held"])
    (got,) = MessageBus("demo", "worker-2").poll()
    assert (got.content, got.from_agent, got.verified) == ("may I?", "worker-1", True)


def test_channel_posts_and_mentions_are_signed(team: Team) -> None:
    """A post in a channel and the mention it puts in an inbox are signed and verify."""
    make_key("lead")
    lead = MessageBus("demo", "lead")
    lead.channels.create("ops", ["lead", "worker-1"])
    lead.channel_post("ops", "@worker-1 look")
    w1 = MessageBus("demo", "worker-1")
    assert [p.verified for p in w1.channel_read("ops")] == [True]
    assert [(m.type, m.verified) for m in w1.poll()] == [("mention", True)]


def test_the_views_verify_and_mark_the_unsigned_of_a_signing_sender(team: Team) -> None:
    """History (tail) and the conversation history verify too: a signing sender's
    message is True, an unsigned one from it is marked; a keyless sender's is None,
    unmarked until the team requires signing."""
    make_key("lead")
    lead = MessageBus("demo", "lead")
    lead.send("worker-1", "text", "signed")
    MessageBus("demo", "worker-2").send("worker-1", "text", "keyless")
    shown = History("demo", ["worker-1"]).last(5)
    assert [(m.content, m.verified, m.__dict__.get("unsigned")) for m in shown] == [
        ("signed", True, None), ("keyless", None, None),
    ]  # fmt: skip
    assert [m.verified for m in lead.history("worker-1")] == [True]
    lead.change_policy(lambda policy: replace(policy, require_signed=True))
    shown = History("demo", ["worker-1"]).last(5)
    assert [m.__dict__.get("unsigned") for m in shown] == [None, True]


def test_a_team_without_keys_never_imports_cryptography(team: Team) -> None:
    """Sending, reading and viewing in a team without keys leaves cryptography out; the
    first signed message a reader meets brings it in."""
    code = (
        "import sys; from ralph_mail import MessageBus; from ralph_mail.talk.history import "
        "History; MessageBus('demo','lead').send('worker-1','text','x'); "
        "MessageBus('demo','worker-1').poll(); History('demo',['worker-1']).last(5); "
        "print('cryptography' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=cli_env(team.home),
                         timeout=60)  # fmt: skip
    assert run.stdout.strip() == b"False", run.stderr
    make_key("lead")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=cli_env(team.home),
                         timeout=60)  # fmt: skip
    assert run.stdout.strip() == b"True", run.stderr
    assert os.environ.get("RALPH_KEYS") is None


def test_the_canonical_bytes_are_sorted_compact_json_without_sig_and_ts() -> None:
    """`canonical` is the bytes of json.dumps(sort_keys, compact, non-ASCII as is) of
    the envelope less sig and ts, at every level."""
    import json

    from ralph_mail.signing import canonical

    envelope = {"to": "b", "from": "a", "content": "héllo \"q\" \n ☃", "ts": "x", "sig": "y",
                "metadata": {"z": "1", "a": "é"}, "chain": ["b", "a"], "ack": True,
                "kid": "0011"}  # fmt: skip
    kept = {k: v for k, v in envelope.items() if k not in ("sig", "ts")}
    expected = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert canonical(envelope) == expected.encode()


def test_a_malformed_sig_or_kid_is_set_aside(team: Team) -> None:
    """A line whose sig is not 64 bytes of base64, or whose kid is not 16 hex digits, is
    not a message (so any signed line has an '=' for the readers' quick look)."""
    from ralph_mail import InvalidMessage
    from ralph_mail.message import decode

    base = (b'{"id":"0123456789ab","from":"lead","to":"worker-1","type":"text","content":"x",'
            b'"metadata":{},"ts":"2026-01-01T00:00:00.000000Z"')  # fmt: skip
    good_sig = "A" * 86 + "=="
    assert decode(base + b',"kid":"00112233445566ff","sig":"' + good_sig.encode() + b'"}')
    for tail in (b',"kid":"00112233445566ff","sig":"abc"}', b',"kid":"x","sig":"' +
                 good_sig.encode() + b'"}'):  # fmt: skip
        with pytest.raises(InvalidMessage, match="bad value for key"):
            decode(base + tail)


def test_a_view_checks_each_shown_message_once(team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """Marks (top, the serve page) verify a message the first time it is shown, not at
    every refresh; a roster whose keys changed checks them all again."""
    from ralph_mail import signing
    from ralph_mail.govern.policy import requires_signed
    from ralph_mail.message import decode_lines

    make_key("lead")
    with MessageBus("demo", "lead") as lead:
        lead.send("worker-1", "text", "one")
        lead.send("worker-1", "text", "two")
        store = lead.store
        roster = lambda: lead.refresh_team()  # noqa: E731
        checked: list[str] = []
        real = signing.check
        monkeypatch.setattr(signing, "check", lambda envelope, key: (
            checked.append(str(envelope["id"])), real(envelope, key))[1])  # fmt: skip
        marks = signing.Marks()

        def shown() -> list[str]:
            lines, _ = store.read_tail("worker-1", 10)
            return marks.of(decode_lines(lines)[0], roster, requires_signed(store))

        assert shown() == ["", ""] and len(checked) == 2
        assert shown() == ["", ""] and len(checked) == 2  # remembered
        make_key("worker-1")  # the roster's keys changed: checked again
        assert shown() == ["", ""] and len(checked) == 4
