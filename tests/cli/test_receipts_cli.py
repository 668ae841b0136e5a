"""Receipts from the command line, with real processes (files and NATS): `receipt ID`,
`send`/`broadcast --wait-consumed S` against a reader process, and the note a send to
an offline agent prints."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson
import pytest

from ralph_mail import MessageBus, Team
from tests.helpers.backends import one_process_only
from tests.helpers.processes import BOUND_S, Processes, cli_env, ralph


@pytest.fixture
def crew(team_on_every_backend: Team) -> Team:
    """Team 'demo' (lead, worker-1, worker-2) on files and on NATS (the readers are
    other processes: the memory backend cannot have them)."""
    one_process_only(team_on_every_backend)
    return team_on_every_backend


def as_agent(agent: str) -> tuple[str, ...]:
    return ("--team", "demo", "--agent", agent)


def reader(team: Team, procs: Processes, agent: str) -> subprocess.Popen[bytes]:
    """A `ralph-mail wait` of ``agent``'s inbox: it consumes the next message, prints it
    and exits 0 (1 when none comes within `BOUND_S`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "wait", "--timeout", str(BOUND_S), *as_agent(agent)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(team.home),
    )  # fmt: skip
    procs.started.append(proc)
    return proc


def test_receipt_prints_a_line_per_recipient_and_json(crew: Team) -> None:
    """receipt ID prints the recipient, the state and the times ('-': not yet), one
    line each (a broadcast: per recipient); --json one record each."""
    sent = ralph(crew.home, "send", "lead", "hello", *as_agent("worker-1"))
    message_id = sent.stdout.decode().strip()
    shown = ralph(crew.home, "receipt", message_id, *as_agent("worker-1"))
    assert shown.returncode == 0, shown.stderr
    to, state, stored, consumed, acked, answer = shown.stdout.decode().rstrip("\n").split("\t")
    assert (to, state, consumed, acked, answer) == ("lead", "stored", "-", "-", "-")
    assert stored.endswith("Z")
    ralph(crew.home, "read", *as_agent("lead"))
    record = orjson.loads(
        ralph(crew.home, "receipt", message_id, "--json", *as_agent("lead")).stdout
    )
    assert (record["id"], record["to"], record["state"]) == (message_id, "lead", "consumed")
    assert record["stored_at"] == stored and record["consumed_at"] >= stored
    assert (record["acked_at"], record["answered_by"]) == (None, None)
    broadcast = ralph(crew.home, "broadcast", "all", *as_agent("lead")).stdout.decode().strip()
    lines = ralph(crew.home, "receipt", broadcast, *as_agent("lead")).stdout.splitlines()
    assert [line.split(b"\t")[:2] for line in lines] == [
        [b"worker-1", b"stored"], [b"worker-2", b"stored"],
    ]  # fmt: skip


def test_receipt_of_an_unknown_id_exits_2(crew: Team) -> None:
    """An id no message of mine has, or no id at all: one line, exit 2."""
    unknown = ralph(crew.home, "receipt", "0123456789ab", *as_agent("worker-1"))
    assert unknown.returncode == 2 and unknown.stdout == b""
    assert unknown.stderr.startswith(b"ralph-mail: error: no message 0123456789ab between")
    invalid = ralph(crew.home, "receipt", "nope", *as_agent("worker-1"))
    assert invalid.returncode == 2 and b"invalid message id 'nope'" in invalid.stderr


def test_send_wait_consumed_exits_0_once_a_reader_consumed_it(crew: Team, procs: Processes) -> None:
    """send --wait-consumed S returns 0 once the recipient's reader process consumed it."""
    lead = reader(crew, procs, "lead")
    sent = ralph(crew.home, "send", "lead", "read me", "--wait-consumed", str(BOUND_S),
                 *as_agent("worker-1"))  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert lead.wait(timeout=BOUND_S) == 0
    assert lead.stdout is not None and b"read me" in lead.stdout.read()


def test_send_wait_consumed_exits_1_when_nobody_reads(crew: Team) -> None:
    """With no reader, send --wait-consumed S exits 1 after about S seconds, naming the
    recipient; the message is stored."""
    started = time.monotonic()
    sent = ralph(crew.home, "send", "lead", "anyone?", "--wait-consumed", "0.5",
                 *as_agent("worker-1"))  # fmt: skip
    assert sent.returncode == 1 and time.monotonic() - started < BOUND_S
    assert b"was not consumed by lead within 0.5 s" in sent.stderr
    assert [m.content for m in MessageBus("demo", "lead").peek()] == ["anyone?"]


def test_broadcast_wait_consumed_waits_for_every_reader(crew: Team, procs: Processes) -> None:
    """broadcast --wait-consumed S returns 0 once every member's reader consumed it."""
    readers = [reader(crew, procs, name) for name in ("worker-1", "worker-2")]
    sent = ralph(crew.home, "broadcast", "everyone", "--wait-consumed", str(BOUND_S),
                 *as_agent("lead"))  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert [proc.wait(timeout=BOUND_S) for proc in readers] == [0, 0]


def test_a_send_to_an_offline_agent_says_so_and_is_stored(crew: Team) -> None:
    """A send to an agent that is offline prints one note on stderr and exits 0: the
    message is stored; to an agent that was just active, no note."""
    sent = ralph(crew.home, "send", "worker-2", "for later", *as_agent("worker-1"))
    assert sent.returncode == 0
    assert sent.stderr == (
        b"ralph-mail: note: worker-2 is offline (never seen): the message waits in its inbox\n"
    )
    assert ralph(crew.home, "read", *as_agent("worker-2")).returncode == 0  # active now
    again = ralph(crew.home, "send", "worker-2", "now", *as_agent("worker-1"))
    assert again.returncode == 0 and again.stderr == b""
    told = ralph(crew.home, "broadcast", "all", *as_agent("worker-2"))
    assert told.returncode == 0
    assert (
        told.stderr
        == b"ralph-mail: note: lead is offline (never seen): the message waits in its inbox\n"
    )


def test_wait_consumed_of_a_denied_message_exits_3(crew: Team, procs: Processes) -> None:
    """A held message that its approver denies ends send --wait-consumed with exit 3."""
    allow = ("policy", "allow", "worker-1", "worker-2", "--approval", *as_agent("lead"))
    assert ralph(crew.home, *allow).returncode == 0
    sender = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "send", "worker-2", "may I?", "--wait-consumed",
         str(BOUND_S), *as_agent("worker-1")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(crew.home),
    )  # fmt: skip
    procs.started.append(sender)
    with MessageBus("demo", "lead") as lead:
        request = lead.wait_for_message("approval_request", timeout=BOUND_S)
    assert request is not None
    denied = ralph(crew.home, "deny", request.metadata["held"], *as_agent("lead"))
    assert denied.returncode == 0, denied.stderr
    assert sender.wait(timeout=BOUND_S) == 3
    assert sender.stderr is not None and b"was denied" in sender.stderr.read()
