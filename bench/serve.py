"""A task given over A2A against a direct ask: what ``ralph-mail serve`` adds.

Both are answered by the same real ``ralph-mail run`` member (its command: ``echo``):

* a direct ``bus.ask`` of the member, in this process;
* a blocking A2A ``SendMessage`` to the member through a real ``ralph-mail serve``
  process, with the a2a-sdk's own client over HTTP: the server delegates the task as
  the lead, waits for its result in the task log, and answers with the task.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from types import ModuleType

from bench.channels import stop_all
from bench.cli import executable
from bench.common import Row, Section, Sizes, Workspace, child_env, optional_module, ralph

#: How long a runner or the server may take to start, or an answer to come (s).
BOUND_S = 60.0


def _start(
    exe: Path, home: Path, started: list[subprocess.Popen[bytes]], *args: str, err: bool
) -> str:
    """Start a ralph-mail child (into ``started``); its first line, on stderr with
    ``err``, else on stdout."""
    env = child_env({"RALPH_HOME": str(home), "RALPH_TEAM": "sv"})
    out, error = (subprocess.DEVNULL, subprocess.PIPE) if err else (subprocess.PIPE, None)
    proc = subprocess.Popen([str(exe), *args], env=env, stdout=out, stderr=error)
    started.append(proc)
    pipe = proc.stderr if err else proc.stdout
    assert pipe is not None
    return pipe.readline().decode()


async def _a2a_sends(base: str, token: str, n: int) -> list[float]:
    import httpx
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb

    took = []
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(headers=headers, timeout=BOUND_S) as http:
        factory = ClientFactory(ClientConfig(httpx_client=http, streaming=False))
        client = await factory.create_from_url(f"{base}/a2a/w/")
        for number in range(n):
            message = pb.Message(message_id=f"m-{number}", role=pb.ROLE_USER,
                                 parts=[pb.Part(text=f"task {number}")])  # fmt: skip
            t0 = time.perf_counter()
            async for event in client.send_message(pb.SendMessageRequest(message=message)):
                state = event.task.status.state
            took.append((time.perf_counter() - t0) * 1e3)
            if state != pb.TASK_STATE_COMPLETED:
                raise RuntimeError(f"task {number} ended {pb.TaskState.Name(state)}")
        await client.close()
    return took


def _measure(rm: ModuleType, exe: Path, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    ask = sec.add(Row("serve_ask", "bus.ask of a run member (echo)", "ms", "lower"))
    a2a = sec.add(Row("serve_a2a_send", "A2A SendMessage to it via serve (blocking)", "ms",
                      "lower", anchor=ask.key))  # fmt: skip
    home = ws.fresh("serve")
    rm.create_team("sv", ["lead", "w"], home=home)
    started: list[subprocess.Popen[bytes]] = []
    try:
        line = _start(exe, home, started, "run", "--agent", "w", "--", "echo", "done", err=True)
        if "answers with" not in line:
            raise RuntimeError(f"the runner did not start: {line!r}")
        line = _start(exe, home, started, "serve", "--team", "sv", "--port", "0", err=False)
        base, _, token = line.partition(" at ")[2].strip().partition("/?token=")
        if not token:
            raise RuntimeError(f"serve did not start: {line!r}")
        with rm.MessageBus("sv", "lead", home=home) as lead:
            for _ in range(sizes.run_samples):
                t0 = time.perf_counter()
                lead.ask("w", "what is done?", timeout=BOUND_S)
                ask.values.append((time.perf_counter() - t0) * 1e3)
        a2a.values += asyncio.run(_a2a_sends(base, token, sizes.run_samples))
    finally:
        stop_all(started)


def run(sizes: Sizes, ws: Workspace) -> Section:
    """A2A SendMessage through serve against a direct ask, to one run member."""
    sec = Section("serve", "The team over HTTP: A2A against a direct ask")
    rm, exe = ralph(), executable()
    missing = next((m for m in map(optional_module, ("starlette", "uvicorn", "a2a"))
                    if isinstance(m, str)), None)  # fmt: skip
    why = rm if isinstance(rm, str) else exe if isinstance(exe, str) else missing
    if why is not None:
        sec.add(Row("serve_a2a_send", "A2A SendMessage via serve", "ms", "lower",
                    status=f"{why} (pip install 'ralph_mail[serve]')"))  # fmt: skip
        return sec
    assert not isinstance(rm, str) and not isinstance(exe, str)
    _measure(rm, exe, ws, sizes, sec)
    return sec
