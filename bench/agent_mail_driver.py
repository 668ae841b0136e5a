"""MCP Agent Mail (``mcp-agent-mail`` 0.1.0) doing the exchange `bench.ask` times.

Run by `bench.peer_ask` with the Python of a virtual environment of its own (the package
pins ``mcp`` 1.x through fastmcp 2.13, which conflicts with this project's ``mcp``
extra), so it imports nothing of ralph_mail or of the bench::

    PEER_VENV/bin/python bench/agent_mail_driver.py SCRATCH_DIR COUNT POLL_S

Two agents talk through the server's own tools, each through a client of its own over
the SDK's in-memory transport (one process: no HTTP, which flatters the peer): the
asker sends (``send_message``), the replier polls its inbox (``fetch_inbox``) every
POLL_S seconds, answers (``reply_message``), and the asker polls for the reply. It
prints one JSON object: ``send_ms`` (each send's call), ``fetch_ms`` (each of the
asker's ``fetch_inbox`` calls), ``round_trip_ms`` (send to reply seen), and the versions
it ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from importlib import metadata
from typing import Any

ASKER, REPLIER = "BlueLake", "GreenCastle"
WARMUP = 3


def _rows(result: Any) -> list[dict[str, Any]]:
    content = result.structured_content or {}
    rows = content.get("result", content) if isinstance(content, dict) else content
    return list(rows) if isinstance(rows, list) else []


async def _exchange(count: int, poll: float, project: str) -> dict[str, Any]:
    from fastmcp import Client
    from mcp_agent_mail.app import build_mcp_server

    async def quiet(message: Any) -> None:
        return None

    server = build_mcp_server()
    sends: list[float] = []
    fetches: list[float] = []
    trips: list[float] = []
    async with (
        Client(server, log_handler=quiet) as asker,
        Client(server, log_handler=quiet) as replier,
    ):
        await asker.call_tool("ensure_project", {"human_key": project})
        for client, name in ((asker, ASKER), (replier, REPLIER)):
            await client.call_tool(
                "register_agent",
                {"project_key": project, "program": "bench", "model": "none", "name": name},
            )
        stop = asyncio.Event()

        async def answer() -> None:
            answered: set[int] = set()
            while not stop.is_set():
                inbox = await replier.call_tool(
                    "fetch_inbox",
                    {"project_key": project, "agent_name": REPLIER, "limit": 20,
                     "include_bodies": True},
                )  # fmt: skip
                for message in _rows(inbox):
                    if message["id"] not in answered:
                        answered.add(message["id"])
                        await replier.call_tool(
                            "reply_message",
                            {"project_key": project, "message_id": message["id"],
                             "sender_name": REPLIER, "body_md": message.get("body_md", "")},
                        )  # fmt: skip
                await asyncio.sleep(poll)

        task = asyncio.create_task(answer())
        try:
            for n in range(WARMUP + count):
                subject = f"question {n}"
                t0 = time.perf_counter()
                await asker.call_tool(
                    "send_message",
                    {"project_key": project, "sender_name": ASKER, "to": [REPLIER],
                     "subject": subject, "body_md": str(n)},
                )  # fmt: skip
                sent = time.perf_counter()
                while True:
                    f0 = time.perf_counter()
                    inbox = await asker.call_tool(
                        "fetch_inbox", {"project_key": project, "agent_name": ASKER, "limit": 5}
                    )
                    if n >= WARMUP:
                        fetches.append((time.perf_counter() - f0) * 1e3)
                    if any(m.get("subject", "").endswith(subject) for m in _rows(inbox)):
                        break
                    await asyncio.sleep(poll)
                if n >= WARMUP:
                    sends.append((sent - t0) * 1e3)
                    trips.append((time.perf_counter() - t0) * 1e3)
        finally:
            stop.set()
            await task
    return {"send_ms": sends, "fetch_ms": fetches, "round_trip_ms": trips}


def main(argv: list[str]) -> int:
    scratch, count, poll = argv[0], int(argv[1]), float(argv[2])
    # The server reads its settings from the environment (and a .env in the working
    # directory): everything it writes goes under the scratch directory.
    os.chdir(scratch)
    os.environ.update(
        HOME=scratch,
        STORAGE_ROOT=os.path.join(scratch, "archive"),
        DATABASE_URL=f"sqlite+aiosqlite:///{os.path.join(scratch, 'mail.sqlite3')}",
        TOOLS_LOG_ENABLED="false",
        LOG_RICH_ENABLED="false",
        LOG_LEVEL="WARNING",
    )
    result = asyncio.run(_exchange(count, poll, os.path.join(scratch, "project")))
    result["versions"] = {
        name: metadata.version(name) for name in ("mcp-agent-mail", "fastmcp", "mcp")
    }
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
