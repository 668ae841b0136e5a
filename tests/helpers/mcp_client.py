"""An MCP client on an in-process server of one agent, and what its results say."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
from mcp import Client
from mcp.types import CallToolResult

from ralph_mail.mcp_server import build


def text(result: CallToolResult) -> str:
    """The one text block of a tool's result."""
    (block,) = result.content
    return block.text  # type: ignore[union-attr]


def refused(result: CallToolResult) -> str:
    """The one-line message of an error result (never the SDK's generic wrapper)."""
    assert result.is_error, text(result)
    message = text(result)
    assert "\n" not in message and not message.startswith("Error executing tool"), message
    return message


def run_in_client(
    home: Path, agent: str, body: Callable[[Client], Coroutine[Any, Any, None]]
) -> None:
    """Serve ``agent`` of team 'demo' in process and run ``body`` with a client on it."""

    async def main() -> None:
        server, box = build("demo", agent, home)
        box.start()
        try:
            async with Client(server) as client:
                await body(client)
        finally:
            box.close()

    anyio.run(main)
