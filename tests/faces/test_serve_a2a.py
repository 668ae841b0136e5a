"""`ralph-mail serve` as A2A agents, driven with the a2a-sdk's own client against a real
server process: cards, SendMessage (blocking, returning at once, streaming) answered by
a real `ralph-mail run` member, GetTask, ListTasks, SubscribeToTask, CancelTask, and a
task that outlives a restart of the server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="needs the serve extra: pip install 'ralph_mail[serve]'")
pytest.importorskip("a2a", reason="needs the serve extra: pip install 'ralph_mail[serve]'")

import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InvalidRequestError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from ralph_mail import MessageBus, Team, create_team
from ralph_mail.govern.policy import Rule
from ralph_mail.serve.a2a import a2a_state
from ralph_mail.team import load_team
from tests.helpers.processes import BOUND_S, Processes, ralph, runner
from tests.helpers.serving import Served, serve

ECHO = 'echo "done by $RALPH_AGENT for $RALPH_FROM: $(tail -n 1)"'


@asynccontextmanager
async def a2a_client(served: Served, agent: str, streaming: bool = False) -> AsyncIterator[Client]:
    """The SDK's client of member ``agent``, from its card, with the access token."""
    async with httpx.AsyncClient(headers=served.auth, timeout=BOUND_S) as http:
        factory = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming))
        client = await factory.create_from_url(f"{served.base}/a2a/{agent}/")
        try:
            yield client
        finally:
            await client.close()


def send(text: str, *, at_once: bool = False) -> pb.SendMessageRequest:
    message = pb.Message(message_id=f"m-{abs(hash(text)) % 10**8}", role=pb.ROLE_USER,
                         parts=[pb.Part(text=text)])  # fmt: skip
    return pb.SendMessageRequest(
        message=message, configuration=pb.SendMessageConfiguration(return_immediately=at_once)
    )


async def sent(client: Client, request: pb.SendMessageRequest) -> list[pb.StreamResponse]:
    return [event async for event in client.send_message(request)]


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), BOUND_S * 2))


def test_cards_name_each_member_with_its_skill(procs: Processes, team: Team) -> None:
    served = serve(procs, team.home)
    card = httpx.get(f"{served.base}/a2a/worker-1/.well-known/agent-card.json",
                     headers=served.auth, timeout=BOUND_S).json()  # fmt: skip
    assert card["name"] == "worker-1" and card["description"] == "parses logs"
    assert [s["description"] for s in card["skills"]] == ["parses logs"]
    assert card["supportedInterfaces"][0]["url"] == f"{served.base}/a2a/worker-1/"
    assert card["capabilities"]["streaming"] is True
    anyone = httpx.get(f"{served.base}/a2a/worker-1/.well-known/agent-card.json",
                       timeout=BOUND_S)  # fmt: skip
    assert anyone.status_code == 401
    for who in ("nobody", "lead"):  # not a member; the caller itself
        missing = httpx.get(f"{served.base}/a2a/{who}/.well-known/agent-card.json",
                            headers=served.auth, timeout=BOUND_S)  # fmt: skip
        assert missing.status_code == 404


def test_send_message_delegates_and_the_task_log_answers(procs: Processes, team: Team) -> None:
    runner(procs, team.home, "worker-1", ECHO)
    served = serve(procs, team.home)

    async def body() -> None:
        async with a2a_client(served, "worker-1") as client:
            (blocking,) = await sent(client, send("parse the logs"))
            task = blocking.task
            assert task.status.state == pb.TASK_STATE_COMPLETED
            result = "done by worker-1 for lead: parse the logs"
            assert task.artifacts[0].parts[0].text == result
            assert task.status.message.parts[0].text == result
            assert [m.role for m in task.history] == [pb.ROLE_USER, pb.ROLE_AGENT]
            # the same task, in the team's log: delegated by the caller (the lead)
            (logged,) = [t for t in MessageBus("demo", "lead", team.home).tasks()
                         if t.id == task.id]  # fmt: skip
            assert (logged.delegated_by, logged.assignee, logged.status) == (
                "lead", "worker-1", "completed")  # fmt: skip
            (at_once,) = await sent(client, send("count the errors", at_once=True))
            assert at_once.task.status.state in (pb.TASK_STATE_SUBMITTED, pb.TASK_STATE_WORKING,
                                                 pb.TASK_STATE_COMPLETED)  # fmt: skip
            deadline = asyncio.get_running_loop().time() + BOUND_S
            while (await client.get_task(pb.GetTaskRequest(id=at_once.task.id))).status.state \
                    != pb.TASK_STATE_COMPLETED:  # fmt: skip
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            listed = await client.list_tasks(pb.ListTasksRequest())
            assert {t.id for t in listed.tasks} == {task.id, at_once.task.id}
            assert listed.total_size == 2
            paged = await client.list_tasks(pb.ListTasksRequest(page_size=1))
            assert len(paged.tasks) == 1 and paged.next_page_token == "1"
            failed = await client.list_tasks(pb.ListTasksRequest(status=pb.TASK_STATE_FAILED))
            assert list(failed.tasks) == []
            with pytest.raises(TaskNotCancelableError, match="completed"):
                await client.cancel_task(pb.CancelTaskRequest(id=task.id))
            with pytest.raises(TaskNotFoundError, match="no task"):
                await client.get_task(pb.GetTaskRequest(id="t-nope"))

    run(body)


def test_streaming_and_subscribing_follow_the_task(procs: Processes, team: Team) -> None:
    gate = team.home / "go"
    runner(procs, team.home, "worker-1", f"while [ ! -e {gate} ]; do sleep 0.05; done; {ECHO}")
    served = serve(procs, team.home)

    async def body() -> None:
        async with a2a_client(served, "worker-1", streaming=True) as client:
            events = client.send_message(send("slow work"))
            first = await anext(events)
            task_id = first.task.id
            # given out; its runner may have started it already
            assert first.task.status.state in (pb.TASK_STATE_SUBMITTED, pb.TASK_STATE_WORKING)

            async def subscribed() -> list[pb.StreamResponse]:
                request = pb.SubscribeToTaskRequest(id=task_id)
                return [event async for event in client.subscribe(request)]

            follower = asyncio.ensure_future(subscribed())
            await asyncio.sleep(0.3)  # the subscription is open before the task moves on
            gate.touch()
            rest = [event async for event in events]
            states = [e.status_update.status.state for e in rest if e.HasField("status_update")]
            assert states[-1] == pb.TASK_STATE_COMPLETED
            seen = await follower
            assert seen[0].task.id == task_id
            assert seen[-1].status_update.status.state == pb.TASK_STATE_COMPLETED
            with pytest.raises(UnsupportedOperationError, match="has ended"):
                await anext(client.subscribe(pb.SubscribeToTaskRequest(id=task_id)))

    run(body)


def test_cancel_task_cancels_it_in_the_task_log(procs: Processes, team: Team) -> None:
    runner(procs, team.home, "worker-1", f"sleep {BOUND_S}; {ECHO}")
    served = serve(procs, team.home)

    async def body() -> None:
        async with a2a_client(served, "worker-1") as client:
            (event,) = await sent(client, send("never mind", at_once=True))
            canceled = await client.cancel_task(pb.CancelTaskRequest(id=event.task.id))
            assert canceled.status.state == pb.TASK_STATE_CANCELED
            again = await client.get_task(pb.GetTaskRequest(id=event.task.id))
            assert again.status.state == pb.TASK_STATE_CANCELED

    run(body)
    (task,) = MessageBus("demo", "lead", team.home).tasks()
    assert (task.status, task.ended_by) == ("canceled", "lead")


def test_a_task_outlives_a_restart_of_the_server(procs: Processes, team: Team) -> None:
    served = serve(procs, team.home)
    runner(procs, team.home, "worker-2", ECHO)

    async def give() -> str:
        async with a2a_client(served, "worker-2") as client:
            (event,) = await sent(client, send("remember me"))
            return event.task.id

    task_id = asyncio.run(give())
    served.proc.terminate()
    assert served.proc.wait(timeout=BOUND_S) == 0
    again = serve(procs, team.home)

    async def look() -> None:
        async with a2a_client(again, "worker-2") as client:
            task = await client.get_task(pb.GetTaskRequest(id=task_id))
            assert task.status.state == pb.TASK_STATE_COMPLETED
            assert task.artifacts[0].parts[0].text == "done by worker-2 for lead: remember me"

    run(look)


def test_the_policy_judges_the_caller(procs: Processes, team: Team) -> None:
    with MessageBus("demo", "lead", team.home) as lead:
        lead.change_policy(lambda p: p.with_rule(Rule("worker-2", "worker-1", "deny")))
    runner(procs, team.home, "worker-1", ECHO)
    served = serve(procs, team.home, "--caller", "worker-2")

    async def body() -> None:
        async with a2a_client(served, "worker-1") as client:
            with pytest.raises(InvalidRequestError, match="worker-1"):
                await sent(client, send("not allowed"))
        async with a2a_client(served, "lead") as client:  # offline: refused, said why
            with pytest.raises(InvalidRequestError, match="offline"):
                await sent(client, send("nobody runs me"))

    run(body)
    assert MessageBus("demo", "lead", team.home).tasks() == []


def test_the_states_map_onto_a2as() -> None:
    names = {"pending": "SUBMITTED", "submitted": "SUBMITTED", "active": "WORKING",
             "working": "WORKING", "input_required": "INPUT_REQUIRED",
             "completed": "COMPLETED", "failed": "FAILED", "canceled": "CANCELED",
             "rejected": "REJECTED", "something-new": "UNSPECIFIED"}  # fmt: skip
    for status, state in names.items():
        assert pb.TaskState.Name(a2a_state(status)) == f"TASK_STATE_{state}", status


def test_a_caller_that_is_no_member_is_refused(team: Team) -> None:
    done = ralph(team.home, "serve", "--team", "demo", "--port", "0", "--caller", "ghost")
    assert done.returncode == 2 and b"unknown agent 'ghost'" in done.stderr


def test_a_remote_member_is_asked_and_delegated_to_over_a2a(procs: Processes, home: Path) -> None:
    """Team 'near' has a member that stands for worker 'w' of team 'far', served
    elsewhere: an ask and a delegation to it are answered by 'w', over A2A."""
    create_team("far", ["lead", ("w", "translates")], home=home)
    create_team("near", ["lead", "writer"], home=home)
    runner(procs, home, "w", ECHO, team="far")
    far = serve(procs, home, team="far")
    address = f"{far.base}/a2a/w/?token={far.token}"
    added = ralph(home, "team", "add-remote", "near", "helper", address,
                  "--description", "far's translator", "--agent", "lead")  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert far.token.encode() not in added.stdout  # the token is not shown
    roster = load_team("near", home)
    assert roster.member("helper").remote == address
    serve(procs, home, team="near")  # it answers for helper
    asked = ralph(home, "ask", "helper", "bonjour", "--team", "near", "--agent", "writer",
                  "--timeout", str(BOUND_S))  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.decode().strip() == "done by w for lead: bonjour"
    with MessageBus("near", "writer", home) as writer:
        since = writer.store.size("writer")
        task = writer.delegate("helper", "merci")
        result = writer.wait_for_result(task, BOUND_S, since)
    assert result is not None and result.content == "done by w for lead: merci"
    # on far, each is a task delegated by its caller, in its task log
    far_tasks = [t.description for t in MessageBus("far", "lead", home).tasks()]
    assert far_tasks == ["bonjour", "merci"]


def test_add_remote_refuses_bad_input(team: Team) -> None:
    for args, code, said in (
        (["team", "add-remote", "demo", "worker-1", "http://x/", "--agent", "lead"], 2,
         b"already a member"),
        (["team", "add-remote", "demo", "far", "ftp://x/", "--agent", "lead"], 2,
         b"give an http:// or https:// URL"),
        (["team", "add-remote", "demo", "far", "http://x/", "--agent", "worker-1"], 4,
         b"the lead's to do"),
        (["team", "add-remote", "demo", "../x", "http://x/", "--agent", "lead"], 2,
         b"invalid agent name"),
    ):  # fmt: skip
        done = ralph(team.home, *args)
        assert done.returncode == code, (args, done.stderr)
        assert said in done.stderr, done.stderr
    assert load_team("demo", team.home).names == ("lead", "worker-1", "worker-2")
