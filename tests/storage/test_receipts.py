"""Receipts, run on every backend: what became of a message at each recipient (held,
denied, stored, consumed, acked, answered) and when, and waiting until it is consumed;
and the store's commit times that say when."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import pytest

from ralph_mail import InvalidMessage, MailError, MessageBus, Receipt, Team
from ralph_mail.govern.policy import Rule
from ralph_mail.message import format_ts
from ralph_mail.store.base import Cursor
from ralph_mail.store.records import MARK_SCAN
from tests.helpers.processes import BOUND_S


@pytest.fixture
def crew(team_on_every_backend: Team) -> Team:
    """Team 'demo' (lead, worker-1, worker-2) on each backend in turn."""
    return team_on_every_backend


def bus(agent: str) -> MessageBus:
    return MessageBus("demo", agent)


def now() -> str:
    return format_ts(time.time_ns() // 1000)


# -- the states -------------------------------------------------------------------------


def test_a_message_is_stored_until_its_recipient_consumes_it(crew: Team) -> None:
    """A sent message is stored (at its ts), then consumed when the recipient's cursor
    passes it, with the time of that commit."""
    sender, lead = bus("worker-1"), bus("lead")
    message = sender.send("lead", "text", "hello")
    assert sender.receipt(message) == Receipt(message.id, "lead", "stored", message.ts)
    before = now()
    lead.poll()
    after = now()
    found = sender.receipt(message)
    assert (found.state, found.stored_at) == ("consumed", message.ts)
    assert found.consumed_at is not None and before <= found.consumed_at <= after


def test_a_receipt_by_id_is_the_receipt_of_the_message(crew: Team) -> None:
    """receipt(id) finds my message among my conversations, as receipt(message) does,
    and the recipient can ask for it too."""
    sender = bus("worker-1")
    message = sender.send("lead", "text", "hello")
    sender.send("worker-2", "text", "other")
    assert sender.receipt(message.id) == sender.receipt(message)
    assert bus("lead").receipt(message.id) == sender.receipt(message)


def test_only_what_the_cursor_passed_is_consumed(crew: Team) -> None:
    """Committing through the second of three messages consumes the first two only."""
    sender, lead = bus("worker-1"), bus("lead")
    sent = [sender.send("lead", "text", f"m{n}") for n in range(3)]
    lead.commit(lead.peek()[1])
    assert [sender.receipt(m).state for m in sent] == ["consumed", "consumed", "stored"]


def test_a_message_consumed_out_of_order_has_its_time(crew: Team) -> None:
    """wait_for_message(type) consumes one message alone: it is consumed, at that commit;
    the one before it stays stored."""
    sender, lead = bus("worker-1"), bus("lead")
    first = sender.send("lead", "text", "first")
    plan = sender.send("lead", "plan_submission", "the plan")
    before = now()
    assert lead.wait_for_message("plan_submission", timeout=0) is not None
    found = sender.receipt(plan)
    assert found.state == "consumed" and before <= str(found.consumed_at) <= now()
    assert sender.receipt(first).state == "stored"
    lead.poll()  # the floor passes both now: the plan keeps the time it was taken at
    assert sender.receipt(plan).consumed_at == found.consumed_at


def test_an_ack_makes_a_message_acked(crew: Team) -> None:
    """The recipient's ack makes the message acked, at the ack's ts."""
    sender, lead = bus("worker-1"), bus("lead")
    message = sender.send("lead", "text", "confirm", ack=True)
    ack = lead.ack(lead.poll()[0])
    found = sender.receipt(message)
    assert (found.state, found.acked_at, found.answered_by) == ("acked", ack.ts, None)


def test_a_reply_answers_a_message(crew: Team) -> None:
    """A reply from the recipient makes the message answered, by the reply's id; a reply
    to another message does not."""
    sender, lead = bus("worker-1"), bus("lead")
    question = sender.send("lead", "text", "which branch?")
    other = sender.send("lead", "text", "unrelated")
    reply = lead.reply(lead.poll()[0], "main")
    assert sender.receipt(question).answered_by == reply.id
    assert sender.receipt(question).state == "answered"
    assert sender.receipt(other).state == "consumed"


def test_a_task_result_answers_the_assignment(crew: Team) -> None:
    """The assignee's task_result answers the task_assignment that delegated it."""
    lead, writer = bus("lead"), bus("worker-1")
    writer.poll()  # online: a delegation to an offline agent is refused
    task = lead.delegate("worker-1", "draft the post")
    assert lead.receipt(task.assignment).state == "stored"
    writer.poll()
    writer.complete(task.id, "drafted")
    result = lead.wait_for_result(task, BOUND_S)
    assert result is not None
    found = lead.receipt(task.assignment)
    assert (found.state, found.answered_by) == ("answered", result.id)


# -- broadcasts -------------------------------------------------------------------------


def test_a_broadcast_has_a_receipt_per_recipient(crew: Team) -> None:
    """A broadcast has one receipt per recipient, each with its own copy's times."""
    lead, w1 = bus("lead"), bus("worker-1")
    message = lead.broadcast("freeze the branch")
    w1.poll()
    found = {r.to: r for r in lead.receipts(message)}
    assert sorted(found) == ["worker-1", "worker-2"]
    assert (found["worker-1"].state, found["worker-2"].state) == ("consumed", "stored")
    assert found["worker-1"].consumed_at is not None and found["worker-2"].stored_at is not None
    assert lead.receipts(message.id) == lead.receipts(message)


def test_receipt_of_a_broadcast_names_its_recipient(crew: Team) -> None:
    """receipt(broadcast) needs to=; a name it did not go to is refused, naming those
    it went to."""
    lead = bus("lead")
    message = lead.broadcast("hello all")
    assert lead.receipt(message, to="worker-2").to == "worker-2"
    with pytest.raises(InvalidMessage, match="went to 2 agents"):
        lead.receipt(message)
    with pytest.raises(
        InvalidMessage, match=r"did not go to lead \(it went to worker-1, worker-2\)"
    ):
        lead.receipt(message, to="lead")


# -- held and denied --------------------------------------------------------------------


def test_a_held_message_is_held_then_denied(crew: Team) -> None:
    """A message held for approval is held; once the approver denies it, denied, and a
    wait for its consumption ends at once."""
    lead, sender = bus("lead"), bus("worker-1")
    lead.change_policy(lambda p: p.with_rule(Rule("worker-1", "worker-2", "allow", True)))
    held = sender.send("worker-2", "text", "may I?")
    assert not held.ts and sender.receipt(held) == Receipt(held.id, "worker-2", "held")
    lead.deny(held.id, "not now")
    assert sender.receipt(held.id) == Receipt(held.id, "worker-2", "denied")
    started = time.monotonic()
    assert sender.wait_consumed(held, timeout=BOUND_S) is False
    assert time.monotonic() - started < BOUND_S / 2


def test_a_held_message_is_stored_once_approved(crew: Team) -> None:
    """Approved, a held message is stored under its id, then consumed like any other."""
    lead, sender, w2 = bus("lead"), bus("worker-1"), bus("worker-2")
    lead.change_policy(lambda p: p.with_rule(Rule("worker-1", "worker-2", "allow", True)))
    held = sender.send("worker-2", "text", "may I?")
    lead.approve(held.id)
    assert sender.receipt(held).state == "stored"
    w2.poll()
    assert sender.wait_consumed(held, timeout=BOUND_S) is True


# -- waiting ----------------------------------------------------------------------------


def test_wait_consumed_returns_once_the_recipient_consumes(crew: Team) -> None:
    """wait_consumed blocks until the recipient's cursor passes the message: True."""
    sender, lead = bus("worker-1"), bus("lead")
    message = sender.send("lead", "text", "read me")
    result: list[bool] = []
    waiting = threading.Thread(target=lambda: result.append(sender.wait_consumed(message, BOUND_S)))
    waiting.start()
    lead.poll()
    waiting.join(BOUND_S)
    assert result == [True] and sender.receipt(message).state == "consumed"


def test_wait_consumed_is_false_when_nobody_reads_in_time(crew: Team) -> None:
    """With no reader, wait_consumed returns False after its timeout."""
    sender = bus("worker-1")
    message = sender.send("lead", "text", "nobody reads this")
    started = time.monotonic()
    assert sender.wait_consumed(message, timeout=0.3) is False
    assert 0.3 <= time.monotonic() - started < BOUND_S


def test_wait_consumed_waits_for_every_recipient_of_a_broadcast(crew: Team) -> None:
    """A broadcast is consumed when every recipient consumed it, not the first."""
    lead, w1, w2 = bus("lead"), bus("worker-1"), bus("worker-2")
    message = lead.broadcast("everyone")
    w1.poll()
    assert lead.wait_consumed(message, timeout=0.2) is False
    w2.poll()
    assert lead.wait_consumed(message, timeout=BOUND_S) is True


# -- bad input --------------------------------------------------------------------------


def test_an_unknown_or_invalid_id_is_refused(crew: Team) -> None:
    """An id no message of mine has is a MailError naming it; a malformed id is invalid;
    a timeout that is no number of seconds is invalid."""
    sender = bus("worker-1")
    message = sender.send("lead", "text", "x")
    with pytest.raises(MailError, match="no message 0123456789ab between worker-1"):
        sender.receipt("0123456789ab")
    with pytest.raises(InvalidMessage, match="invalid message id"):
        sender.receipt("not-an-id")
    with pytest.raises(InvalidMessage, match="invalid timeout"):
        sender.wait_consumed(message, -1)


# -- the store's commit times -----------------------------------------------------------


def test_a_commit_time_is_the_first_commit_that_passed_the_line(crew: Team) -> None:
    """consumed_at is the time of the first commit whose floor passed the offset, and
    None above every floor."""
    store = crew.store
    stored = now()
    store.note_commit("lead", Cursor(0), Cursor(100))
    first = now()
    store.note_commit("lead", Cursor(100), Cursor(300))
    at = store.consumed_at("lead", 50, stored)
    later = store.consumed_at("lead", 200, stored)
    assert at is not None and later is not None and stored <= at <= first <= later
    assert store.consumed_at("lead", 300, stored) is None
    assert store.consumed_at("worker-1", 0, stored) is None  # never committed


def test_a_commit_time_is_not_guessed_across_a_missing_record(crew: Team) -> None:
    """A commit that did not start below the line (the one that passed it was not
    recorded) gives no time: None, never a later one."""
    store = crew.store
    stored = now()
    store.note_commit("lead", Cursor(0), Cursor(100))
    store.note_commit("lead", Cursor(200), Cursor(300))  # 100 -> 200 was not recorded
    assert store.consumed_at("lead", 150, stored) is None
    assert store.consumed_at("lead", 250, stored) is not None


def test_a_mark_is_the_time_of_a_line_consumed_out_of_order(crew: Team) -> None:
    """A line consumed out of order has the time of its mark, also once the floor
    passes it later."""
    store = crew.store
    stored = now()
    store.note_commit("lead", Cursor(0), Cursor(0, {500}))
    marked = store.consumed_at("lead", 500, stored)
    store.note_commit("lead", Cursor(0, {500}), Cursor(1000))
    assert marked is not None and store.consumed_at("lead", 500, stored) == marked
    assert store.consumed_at("lead", 400, stored) is not None


def test_a_line_behind_a_long_backlog_has_the_time_it_was_passed(crew: Team) -> None:
    """A backlog consumed a commit a line (more commits than a search for marks looks
    through) still gives each line the time of the commit that passed it."""
    store = crew.store
    stored = now()
    for k in range(MARK_SCAN + 10):
        store.note_commit("lead", Cursor(10 * k), Cursor(10 * k + 10))
    middle = store.consumed_at("lead", 10 * (MARK_SCAN // 2) + 5, stored)
    last = store.consumed_at("lead", 10 * (MARK_SCAN + 9), stored)
    assert middle is not None and last is not None and stored <= middle <= last


def test_index_extend_notes_entries_in_order_as_index_add_does(crew: Team) -> None:
    """index_extend (a broadcast's copies) notes its entries in order, after what was
    there, as one index_add after another would."""
    store = crew.store
    store.index_add("broadcasts+lead", "worker-1", 0, 10)
    store.index_extend("broadcasts+lead", [("worker-1", 10, 20), ("worker-2", 0, 20)])
    assert store.index_tail("broadcasts+lead", 10) == [
        ("worker-1", 0, 10), ("worker-1", 10, 20), ("worker-2", 0, 20),
    ]  # fmt: skip


def test_a_waiter_on_commits_wakes_on_a_commit(crew: Team) -> None:
    """A waiter made for commits:AGENT wakes when that owner commits."""
    store = crew.store
    waiter = store.waiter(["commits:lead"])
    try:
        store.note_commit("lead", Cursor(0), Cursor(10))
        assert waiter.wait(BOUND_S) is True
    finally:
        waiter.close()


# -- what a lookup costs ----------------------------------------------------------------


def lines_read(bus: MessageBus, look: Callable[[], object]) -> int:
    """How many lines ``look`` reads through ``bus``'s store."""
    store = bus.store
    read_line, count = store.read_line, [0]

    def counted(agent: str, offset: int, length: int) -> bytes | None:
        count[0] += 1
        return read_line(agent, offset, length)

    store.read_line = counted  # type: ignore[method-assign]
    try:
        look()
    finally:
        del store.read_line
    return count[0]


def test_a_receipt_reads_as_many_lines_whatever_the_inbox_holds(crew: Team) -> None:
    """The receipt of the newest message reads the same few lines behind 100 messages as
    behind 1,000: it reads the pair's index back from its end, not the inbox."""
    sender, lead = bus("worker-1"), bus("lead")
    costs = []
    for count in (100, 1000):
        for n in range(count):
            sender.send("lead", "text", f"m{n}")
        lead.poll()
        newest = sender.send("lead", "text", "newest")
        costs.append(lines_read(sender, partial(sender.receipts, newest.id)))
    assert costs[0] == costs[1] <= 64


# -- the commit times' file (the file backend) ------------------------------------------


def test_gc_lets_the_owner_drop_the_commit_times_of_collected_mail(team: Team) -> None:
    """After gc collected what the owner consumed, the owner's next commit drops the
    commit records that speak only of collected lines: the file shrinks, new mail keeps
    its times, and collected mail has none (None, not a wrong one)."""
    from ralph_mail.maintenance import collect
    from ralph_mail.store.files.commits import TRIM_MIN

    sender, lead = MessageBus("demo", "worker-1"), MessageBus("demo", "lead")
    first = sender.send("lead", "text", "first")
    for n in range(2 * TRIM_MIN):
        sender.send("lead", "text", f"m{n}")
    for message in lead.peek():
        lead.commit(message)  # a commit each
    lead.close()
    commits = team.home / "teams/demo/cursors/lead.commits"
    grown = commits.stat().st_size
    assert collect("demo", team.home).removed > 0
    newest = sender.send("lead", "text", "newest")
    with MessageBus("demo", "lead") as lead:
        lead.poll()
    assert commits.stat().st_size < grown / 4
    assert sender.receipt(newest).consumed_at is not None
    assert sender.receipt(first) == Receipt(first.id, "lead", "consumed", first.ts)


def test_a_replaced_inbox_starts_the_commit_times_again(team: Team) -> None:
    """A floor below the last one recorded (the inbox was replaced: its offsets start
    again) starts the file again: the old records say nothing of the new inbox."""
    store = team.store
    stored = now()
    store.note_commit("lead", Cursor(0), Cursor(1000))
    store.note_commit("lead", Cursor(0), Cursor(100))
    assert store.consumed_at("lead", 500, stored) is None
    assert store.consumed_at("lead", 50, stored) is not None
