"""Members that stand for A2A agents elsewhere (``ralph-mail team add-remote``).

While `ralph-mail serve` serves the team, each such member is answered by a `Runner` on
a thread of the server, whose command is this module: ``python -m
ralph_mail.serve.remote`` reads the request (the runner's JSON) on its standard
input, sends its text to the agent at the member's address in the roster (the runner
names the team and the member in the job's environment) with the a2a-sdk's client (a blocking
SendMessage), and prints the answer: the task's result, or its status message. A task
that failed or was refused there exits 1 with why, which the runner sends as the error.
So an ``ask`` or a ``delegate`` to the member gets its answer like any member's, and
the runner's guarantees hold (one answer a request, consumed only once answered).

A URL may carry the remote server's token (``?token=...``, as ``ralph-mail serve``
prints it): it is sent as ``Authorization: Bearer``, never in the address, and the
address is read from the roster, not passed on a command line another user's ``ps``
shows.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import TYPE_CHECKING, Final

import orjson

if TYPE_CHECKING:
    from ralph_mail.serve.team import TeamView

#: How long a remote task may take before the runner kills the call (s).
TIMEOUT_S: Final = 600.0
#: Requests passed on at once per remote member.
JOBS: Final = 4
#: How long the server waits for a remote member's runner to be online (s).
STARTUP_S: Final = 30.0


def split(url: str) -> tuple[str, str | None]:
    """The address without its ``?token=``, and the token (None without one)."""
    base, _, query = url.partition("?")
    token = None
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if key == "token" and value:
            token = value
    return base, token


async def send(url: str, text: str, timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """Send ``text`` to the A2A agent at ``url`` and wait for its task to end:
    (True, the answer) when it completed, else (False, why)."""
    import uuid

    import httpx
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb

    base, token = split(url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=timeout) as http:
        factory = ClientFactory(ClientConfig(httpx_client=http, streaming=False))
        client = await factory.create_from_url(base)
        message = pb.Message(message_id=uuid.uuid4().hex, role=pb.ROLE_USER,
                             parts=[pb.Part(text=text)])  # fmt: skip
        try:
            async for event in client.send_message(pb.SendMessageRequest(message=message)):
                if event.HasField("message"):  # an agent may answer with a message alone
                    return True, "".join(p.text for p in event.message.parts)
                task = event.task
        finally:
            await client.close()
    answer = "".join(p.text for a in task.artifacts for p in a.parts)
    said = "".join(p.text for p in task.status.message.parts)
    if task.status.state == pb.TASK_STATE_COMPLETED:
        return True, answer or said
    return False, f"{pb.TaskState.Name(task.status.state).lower()[11:]}: {said or 'no reason'}"


def main(argv: list[str]) -> int:
    """The runner's command: the request on stdin, the answer on stdout."""
    if argv:
        print("usage: python -m ralph_mail.serve.remote (run by ralph-mail serve)",
              file=sys.stderr)  # fmt: skip
        return 2
    from ralph_mail.errors import MailError
    from ralph_mail.team import load_team

    env = os.environ
    try:
        url = load_team(env["RALPH_TEAM"], env["RALPH_HOME"]).member(env["RALPH_AGENT"]).remote
    except (KeyError, MailError) as exc:
        print(f"cannot find the member's address in its roster: {exc}", file=sys.stderr)
        return 2
    if url is None:
        print(f"{env['RALPH_AGENT']} is not a remote member of {env['RALPH_TEAM']}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        request = orjson.loads(sys.stdin.buffer.read())
        text = str(request["message"]["content"])
        done, answer = asyncio.run(send(url, text))
    except Exception as exc:  # the agent is not there, refused, answered nonsense
        print(f"the A2A agent at {split(url)[0]} failed: {exc}", file=sys.stderr)
        return 1
    print(answer, file=sys.stdout if done else sys.stderr)
    return 0 if done else 1


def bridge(view: TeamView, stop: threading.Event) -> list[threading.Thread]:
    """A runner thread for each remote member of the team, until ``stop`` is set;
    returns once each is online (or could not start: another process answers it)."""
    from ralph_mail.errors import MailError
    from ralph_mail.runner import Runner

    started = []
    for member in view.team().members:
        if member.remote is None:
            continue
        command = [sys.executable, "-m", "ralph_mail.serve.remote"]
        runner = Runner(view.name, member.name, command, view.home, jobs=JOBS,
                        timeout=TIMEOUT_S, format="json")  # fmt: skip
        online = threading.Event()

        def answer(runner: Runner = runner, online: threading.Event = online) -> None:
            try:
                runner.serve(stop, ready=online.set)
            except MailError as exc:  # another process answers it already
                print(f"ralph-mail: warning: {exc}", file=sys.stderr, flush=True)
            finally:
                online.set()

        thread = threading.Thread(target=answer, name=f"ralph-serve-{member.name}", daemon=True)
        thread.start()
        online.wait(STARTUP_S)
        started.append(thread)
    return started


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
