"""New mail pushed into a live MCP session: the inbox as a subscribable resource, and
with ``--push`` each message as a Claude Code channel event, delivered once. Driven with
the official Python client against a real ``ralph-mail mcp`` subprocess, on files and on
NATS."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from mcp import Client
from mcp.client.extension import ClientExtension, NotificationBinding
from mcp.client.stdio import StdioServerParameters
from mcp.types import CallToolResult, ResourceUpdatedNotification
from pydantic import BaseModel

from ralph_mail import MessageBus, MessageType, Team, create_team
from ralph_mail.mcp_server import build
from tests.helpers.backends import backend_url
from tests.helpers.processes import BOUND_S, cli_env

INBOX = "ralph://inbox"
IDENTIFIER = re.compile(r"[A-Za-z0-9_]+")


@pytest.fixture(params=["file", "nats"])
def push_team(
    request: pytest.FixtureRequest, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Team:
    """Team 'demo' (lead, worker-1, worker-2) on files, then on a real nats-server; the
    server subprocess uses the same backend (RALPH_BACKEND)."""
    url = backend_url(request.param, tmp_path)
    if url:
        monkeypatch.setenv("RALPH_BACKEND", url)
    return create_team("demo", ["lead", ("worker-1", "parses logs"), "worker-2"], home=home)


def server(home: Path, *args: str, transcript: Path | None = None) -> StdioServerParameters:
    """`ralph-mail mcp ARGS` as worker-1 of team 'demo'; with ``transcript``, everything
    it writes to the client is also kept there, byte for byte."""
    env = cli_env(home, RALPH_TEAM="demo", RALPH_AGENT="worker-1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    command = [sys.executable, "-m", "ralph_mail", "mcp", *args]
    if transcript is None:
        return StdioServerParameters(command=command[0], args=command[1:], env=env)
    script = '"$@" | tee "$TRANSCRIPT"'
    env["TRANSCRIPT"] = str(transcript)
    return StdioServerParameters(command="sh", args=["-c", script, "sh", *command], env=env)


class Channel(BaseModel):
    """The params of a ``notifications/claude/channel`` event."""

    content: str
    meta: dict[str, str]


class Recorder(ClientExtension):
    """Records what the server sends on its own: channel events and resource updates,
    in the order they come, on one stream the test reads."""

    identifier = "com.example/recorder"

    def __init__(self, sink: MemoryObjectSendStream[object]) -> None:
        self.sink = sink

    def notifications(self) -> list[NotificationBinding[Any]]:
        async def got(params: Channel) -> None:
            await self.sink.send(params)

        return [NotificationBinding(method="notifications/claude/channel",
                                    params_type=Channel, handler=got)]  # fmt: skip

    async def handle(self, message: object) -> None:
        # a resource update, or a line the client could not read
        if isinstance(message, ResourceUpdatedNotification | Exception):
            await self.sink.send(message)


@asynccontextmanager
async def session(params: StdioServerParameters) -> AsyncIterator[tuple[Client, Any]]:
    """A handshake-era client (as Claude Code speaks) on ``params``, and the stream of
    what the server sent on its own."""
    sink, events = anyio.create_memory_object_stream[object](100)
    recorder = Recorder(sink)
    client = Client(params, mode="legacy", message_handler=recorder.handle, extensions=[recorder])
    async with client:
        yield client, events


async def next_event(events: Any) -> object:
    with anyio.fail_after(BOUND_S):
        found: object = await events.receive()
    assert not isinstance(found, Exception), found
    return found


def text(result: CallToolResult) -> str:
    (block,) = result.content
    return block.text  # type: ignore[union-attr]


async def subscribe(client: Client) -> None:
    with warnings.catch_warnings():  # deprecated from 2026-07-28 on; current in Claude Code
        warnings.simplefilter("ignore")
        await client.subscribe_resource(INBOX)


def test_a_subscriber_is_told_of_new_mail_and_the_resource_shows_it(
    push_team: Team, home: Path
) -> None:
    """Subscribed to ralph://inbox, the client gets notifications/resources/updated when
    a message arrives; reading the resource shows it without consuming it."""
    lead = MessageBus("demo", "lead", home)

    async def main() -> None:
        async with session(server(home)) as (client, events):
            assert client.server_capabilities.resources.subscribe  # type: ignore[union-attr]
            assert not (client.server_capabilities.experimental or {})
            listed = await client.list_resources()
            assert [str(r.uri) for r in listed.resources] == [INBOX]
            await subscribe(client)
            sent = lead.send("worker-1", MessageType.TEXT, "the build is green")
            update = await next_event(events)
            assert isinstance(update, ResourceUpdatedNotification)
            assert update.params.uri == INBOX
            shown = (await client.read_resource(INBOX)).contents[0]
            assert f"text {sent.id} from lead:\nthe build is green" in shown.text  # type: ignore[union-attr]
            checked = text(await client.call_tool("check_inbox", {}))
            assert "the build is green" in checked  # read, not consumed
            assert text(await client.call_tool("check_inbox", {})) == "No new messages."

    anyio.run(main)
    lead.close()


def test_a_2026_client_listens_to_the_inbox(push_team: Team, home: Path) -> None:
    """A client that opens with the 2026-07-28 envelope subscribes with
    subscriptions/listen and gets a resource update for each arrival."""
    lead = MessageBus("demo", "lead", home)

    async def main() -> None:
        async with Client(server(home, "--push")) as client:
            assert client.protocol_version == "2026-07-28"
            async with client.listen(resource_subscriptions=[INBOX]) as updates:
                for n in range(2):
                    lead.send("worker-1", MessageType.TEXT, f"news {n}")
                    with anyio.fail_after(BOUND_S):
                        event = await updates.__anext__()
                    assert getattr(event, "uri", None) == INBOX
            # no channel events at this era: the messages wait for check_inbox
            checked = text(await client.call_tool("check_inbox", {}))
            assert "news 0" in checked and "news 1" in checked

    anyio.run(main)
    lead.close()


def test_push_sends_each_message_once_as_a_channel_event(push_team: Team, home: Path) -> None:
    """With --push the server declares claude/channel; what was waiting at start and
    each new message come as notifications/claude/channel with the text check_inbox
    would show and identifier meta keys; check_inbox does not return them again, and
    they stay consumed after the server is gone."""
    lead = MessageBus("demo", "lead", home)
    early = lead.send("worker-1", MessageType.TEXT, "waiting before you started")

    async def main() -> None:
        async with session(server(home, "--push")) as (client, events):
            assert client.server_capabilities.experimental == {"claude/channel": {}}
            first = await next_event(events)
            assert isinstance(first, Channel) and first.meta["message_id"] == early.id
            task = lead.delegate("worker-1", "rotate the key", priority="high")
            event = await next_event(events)
            assert isinstance(event, Channel)
            assert event.meta == {"message_id": task.assignment, "sender": "lead",
                                  "type": "task_assignment", "priority": "high",
                                  "task_id": task.id}  # fmt: skip
            assert all(IDENTIFIER.fullmatch(key) for key in event.meta)
            assert event.content.startswith(f"Task {task.id} from lead (message ")
            assert event.content.endswith(":\nrotate the key")
            assert text(await client.call_tool("check_inbox", {})) == "No new messages."
            done = await client.call_tool("complete_task", {"task_id": task.id,
                                                            "result": "rotated"})  # fmt: skip
            assert not done.is_error, text(done)

    anyio.run(main)
    again = MessageBus("demo", "worker-1", home)
    assert again.poll() == []  # consumed: delivered once
    again.close()
    result = lead.wait_for_message(MessageType.TASK_RESULT, BOUND_S)
    assert result is not None and result.content == "rotated"
    lead.close()


def test_a_pushed_request_is_answered_with_reply(push_team: Team, home: Path) -> None:
    """A request pushed as an event names its id; reply answers it, and the asker gets
    the answer."""
    worker2 = MessageBus("demo", "worker-2", home)
    answers: list[Any] = []

    async def main() -> None:
        async with session(server(home, "--push")) as (client, events):
            asker = threading.Thread(target=lambda: answers.append(
                worker2.ask("worker-1", "ready?", timeout=BOUND_S)), daemon=True)  # fmt: skip
            asker.start()
            event = await next_event(events)
            assert isinstance(event, Channel) and event.meta["type"] == "request"
            replied = await client.call_tool("reply", {"message_id": event.meta["message_id"],
                                                       "content": "yes"})  # fmt: skip
            assert text(replied) == "Replied to worker-2."
            await anyio.to_thread.run_sync(asker.join, BOUND_S)

    anyio.run(main)
    assert [a.content for a in answers] == ["yes"]
    worker2.close()


def test_an_event_never_lands_inside_a_response(
    push_team: Team, home: Path, tmp_path: Path
) -> None:
    """While a tool call waits (an ask nobody answers yet), messages arriving are pushed
    between whole JSON-RPC messages: every line the server wrote is one message, the
    events come before the call's response, and the response is intact."""
    worker2 = MessageBus("demo", "worker-2", home)
    worker2.set_presence("idle")
    lead = MessageBus("demo", "lead", home)
    transcript = tmp_path / "transcript.jsonl"

    async def main() -> None:
        async with session(server(home, "--push", transcript=transcript)) as (client, events):
            result: list[CallToolResult] = []

            async def ask() -> None:
                result.append(await client.call_tool("request_from_agent", {
                    "target_agent": "worker-2", "task_description": "sum it",
                    "timeout": BOUND_S}))  # fmt: skip

            async with anyio.create_task_group() as group:
                group.start_soon(ask)
                request = await anyio.to_thread.run_sync(
                    lambda: worker2.wait_for_message(MessageType.REQUEST, BOUND_S)
                )
                assert request is not None
                for n in range(5):
                    lead.send("worker-1", MessageType.TEXT, f"while you wait {n} " + "x" * 5000)
                    assert isinstance(await next_event(events), Channel)
                assert not result  # still waiting: the events came during the call
                worker2.reply(request, "9")
            assert text(result[0]) == "Response from worker-2: 9"

    anyio.run(main)
    lines = transcript.read_bytes().split(b"\n")
    assert lines.pop() == b""
    sent = [json.loads(line) for line in lines]  # each line whole: one message
    methods = [m.get("method", "response") for m in sent]
    pushed = [i for i, m in enumerate(methods) if m == "notifications/claude/channel"]
    answer = next(i for i, m in enumerate(sent) if "Response from worker-2" in json.dumps(m))
    assert len(pushed) == 5 and max(pushed) < answer
    worker2.close()
    lead.close()


def test_without_push_nothing_is_consumed_behind_the_clients_back(
    push_team: Team, home: Path
) -> None:
    """Without --push there is no channel capability and no channel event: a new
    message is announced, and waits for check_inbox."""
    lead = MessageBus("demo", "lead", home)

    async def main() -> None:
        async with session(server(home)) as (client, events):
            await subscribe(client)
            lead.send("worker-1", MessageType.TEXT, "ping")
            assert isinstance(await next_event(events), ResourceUpdatedNotification)
            assert "ping" in text(await client.call_tool("check_inbox", {}))

    anyio.run(main)
    lead.close()


def test_a_message_whose_event_was_not_written_stays_unread(team: Team, home: Path) -> None:
    """A message taken to be pushed is left alone by check_inbox until it is written;
    one that could not be written (the client gone) stays unread, for the next reader."""
    lead = MessageBus("demo", "lead", home)
    sent = lead.send("worker-1", MessageType.TEXT, "hold on")
    _, box = build("demo", "worker-1", home, push=True)
    box.start()
    try:
        pending, taken = box.look(True)
        assert pending == {sent.id} and [m.id for m, _ in taken] == [sent.id]
        assert box.look(True)[1] == []  # taken once
        assert box.check(0, threading.Event()) == "No new messages."
        box.pushed(taken[0][0], False)
        assert "hold on" in box.check(0, threading.Event())
    finally:
        box.close()
    lead.close()


def _children_running(module: str) -> list[int]:
    """The pids of this process's children whose command line holds ``module``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and module.encode() in command:
            found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts wake-ups in /proc")
def test_an_idle_pushing_server_is_not_woken_to_look_at_its_stop(team: Team, home: Path) -> None:
    """A server watching its inbox for push sleeps until mail or its safety poll (1 s,
    then 5 s): its stop and kick flags are polled beside the doorbell, not looked at in
    slices. Counted as the times its threads were woken (/proc), not timed."""
    from bench.hive import counters

    async def main() -> None:
        async with session(server(home, "--push")) as (client, events):
            await subscribe(client)
            assert text(await client.call_tool("check_inbox", {})) == "No new messages."
            (pid,) = _children_running("ralph_mail")
            before = counters([pid])[pid].wakeups
            await anyio.sleep(3.0)  # the window counted, not a synchronisation
            woke = counters([pid])[pid].wakeups - before
            assert woke <= 8, woke  # looking at its stop in slices woke it about 15 times
            MessageBus("demo", "lead", home).send("worker-1", MessageType.TEXT, "still there?")
            event = await next_event(events)
            assert isinstance(event, ResourceUpdatedNotification | Channel), event

    anyio.run(main)
