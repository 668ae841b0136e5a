"""The MCP server's cost per tool call, over a real stdio subprocess, against the same
operation through `MessageBus` directly, and MCP Agent Mail's tools beside it.

* ``send_to_agent`` through ``ralph-mail mcp`` (the official client, stdio) against
  ``bus.send`` of the same message; ``check_inbox`` with one message waiting against
  ``bus.poll``.
* New mail pushed into the session: from a send's return to the client holding the
  ``notifications/resources/updated`` of the subscribed ``ralph://inbox``, and (with
  ``--push``) the ``notifications/claude/channel`` event carrying the message.
* MCP Agent Mail's ``send_message`` and ``fetch_inbox`` (its own virtual environment,
  in-memory transport: no process boundary, which flatters it), when ``--peer-venv``
  gives one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from bench import peer_venv
from bench.ask import PEER_POLL_S
from bench.common import (
    REPO_ROOT,
    Row,
    Section,
    Sizes,
    Workspace,
    child_env,
    optional_module,
    percentile,
    ralph,
)


def _ours(rm: ModuleType, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    bus_send = sec.add(Row("bus_send", "bus.send (the same message)", "ms", "lower"))
    mcp_send = sec.add(Row("mcp_send", "send_to_agent over stdio", "ms", "lower",
                           anchor=bus_send.key))  # fmt: skip
    bus_poll = sec.add(Row("bus_poll", "bus.poll of one message", "ms", "lower"))
    mcp_check = sec.add(Row("mcp_check", "check_inbox of one message over stdio", "ms",
                            "lower", anchor=bus_poll.key))  # fmt: skip
    missing = optional_module("mcp")
    if isinstance(missing, str):
        mcp_send.status = mcp_check.status = missing
        return
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    home = ws.fresh("mcp")
    rm.create_team("mt", ["lead", "a", "b"], home=home)
    rates = {"rates": {"a": 100_000}}  # not the MCP server's default 10 a minute
    rm.load_team("mt", home).store.save_state("policy", json.dumps(rates).encode())
    env = child_env({"RALPH_HOME": str(home), "RALPH_TEAM": "mt", "RALPH_AGENT": "a"})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    server = StdioServerParameters(command=sys.executable, args=["-m", "ralph_mail", "mcp"],
                                   env=env, cwd=str(REPO_ROOT))  # fmt: skip
    lead = rm.MessageBus("mt", "lead", home=home)
    b = rm.MessageBus("mt", "b", home=home)
    calls = sizes.run_samples

    async def main() -> None:
        async with Client(server) as client:
            for warm in range(5):
                await client.call_tool("send_to_agent", {"target_agent": "lead", "message": "w"})
                lead.send("a", "text", f"warm {warm}")
                await client.call_tool("check_inbox", {})
            for n in range(calls):
                t0 = time.perf_counter()
                arguments = {"target_agent": "lead", "message": f"m {n}"}
                sent = await client.call_tool("send_to_agent", arguments)
                mcp_send.values.append((time.perf_counter() - t0) * 1e3)
                assert not sent.is_error
                lead.send("a", "text", f"news {n}")
                t0 = time.perf_counter()
                checked = await client.call_tool("check_inbox", {})
                mcp_check.values.append((time.perf_counter() - t0) * 1e3)
                assert f"news {n}" in checked.content[0].text  # type: ignore[union-attr]

    try:
        anyio.run(main)
        for n in range(calls):  # the floor, with a bus of its own (a's inbox is free now)
            t0 = time.perf_counter()
            b.send("lead", "text", f"m {n}")
            bus_send.values.append((time.perf_counter() - t0) * 1e3)
            lead.send("b", "text", f"news {n}")
            t0 = time.perf_counter()
            assert len(b.poll()) == 1
            bus_poll.values.append((time.perf_counter() - t0) * 1e3)
    finally:
        lead.close()
        b.close()


def _push(rm: ModuleType, ws: Workspace, sizes: Sizes, sec: Section) -> None:
    """A handshake-era client (as Claude Code) subscribed to the inbox of ``ralph-mail
    mcp --push``: the time from a send's return to each notification's arrival."""
    updated = sec.add(Row("mcp_push", "new mail to notifications/resources/updated (p50)",
                          "ms", "lower"))  # fmt: skip
    channel = sec.add(Row("mcp_push_channel", "new mail to its claude/channel event (p50)",
                          "ms", "lower"))  # fmt: skip
    missing = optional_module("mcp")
    if isinstance(missing, str):
        updated.status = channel.status = missing
        return
    import warnings

    import anyio
    from mcp import Client
    from mcp.client.extension import ClientExtension, NotificationBinding
    from mcp.client.stdio import StdioServerParameters
    from mcp.types import ResourceUpdatedNotification
    from pydantic import BaseModel

    home = ws.fresh("mcp-push")
    rm.create_team("mp", ["lead", "a"], home=home)
    env = child_env({"RALPH_HOME": str(home), "RALPH_TEAM": "mp", "RALPH_AGENT": "a"})
    server = StdioServerParameters(command=sys.executable,
                                   args=["-m", "ralph_mail", "mcp", "--push"], env=env,
                                   cwd=str(REPO_ROOT))  # fmt: skip
    arrived: dict[str, float] = {}
    both = [anyio.Event()]  # set once both notifications of a message came

    def note(kind: str) -> None:
        arrived[kind] = time.perf_counter()
        if len(arrived) == 2:
            both[0].set()

    class Params(BaseModel):
        content: str
        meta: dict[str, str]

    class Clock(ClientExtension):
        identifier = "com.example/bench-clock"

        def notifications(self) -> list[NotificationBinding[Params]]:
            async def got(params: Params) -> None:
                note("channel")

            return [NotificationBinding(method="notifications/claude/channel",
                                        params_type=Params, handler=got)]  # fmt: skip

    async def seen(message: object) -> None:
        if isinstance(message, ResourceUpdatedNotification):
            note("updated")

    lead = rm.MessageBus("mp", "lead", home=home)

    async def main() -> None:
        async with Client(server, mode="legacy", message_handler=seen,
                          extensions=[Clock()]) as client:  # fmt: skip
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated at 2026-07-28, current in clients
                await client.subscribe_resource("ralph://inbox")
            for n in range(5 + sizes.run_samples):
                arrived.clear()
                both[0] = anyio.Event()
                lead.send("a", "text", f"news {n}")
                sent = time.perf_counter()
                with anyio.fail_after(30):
                    await both[0].wait()
                if n >= 5:  # after the warm-up
                    updated.values.append((arrived["updated"] - sent) * 1e3)
                    channel.values.append((arrived["channel"] - sent) * 1e3)

    try:
        anyio.run(main)
    finally:
        lead.close()


def _peer(ws: Workspace, sizes: Sizes, sec: Section) -> None:
    exe = peer_venv.python(ws.peer_venv)
    status = exe if isinstance(exe, str) else "ok"
    send = sec.add(Row("agent_mail_send", "MCP Agent Mail: send_message (p50)", "ms", "lower",
                       anchor="mcp_send", status=status))  # fmt: skip
    fetch = sec.add(Row("agent_mail_fetch", "MCP Agent Mail: fetch_inbox (p50)", "ms", "lower",
                        anchor="mcp_check", status=status))  # fmt: skip
    if isinstance(exe, str):
        return
    result = peer_venv.drive(exe, ws.fresh("agent-mail-mcp"), sizes.peer_asks, PEER_POLL_S,
                             child_env())  # fmt: skip
    if isinstance(result, str):
        send.status = fetch.status = result
        return
    send.values.append(percentile(result["send_ms"], 50))
    fetch.values.append(percentile(result["fetch_ms"], 50))
    send.note = fetch.note = "one process, in-memory MCP transport"


def run(sizes: Sizes, ws: Workspace) -> Section:
    """Tool calls over stdio against the bus; MCP Agent Mail's beside them. (Not named
    ``mcp.py``: the peer's driver runs from this directory and imports the ``mcp``
    package.)"""
    sec = Section("mcp_server", "The MCP server: a tool call over stdio")
    rm = ralph()
    if isinstance(rm, str):
        sec.add(Row("mcp_send", "send_to_agent over stdio", "ms", "lower", status=rm))
        return sec
    _ours(rm, ws, sizes, sec)
    _push(rm, ws, sizes, sec)
    _peer(ws, sizes, sec)
    return sec
