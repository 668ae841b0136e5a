"""The stdio transport of `ralph-mail mcp`: JSON-RPC, one message a line, on this
process's standard input and output (DESIGN §12.1).

It is the server's own, not the SDK's: it reads standard input in chunks, so a line over
`settings.MCP_MAX_REQUEST_BYTES` is answered with a JSON-RPC error and skipped without
being held whole, and a line that is not JSON gets a parse error (-32700); either way
the server goes on. Everything for the client, the SDK's responses and the inbox's
notifications alike, goes through one stream and is written one whole line at a time,
so a notification is only ever written between two messages.

Example:
    >>> anyio.run(serve_stdio, server)    # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage
from mcp.types import (
    INVALID_REQUEST,
    PARSE_ERROR,
    ErrorData,
    JSONRPCError,
    RequestId,
    jsonrpc_message_adapter,
)
from pydantic import ValidationError

from ralph_mail import settings
from ralph_mail.mcp_push import CHANNEL_CAPABILITY, InboxWatch, Written

if TYPE_CHECKING:
    from ralph_mail.mcp_server import MCPServer

#: What a client sends once the handshake is done: from then on events may go to it.
_INITIALIZED: Final = "notifications/initialized"
#: The id at the head of a JSON-RPC line (``{"jsonrpc": "2.0", "id": 7, ...``, as clients
#: write it), so the error for a line that is not read whole reaches the call waiting.
_HEAD_ID: Final = re.compile(rb'\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*'
                             rb'(-?\d+|"(?:[^"\\]|\\.)*")')  # fmt: skip


async def serve_stdio(server: MCPServer) -> None:
    """Serve ``server`` over this process's standard input and output. While it serves,
    fd 0 reads the null device and fd 1 writes to stderr, so nothing a tool or a child
    prints reaches the protocol; both are given back after. The inbox's watch runs
    beside the server, writing its notifications to the same stream."""
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
        os.dup2(2, 1)
        to_server, from_client = anyio.create_memory_object_stream[SessionMessage | Exception]()
        to_client, from_server = anyio.create_memory_object_stream[SessionMessage]()
        lowlevel = server._lowlevel_server  # the SDK's own stdio runner does the same
        async with anyio.create_task_group() as writing:
            writing.start_soon(_write_out, wire_out, from_server)
            async with anyio.create_task_group() as reading:
                watch = server.watch
                reading.start_soon(_read_in, wire_in, to_server, to_client.clone(), watch)
                channel = watch is not None and watch.push
                if watch is not None:
                    reading.start_soon(watch.serve, to_client.clone())
                options = lowlevel.create_initialization_options(
                    experimental_capabilities={CHANNEL_CAPABILITY: {}} if channel else None
                )
                await lowlevel.run(from_client, to_client, options)
                reading.cancel_scope.cancel()  # it may sit in a read of a pipe left open
    finally:
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)
        for fd in (null, wire_in, wire_out):
            os.close(fd)


async def _read_in(fd: int, to_server: MemoryObjectSendStream[SessionMessage | Exception],
                   to_client: MemoryObjectSendStream[SessionMessage],
                   watch: InboxWatch | None = None) -> None:  # fmt: skip
    """Each line of ``fd`` to the server as a message; a line too long or not JSON-RPC is
    answered here with an error, and the next is read. The client's
    ``notifications/initialized`` tells ``watch`` it may push."""
    limit = settings.MCP_MAX_REQUEST_BYTES
    async with to_server, to_client:
        async for line, whole in _lines(fd, limit):
            if not whole:
                text = f"message over {limit} bytes refused: send less (a path, not a file)"
                await to_client.send(_error(_id_of(line), INVALID_REQUEST, text))
                continue
            if not line.strip():
                continue
            try:
                message = jsonrpc_message_adapter.validate_json(line, by_name=False)
            except ValidationError as exc:
                if any(error["type"] == "json_invalid" for error in exc.errors()):
                    text = "parse error: each message is one line of JSON"
                    await to_client.send(_error(None, PARSE_ERROR, text))
                else:
                    text = "invalid request: not a JSON-RPC 2.0 message"
                    await to_client.send(_error(_id_of(line), INVALID_REQUEST, text))
                continue
            await to_server.send(SessionMessage(message))
            if watch is not None and getattr(message, "method", "") == _INITIALIZED:
                watch.ready()


async def _lines(fd: int, limit: int) -> AsyncIterator[tuple[bytes, bool]]:
    """The lines of ``fd`` (without their newline) and True; for a line over ``limit``
    bytes, its first bytes and False as soon as it is known, the rest skipped unread. At
    most ``limit`` bytes and one chunk are held at a time."""
    pending, skipping = bytearray(), False
    while chunk := await anyio.to_thread.run_sync(
        os.read, fd, settings.MCP_READ_CHUNK_BYTES, abandon_on_cancel=True
    ):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not skipping and len(pending) + len(piece) > limit:
                head = bytes((pending + piece[:256])[:256])
                pending.clear()
                skipping = True
                yield head, False
            elif not skipping:
                pending += piece
            if end < 0:
                break
            if not skipping:
                yield bytes(pending), True
            pending.clear()
            skipping, start = False, end + 1
    if pending and not skipping:
        yield bytes(pending), True


async def _write_out(fd: int, from_server: MemoryObjectReceiveStream[SessionMessage]) -> None:
    """Each message for the client as one line on ``fd``; once the client is gone, none.
    A message that rides with `Written` is told when it was written whole."""
    async with from_server:
        async for item in from_server:
            data = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
            written = item.metadata if isinstance(item.metadata, Written) else None
            try:
                await anyio.to_thread.run_sync(_write_all, fd, data.encode())
            except OSError:
                if written is not None:
                    written.done.set()
                return
            if written is not None:
                written.ok = True
                written.done.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _id_of(line: bytes) -> RequestId | None:
    """The id a line starts with, or None (JSON-RPC's id for "unknown")."""
    found = _HEAD_ID.match(line)
    id_: RequestId | None = json.loads(found[1]) if found else None
    return id_


def _error(id_: RequestId | None, code: int, text: str) -> SessionMessage:
    error = ErrorData(code=code, message=text)
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=id_, error=error))
