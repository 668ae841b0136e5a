"""Team governance: who may contact whom (rules, hierarchy, modes), approvals, rate limits,
a broken policy failing closed; in Python and from the command line."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import orjson
import pytest

from ralph_mail import MessageBus, PermissionDenied, RateLimited, Team, create_team
from ralph_mail.govern.policy import Policy, Rule
from ralph_mail.message import encode
from ralph_mail.team import update_team
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph

CREW = ("lead", "boss", "intern", "writer", "archive")


@pytest.fixture
def crew(home: Path) -> Team:
    """lead; boss manages intern; writer; archive."""
    team = create_team("crew", list(CREW), home=home)
    update_team("crew", home, member="intern", manager="boss")
    return team


def set_policy(
    rules: list[tuple[str, str, str, bool]], rates: dict[str, int] | None = None
) -> None:
    policy = Policy(tuple(Rule(*rule) for rule in rules), dict(rates or {}))  # type: ignore[arg-type]
    with MessageBus("crew", "lead") as lead:
        lead.store.save_state("policy", policy.to_json())


def verdict(sender: str, target: str) -> str:
    """What sending a text from sender to target does: delivered, held or denied."""
    with MessageBus("crew", sender) as bus:
        try:
            message = bus.send(target, "text", "hello")
        except PermissionDenied:
            return "denied"
        return "delivered" if message.ts else "held"


#: (rules, sender, target, expected): one row per step of the resolution order.
RESOLUTION = [
    ([], "writer", "archive", "delivered"),  # 6. no rule: allowed
    ([("*", "archive", "deny", False)], "writer", "archive", "denied"),  # 2. explicit deny
    ([("writer", "archive", "deny", False)], "writer", "archive", "denied"),
    ([("writer", "archive", "deny", False)], "lead", "archive", "delivered"),  # not lead's
    ([("*", "archive", "allow", True)], "writer", "archive", "held"),  # 3. explicit allow
    ([("*", "archive", "allow", False)], "writer", "archive", "delivered"),
    # 2 before 3: an explicit deny beats an explicit allow
    ([("writer", "archive", "allow", False), ("*", "archive", "deny", False)], "writer",
     "archive", "denied"),
    ([("writer", "*", "deny", False)], "writer", "archive", "denied"),  # 4. wildcard deny
    # 3 before 4: an explicit allow beats a wildcard deny
    ([("writer", "*", "deny", False), ("writer", "lead", "allow", False)], "writer", "lead",
     "delivered"),
    ([("writer", "*", "allow", True)], "writer", "archive", "held"),  # 5. wildcard allow
    # 4 before 5: a wildcard deny beats a wildcard allow
    ([("writer", "*", "allow", False), ("*", "*", "deny", False)], "writer", "lead", "denied"),
    # the sender's own rule wins over everyone's at the same step
    ([("*", "archive", "allow", True), ("writer", "archive", "allow", False)], "writer",
     "archive", "delivered"),
    # 1. the hierarchy bypasses the rules: manager and direct reports
    ([("*", "*", "deny", False)], "intern", "boss", "delivered"),
    ([("*", "*", "deny", False)], "boss", "intern", "delivered"),
    ([("*", "*", "deny", False)], "intern", "writer", "denied"),
]  # fmt: skip


@pytest.mark.parametrize(("rules", "sender", "target", "expected"), RESOLUTION)
def test_the_resolution_order(
    crew: Team, rules: list[tuple[str, str, str, bool]], sender: str, target: str, expected: str
) -> None:
    """OpenCompany's order: hierarchy, explicit deny, explicit allow (its approval flag),
    wildcard deny, wildcard allow, default allow."""
    set_policy(rules)
    assert verdict(sender, target) == expected


def test_modes_hold_on_top_of_the_rules(crew: Team) -> None:
    """supervised: contact is held (not contact with the manager); strict: everything it
    sends is held, replies and messages to its manager too; acks and protocol messages
    never are."""
    update_team("crew", member="writer", mode="supervised")
    update_team("crew", member="intern", mode="strict")
    assert verdict("writer", "archive") == "held"
    assert verdict("intern", "boss") == "held"
    with MessageBus("crew", "lead") as lead:
        question = lead.send("intern", "request", "status?")
    with MessageBus("crew", "intern") as intern:
        assert not intern.reply(question, "fine").ts  # held
        assert intern.ack(question).ts  # delivered
        assert intern.send("lead", "status_update", "ok", {"state": "working"}).ts


def test_a_refused_message_writes_nothing(crew: Team) -> None:
    """PermissionDenied (also a PermissionError) names the rule and the fix; no inbox grows."""
    set_policy([("*", "archive", "deny", False)])
    with MessageBus("crew", "writer") as writer:
        before = writer.store.size("archive")
        with pytest.raises(PermissionError, match=r"writer may not contact archive \(explicit"):
            writer.send("archive", "text", "hi")
        with pytest.raises(PermissionDenied):
            writer.broadcast("everyone")
        assert writer.store.size("archive") == before


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"{not json", "it is not JSON"),
        (b"[]", "it is not a JSON object"),
        (b'{"rulez": []}', "unknown key 'rulez'"),
        (b'{"rules": [{"from": "*", "to": "x", "permission": "maybe"}]}', "permission 'maybe'"),
        (b'{"rules": [{"from": "../x", "to": "x", "permission": "deny"}]}', "invalid rule 0 from"),
        (b'{"rates": {"*": 0}}', "invalid rate 0"),
        (b'{"rules": []}' + b" " * (1 << 20), "over 1,048,576"),
    ],
)
def test_a_broken_policy_fails_closed(crew: Team, raw: bytes, problem: str) -> None:
    """A policy that does not parse refuses every agent-initiated contact, naming the file
    and the problem; protocol messages and replies still go."""
    with MessageBus("crew", "lead") as lead:
        lead.store.save_state("policy", raw)
    with MessageBus("crew", "writer") as writer:
        with pytest.raises(PermissionDenied, match=r"policy\.json is broken") as caught:
            writer.send("lead", "text", "hi")
        assert problem in str(caught.value)
        assert writer.send("lead", "status_update", "ok", {"state": "working"}).ts


def test_a_symlinked_policy_fails_closed(crew: Team, tmp_path: Path) -> None:
    """state/policy.json planted as a symlink is not followed: contact is refused."""
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    policy = crew.home / "teams" / "crew" / "state" / "policy.json"
    policy.symlink_to(target)
    with MessageBus("crew", "writer") as writer, pytest.raises(PermissionDenied, match="broken"):
        writer.send("lead", "text", "hi")


def test_a_policy_change_reaches_a_running_sender_at_once(crew: Team) -> None:
    """A sender that sent before a deny was set is refused on its next message."""
    with MessageBus("crew", "writer") as writer:
        assert writer.send("archive", "text", "first").ts
        set_policy([("*", "archive", "deny", False)])
        with pytest.raises(PermissionDenied):
            writer.send("archive", "text", "second")


def test_the_rate_limit_counts_per_sender_and_says_when_to_retry(crew: Team) -> None:
    """rate 3/min: three messages go, the fourth is refused with when to retry; replies
    are not counted; another sender has its own count."""
    set_policy([], {"writer": 3})
    with MessageBus("crew", "writer") as writer, MessageBus("crew", "lead") as lead:
        for n in range(3):
            writer.send("lead", "text", f"{n}")
        with pytest.raises(RateLimited, match=r"retry in \d+\.\d s"):
            writer.send("archive", "text", "one too many")
        question = lead.send("writer", "request", "still there?")
        assert writer.reply(question, "yes").ts
        lead.send("writer", "text", "lead is not limited")


SENDER = """
import sys
from ralph_mail import MessageBus, RateLimited
bus = MessageBus("crew", "writer")
print("ready", flush=True)
sys.stdin.readline()
sent = 0
for n in range(20):
    try:
        bus.send("lead", "text", str(n))
        sent += 1
    except RateLimited:
        pass
print(sent, flush=True)
"""


def test_eight_processes_of_one_sender_share_its_rate_exactly(
    crew: Team, procs: Processes, home: Path
) -> None:
    """8 processes of one agent, 20 sends each at once, rate 25/min: exactly 25 go."""
    set_policy([], {"writer": 25})
    children = [procs.python(SENDER, env=cli_env(home)) for _ in range(8)]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    for child in children:
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
    sent = 0
    for child in children:
        out, err = child.communicate(timeout=BOUND_S)
        assert child.returncode == 0, err
        sent += int(out)
    assert sent == 25
    with MessageBus("crew", "lead") as lead:
        assert len(lead.poll()) == 25


def test_a_held_message_is_delivered_unchanged_once_approved(crew: Team) -> None:
    """Held: not delivered; the approver (the sender's manager) gets an approval_request
    and lists it; approve delivers the same id and tells the sender; approving again
    changes nothing. Every step with fresh buses: it survives restarts."""
    set_policy([("intern", "*", "allow", True)])
    with MessageBus("crew", "intern") as intern:
        held = intern.send("writer", "text", "can you review my draft?")
        assert not held.ts
        assert intern.approval_of(held.id).decision is None  # type: ignore[union-attr]
    with MessageBus("crew", "writer") as writer:
        assert writer.poll() == []
    with MessageBus("crew", "boss") as boss:
        (request,) = boss.poll()
        assert (request.type, request.metadata["held"]) == ("approval_request", held.id)
        assert [h.id for h in boss.approvals()] == [held.id]
    with MessageBus("crew", "boss") as boss:
        boss.approve(held.id)
        assert boss.approvals() == []
        boss.approve(held.id)  # again: nothing more is delivered
    with MessageBus("crew", "writer") as writer:
        (delivered,) = writer.poll()
        assert (delivered.id, delivered.from_agent, delivered.content) == (
            held.id, "intern", "can you review my draft?"
        )  # fmt: skip
    with MessageBus("crew", "intern") as intern:
        (told,) = intern.poll()
        assert (told.type, told.reply_to, told.metadata["approved"]) == (
            "approval_response", held.id, "true"
        )  # fmt: skip


def test_a_denied_message_is_never_delivered_and_the_sender_is_told(crew: Team) -> None:
    """deny: the recipient never gets it; the sender gets approved=false with the reason;
    approving it afterwards is refused."""
    set_policy([("writer", "archive", "allow", True)])
    with MessageBus("crew", "writer") as writer:
        held = writer.send("archive", "text", "wake up")
    with MessageBus("crew", "lead") as lead:  # writer has no manager: the lead decides
        lead.deny(held.id, "archive runs on schedule")
        with pytest.raises(Exception, match="already denied"):
            lead.approve(held.id)
    with MessageBus("crew", "archive") as archive:
        assert archive.poll() == []
    with MessageBus("crew", "writer") as writer:
        (told,) = writer.poll()
        assert told.metadata == {"approved": "false", "reason": "archive runs on schedule"}


def test_an_ask_waits_for_the_decision_then_the_reply(crew: Team) -> None:
    """A held ask waits (presence awaiting_approval) for the approver, then the reply."""
    set_policy([("writer", "archive", "allow", True)])
    seen: list[str] = []

    def approver_and_replier() -> None:
        with MessageBus("crew", "lead") as lead:
            request = lead.wait_for_message("approval_request", timeout=BOUND_S)
            assert request is not None
            deadline = time.monotonic() + BOUND_S  # the asker says so once it waits
            while time.monotonic() < deadline and not seen:
                presence = {a.name: a.presence for a in lead.agents()}
                if presence["writer"] == "awaiting_approval":
                    seen.append(presence["writer"])
                time.sleep(0.01)
            lead.approve(request.metadata["held"])
        with MessageBus("crew", "archive") as archive:
            (question,) = archive.wait_for_messages(timeout=BOUND_S)
            archive.reply(question, "42")

    helper = threading.Thread(target=approver_and_replier)
    helper.start()
    with MessageBus("crew", "writer") as writer:
        writer.set_presence("working")
        with MessageBus("crew", "archive") as archive:
            archive.set_presence("idle")
        assert writer.ask("archive", "the answer?", timeout=BOUND_S).content == "42"
    helper.join()
    assert seen == ["awaiting_approval"]


def test_the_policy_from_the_command_line(crew: Team) -> None:
    """policy allow/deny/rate/depth change the saved policy; show prints it; a refused
    send exits 4 in one line; a held one exits 0 with a note naming the approver, and
    --wait reports the decision (0 approved, 3 denied, 1 none)."""
    team = ("--team", "crew")
    assert (
        ralph(crew.home, "policy", "deny", "*", "archive", *team, "--agent", "lead").returncode == 0
    )
    assert (
        ralph(
            crew.home, "policy", "allow", "intern", "*", "--approval", *team, "--agent", "lead"
        ).returncode
        == 0
    )
    assert ralph(crew.home, "policy", "rate", "*", "10", *team, "--agent", "lead").returncode == 0
    assert ralph(crew.home, "policy", "depth", "4", *team, "--agent", "lead").returncode == 0
    shown = orjson.loads(ralph(crew.home, "policy", "show", "--json", *team).stdout)
    assert shown["rules"] == [
        {"from": "*", "to": "archive", "permission": "deny", "approval": False},
        {"from": "intern", "to": "*", "permission": "allow", "approval": True},
    ]
    assert shown["rates"] == {"*": 10}
    refused = ralph(crew.home, "send", "archive", "hi", *team, "--agent", "writer")
    assert refused.returncode == 4 and refused.stderr.count(b"\n") == 1
    held = ralph(crew.home, "send", "writer", "hi", *team, "--agent", "intern")
    assert held.returncode == 0
    assert held.stderr.decode().startswith("ralph-mail: note: message ")
    assert b"held for boss's approval" in held.stderr
    waited = ralph(crew.home, "send", "writer", "again", "--wait", "0.2", *team, "--agent",
                   "intern")  # fmt: skip
    assert waited.returncode == 1
    message_id = waited.stdout.decode().strip()
    assert ralph(crew.home, "deny", message_id, *team, "--agent", "boss").returncode == 0
    listed = ralph(crew.home, "approvals", "--json", *team, "--agent", "boss")
    (first,) = [orjson.loads(line) for line in listed.stdout.splitlines()]
    assert first["content"] == "hi" and first["approver"] == "boss"
    bad = ralph(crew.home, "policy", "rate", "*", "lots", *team, "--agent", "lead")
    assert bad.returncode == 2 and b"invalid rate 'lots'" in bad.stderr
    assert ralph(crew.home, "policy", "deny", "../x", "*", *team, "--agent", "lead").returncode == 2


def test_a_broken_policy_is_one_line_and_exit_4_from_the_command_line(crew: Team) -> None:
    """A malformed policy: send exits 4 naming the file; policy show exits 2 naming it."""
    path = crew.home / "teams" / "crew" / "state" / "policy.json"
    path.write_text("{oops")
    os.chmod(path, 0o600)
    sent = ralph(crew.home, "send", "lead", "hi", "--team", "crew", "--agent", "writer")
    assert sent.returncode == 4 and sent.stderr.count(b"\n") == 1
    assert str(path).encode() in sent.stderr
    shown = ralph(crew.home, "policy", "show", "--team", "crew")
    assert shown.returncode == 2 and b"is broken" in shown.stderr


def test_tail_visible_is_the_user_facing_timeline(crew: Team) -> None:
    """tail --visible shows user_visible messages and user_redacted ones as their first
    line, never internal ones; tail alone shows all; --visibility on broadcast, ask,
    delegate and reply sets the key."""
    with MessageBus("crew", "writer") as writer:
        writer.send("lead", "text", "internal chatter")
        writer.send("lead", "text", "Draft ready", visibility="user_visible")
        writer.send("lead", "text", "Summary line\nsecret details", visibility="user_redacted")
        writer.broadcast("all hands", visibility="user_visible")
        with MessageBus("crew", "archive") as archive:
            archive.set_presence("idle")
        task = writer.delegate("archive", "file it", visibility="user_visible")
    args = ("--all", "--team", "crew", "--agent", "lead")
    shown = ralph(crew.home, "tail", "--visible", *args).stdout.decode()
    assert "internal chatter" not in shown and "secret details" not in shown
    assert "Draft ready" in shown and "Summary line …" in shown and "file it" in shown
    assert "internal chatter" in ralph(crew.home, "tail", *args).stdout.decode()
    with MessageBus("crew", "archive") as archive:
        (assignment,) = [m for m in archive.poll() if m.type == "task_assignment"]
    assert assignment.id == task.assignment and assignment.visibility == "user_visible"


def test_search_and_purge_from_the_command_line(crew: Team) -> None:
    """search finds sent messages, archived ones too, newest first, with filters, and
    prints nothing and exits 0 when nothing matches; history still shows what gc
    archived; gc --purge-before deletes archived messages for good."""
    with MessageBus("crew", "writer") as writer:
        writer.send("lead", "text", "Q4 revenue was 2.4M")
        writer.send("lead", "text", "revenue forecast for Q1")
    with MessageBus("crew", "lead") as lead:
        lead.poll()
    team = ("--team", "crew")
    gc = ralph(crew.home, "gc", *team)
    assert gc.returncode == 0 and b"archived: 'search' finds them" in gc.stdout
    found = ralph(crew.home, "search", "revenue", *team).stdout.decode().splitlines()
    assert ["forecast" in line for line in found] == [True, False]
    only = ralph(crew.home, "search", "revenue 2.4M", "--from", "writer", *team)
    assert len(only.stdout.splitlines()) == 1
    nothing = ralph(crew.home, "search", "nothing-like-this", *team)  # no match: exit 0
    assert (nothing.returncode, nothing.stdout) == (0, b"")
    with MessageBus("crew", "lead") as lead:
        assert [m.content for m in lead.history("writer", 5)] == [
            "Q4 revenue was 2.4M", "revenue forecast for Q1"
        ]  # fmt: skip
    purged = ralph(crew.home, "gc", "--purge-before", "0s", *team)
    assert purged.returncode == 0, purged.stderr
    assert ralph(crew.home, "search", "revenue", *team).stdout == b""
    bad = ralph(crew.home, "search", "x", "--since", "last tuesday", *team)
    assert bad.returncode == 2 and b"invalid time 'last tuesday'" in bad.stderr


def test_tail_says_where_archived_mail_is(crew: Team) -> None:
    """tail on an inbox gc compacted shows what is left, and says on stderr that older
    messages are archived and how to search them."""
    with MessageBus("crew", "writer") as writer:
        writer.send("lead", "text", "first")
    with MessageBus("crew", "lead") as lead:
        lead.poll()
    assert ralph(crew.home, "gc", "--team", "crew").returncode == 0
    tail = ralph(crew.home, "tail", "lead", "--team", "crew")
    assert tail.returncode == 0 and tail.stdout == b""
    assert tail.stderr == (
        b"ralph-mail: note: older messages of lead are archived (gc): "
        b"ralph-mail search '' --to lead\n"
    )


def test_approvals_json_is_the_held_envelope_at_the_top_level(crew: Team) -> None:
    """approvals --json prints one line per held message: the envelope's own keys at the
    top, exactly as approve delivers it, plus approver, reason and held_at."""
    set_policy([("intern", "*", "allow", True)])
    team = ("--team", "crew", "--agent", "boss")
    with MessageBus("crew", "intern") as intern:
        first = intern.send("writer", "text", "draft one", {"k": "v"})
        intern.send("lead", "text", "draft two")
    listed = ralph(crew.home, "approvals", "--json", *team)
    assert listed.returncode == 0, listed.stderr
    records = [orjson.loads(line) for line in listed.stdout.splitlines()]
    assert [r["content"] for r in records] == ["draft one", "draft two"]
    shown = records[0]
    extra = {key: shown.pop(key) for key in ("approver", "reason", "held_at")}
    assert extra["approver"] == "boss" and extra["reason"] and extra["held_at"]
    assert ralph(crew.home, "approve", first.id, *team).returncode == 0
    (delivered,) = [m for m in MessageBus("crew", "writer").poll() if m.id == first.id]
    envelope = orjson.loads(encode(delivered))
    assert {k: v for k, v in shown.items() if k != "ts"} == {
        k: v for k, v in envelope.items() if k != "ts"
    }
